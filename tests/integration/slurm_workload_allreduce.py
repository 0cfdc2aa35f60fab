"""srun task for the Slurm launch test: join a gloo group from the rendered job's env and all-reduce.

Prints one JSON line with what the task saw, so the test can check ranks and rendezvous.
argv: CONFIG [overrides] (as the rendered script passes them to every task).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from rhymerl.config import load_config


def main() -> int:
    cfg = load_config(sys.argv[1], sys.argv[2:])
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    seen = {
        "rank": rank, "world": world, "local_rank": int(os.environ["SLURM_LOCALID"]),
        "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", "allreduce": t.item(),
        "run_name": cfg.run.name, "lr": cfg.algo.lr, "omp": os.environ.get("OMP_NUM_THREADS"),
        "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
    }
    print("RESULT " + json.dumps(seen), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
