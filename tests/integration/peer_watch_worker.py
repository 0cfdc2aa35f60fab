"""One rank of a gloo world that all-gathers in a loop, with the trainer's lost-rank handling:
`python peer_watch_worker.py LOG_DIR` under RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from rhymerl.distributed.peer_watch import DIAGNOSE_S, PeerWatch
from rhymerl.launch import user_errors


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    watch = PeerWatch.from_env(rank, world)
    step = 0
    try:
        while True:
            out = [None] * world
            dist.all_gather_object(out, step)
            if step == 0:
                print("ready", flush=True)
            step += 1
            time.sleep(0.05)
    except Exception as e:
        lost = watch.explain(e, f"during step {step}")
        if lost is None:
            raise
        code = user_errors.report(lost, Path(sys.argv[1]), rank)
        watch.close("lost-peer", linger_s=DIAGNOSE_S + 2 if rank == 0 else 0)
        return code


if __name__ == "__main__":
    sys.exit(main())
