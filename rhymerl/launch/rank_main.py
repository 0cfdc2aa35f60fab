"""Entry point that every srun / torchrun task runs: `python -m rhymerl.launch.rank_main CONFIG [overrides]`."""

# Before any other import: without a handler, an early SIGUSR1 from Slurm kills the process.
from rhymerl.launch.preemption import PreemptionHandler

_PREEMPT = PreemptionHandler()

import os  # noqa: E402
import sys  # noqa: E402

from rhymerl.launch import netif  # noqa: E402
from rhymerl.launch.train import launcher_env, run_from_config  # noqa: E402


def _set_socket_interfaces(rank: int) -> None:
    """Point gloo/NCCL at the interface that routes to MASTER_ADDR, unless the user chose one."""
    nnodes = netif.job_nodes(os.environ)
    if nnodes <= 1:
        return
    hints = netif.socket_env_hints(os.environ, nnodes)
    print(f"[rhymerl] rank {rank}: {netif.describe(os.environ, hints)}", file=sys.stderr, flush=True)
    os.environ.update(hints)


if __name__ == "__main__":
    rank, world, local = launcher_env()
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", str(local))
    _set_socket_interfaces(rank)
    sys.exit(run_from_config(sys.argv[1:], _PREEMPT))
