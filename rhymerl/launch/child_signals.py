"""Helper processes that survive the job's signals (sent to every process) and die with their parent."""

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
    """SIGKILL this process when its parent's thread exits; True if armed (exits now if it is gone already)."""
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
