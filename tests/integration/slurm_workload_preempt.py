"""srun task for the Slurm preemption test: the trainer's preemption contract on a toy loop.

Each step all-reduces (rank+1)*step plus a random draw from this rank's python RNG into a
running total. On SIGUSR1 (rhymerl.launch.preemption) the ranks agree at the step end, save a
checkpoint through CheckpointManager (total, step, per-rank RNG, a per-rank backend shard),
rank 0 runs `scontrol requeue`, and all exit 0. The restarted job resumes from the newest
valid checkpoint, so the final total equals an uninterrupted run's only if the resume is exact.
argv: CONFIG [overrides]. RHYMERL_TEST_STEP_S: seconds per step.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from rhymerl.launch.preemption import PreemptionHandler, requeue_current_job
from rhymerl.outputs.checkpoint import CheckpointManager, capture_rng_state, check_compatible, restore_rng_state
from rhymerl.config import load_config, to_dict


def main() -> int:
    cfg = load_config(sys.argv[1], sys.argv[2:])
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    step_s = float(os.environ.get("RHYMERL_TEST_STEP_S", "0.5"))
    handler = PreemptionHandler()
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    run_dir = Path(cfg.run.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    mgr = CheckpointManager(cfg.checkpoint, run_dir, rank=rank, world_size=world, barrier=dist.barrier)
    random.seed(cfg.run.seed + rank)
    total, start = 0.0, 1
    path = mgr.find_resume()
    if path is not None:
        ck = mgr.load(path)
        check_compatible(ck.config, to_dict(cfg))
        total, start = ck.state["total"], ck.step + 1
        restore_rng_state(ck.rank_state["rng"])
        shard = (ck.backend_dir / f"shard-{rank}.txt").read_text()
        print(f"RESUMED from {path.name} at step {ck.step} total={total} shard={shard!r}", flush=True)
    for step in range(start, cfg.run.max_steps + 1):
        time.sleep(step_s)
        t = torch.tensor([(rank + 1) * step + random.random()], dtype=torch.float64)
        dist.all_reduce(t)
        total += t.item()
        print(f"step {step} total={total!r}", flush=True)
        if rank == 0:
            (run_dir / "progress").write_text(str(step))
        flag = torch.tensor([1 if handler.requested else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and step < cfg.run.max_steps:
            saved = mgr.save(step, {"total": total}, rank_state={"rng": capture_rng_state()},
                             backend_save=lambda d: (d / f"shard-{rank}.txt").write_text(f"rank{rank}@{step}"),
                             config=to_dict(cfg))
            print(f"CHECKPOINTED {saved.name} on {handler.signal_name}", flush=True)
            if rank == 0:
                print(f"REQUEUE issued={requeue_current_job()}", flush=True)
            dist.destroy_process_group()
            return 0
    if rank == 0:
        (run_dir / "result.json").write_text(json.dumps({"total": total, "start": start,
                                                         "restart": int(os.environ.get("SLURM_RESTART_COUNT", 0))}))
    print(f"DONE total={total!r} start={start}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
