"""Two ranks, one RL step, a checkpoint, then a resumed step, with every collective audited.

gloo is declared to take ``lazy`` tensors (``rhymerl.distributed.devices``), so a collective that is handed
a tensor made without asking for its group's device (a CPU tensor, as an NCCL group would
refuse) fails the run. The same run records the colocation calls and checks their order:
at start-up the training state (policy and KL reference) leaves the device before the engine
is built, and the engine sleeps at once; each step the engine wakes its weights, takes the
trainer's, wakes its KV cache, rolls out, sleeps; the training state comes back, trains and
leaves again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("colocated_step_worker.py")
SMALL = ["model.path=builtin:tiny", "data.size=4", "data.prompts_per_step=2", "rollout.n=2",
         "rollout.max_tokens=6", "reward.workers=0", "tracking.wandb=disabled",
         "tracking.console=none", "checkpoint.every_steps=1", "run.save_traces=false",
         # A KL reference: its log-prob pass gathers over data parallel (an on-policy step
         # without one takes its log-probs from the loss's forward and gathers nothing).
         "algo.kl_coef=0.01"]

# Start-up and one step of the colocated protocol, as recorded (rank-local calls only; the
# trainer's calls come twice: the policy and the KL reference).
START = ["trainer.offload", "trainer.offload", "engine.sleep"]
STEP = ["engine.wake_up:weights", "engine.load_weights", "engine.wake_up:kv_cache", "rollout", "engine.sleep",
        "trainer.onload", "trainer.onload", "train", "trainer.offload", "trainer.offload"]


def _launch(out: Path, steps: int, tag: str) -> list[dict]:
    from rhymerl.training.local_launch import run_ranks

    args = [str(out / tag), str(REPO / "configs" / "tiny-cpu.yaml"), *SMALL, f"run.output_dir={out / 'run'}",
            f"run.max_steps={steps}"]
    run_ranks(WORKER, args, 2, timeout_s=300, log_dir=out / tag / "logs")
    return [json.loads((out / tag / f"rank{r}.json").read_text()) for r in range(2)]


def test_colocated_steps_collectives_on_group_device_and_call_order(tmp_path):
    first = _launch(tmp_path, 1, "first")
    resumed = _launch(tmp_path, 2, "resumed")
    for rank in range(2):
        ev = first[rank]["events"]
        assert ev == [*START, *STEP, "checkpoint.save"], ev
        ev = resumed[rank]["events"]
        # Resume: the checkpoint's weights go into the fresh engine before the first rollout
        # (every first rollout takes the trainer's weights).
        assert ev == ["checkpoint.load", *START, *STEP, "checkpoint.save"], ev
    for part in (first, resumed):
        checked = part[0]["audit"]["checked"]
        # The step's own collectives ran through the audit: the stop flag (all_reduce) and the
        # data-parallel gather of the reference log-probs.
        assert checked.get("all_reduce/own", 0) >= 1 and checked.get("all_gather/own", 0) >= 1, checked
        assert part[0]["audit"]["bridged"] >= 2
