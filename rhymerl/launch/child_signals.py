"""Helper processes that survive the job's signals and die with their parent.

Slurm signals every process of a job step (``scancel --signal=USR1``, ``--signal=USR1@lead``,
the time limit's SIGTERM), not only the trainer: the default action of SIGUSR1/SIGTERM would
kill the checkpoint writer's results queue, the reward workers and W&B's service in the
middle of the very save the signal asks for. Those signals are meant for the trainer, which
decides (rhymerl.launch.preemption); its helpers must ignore them and end when the trainer ends.

- ``shielded_start()`` wraps the code that starts a helper: the starting thread blocks
  ``JOB_SIGNALS`` meanwhile, and a blocked mask is inherited through fork and exec (a Python
  child, or a Go binary such as wandb-core, keeps it). The trainer's own handlers still run:
  the kernel hands a process-directed signal to a thread that does not block it.
- ``shield_this_process()`` is the first line of a helper we start ourselves: ignore the job's
  signals and get SIGKILL when the parent dies (``PR_SET_PDEATHSIG``), so a trainer that dies,
  however it dies, leaves no helper behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from contextlib import contextmanager
from typing import Iterator, Optional

JOB_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1


@contextmanager
def shielded_start() -> Iterator[None]:
    """Processes started in this block (fork, spawn, subprocess) inherit ``JOB_SIGNALS`` blocked."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def die_with_parent(parent_pid: Optional[int] = None) -> bool:
    """SIGKILL this process when the thread that started it exits; True if it is armed.

    ``parent_pid``: the parent's pid if the caller knows it (default: the parent now). If the
    parent is gone by the time the death signal is armed, exit at once: it would never come.
    """
    if not sys.platform.startswith("linux"):
        return False
    expected = os.getppid() if parent_pid is None else parent_pid
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != expected:
        os._exit(1)
    return True


def shield_this_process(parent_pid: Optional[int] = None) -> None:
    """In a helper process: ignore the job's signals and die with the parent."""
    for sig in JOB_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(parent_pid)


def start_shielded_manager(ctx=None):
    """A started ``multiprocessing`` SyncManager whose server process is shielded."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    mgr = SyncManager(ctx=ctx or multiprocessing.get_context("spawn"))
    with shielded_start():
        mgr.start(initializer=shield_this_process, initargs=(os.getpid(),))
    return mgr
