"""What a run writes and reads back: checkpoints, metrics and traces, W&B and console tracking,
the HTML report."""
