"""What a run writes and reads back: checkpoints, metrics, traces, tracking and the HTML report."""
