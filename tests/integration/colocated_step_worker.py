"""One rank of the colocated-step test (started by rhymerl.training.local_launch.run_ranks).

Runs the real driver (``rhymerl.launch.train.run``: trainer, vLLM engine, megatron backend, checkpoints)
with the collective-device audit installed and, on CPU, gloo declared to take ``lazy`` tensors, so
any collective handed a tensor that was not put on its group's device fails the run (on a GPU
NCCL's CUDA is audited as it is; tests/gpu/audited_rank.py does that for the GPU node smoke
check, tests/gpu/node_smoke.sh). The calls the
colocation protocol depends on are recorded in order and written, with the audit's counts, to
``OUT/rank<r>.json``.

    python colocated_step_worker.py OUT CONFIG [overrides...]
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

EVENTS: list[str] = []


def _record(cls, name: str, label: str) -> None:
    real = getattr(cls, name)

    @functools.wraps(real)
    def recorded(self, *args, **kwargs):
        tag = label
        if name == "wake_up":
            tags = args[0] if args else kwargs.get("tags")
            tag = f"{label}:{','.join(tags) if tags else 'all'}"
        EVENTS.append(tag)
        return real(self, *args, **kwargs)

    setattr(cls, name, recorded)


def main() -> int:
    out, config, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    from rhymerl.launch.train import run
    from rhymerl.distributed import devices
    from rhymerl.outputs.checkpoint import CheckpointManager
    from rhymerl.distributed.collective_audit import CollectiveAudit, lazy_device
    from rhymerl.config import load_config
    from rhymerl.rollout.engine import RolloutEngine
    from rhymerl.training.megatron_backend import MegatronBackend

    import torch

    if not torch.cuda.is_available():
        # On CPU: a device that is neither the model's nor anything a collective gets by accident.
        # (On a GPU the audit holds NCCL calls to CUDA as they are.)
        devices.declare_backend_device("gloo", lazy_device())
    audit = CollectiveAudit().install()
    # begin_requests: once per batch of requests, from generate() and the live scheduler alike
    for name, label in (("begin_requests", "rollout"), ("sleep", "engine.sleep"), ("wake_up", "engine.wake_up"),
                        ("load_weights", "engine.load_weights")):
        _record(RolloutEngine, name, label)
    for name, label in (("train_step", "train"), ("offload_training_state", "trainer.offload"),
                        ("onload_training_state", "trainer.onload")):
        _record(MegatronBackend, name, label)
    _record(CheckpointManager, "save", "checkpoint.save")
    _record(CheckpointManager, "load", "checkpoint.load")

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = load_config(config, overrides)
    rc = run(cfg, rank, world)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"events": EVENTS, "audit": audit.summary()}))
    return rc


if __name__ == "__main__":
    sys.exit(main())
