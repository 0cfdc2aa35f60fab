"""Preemption and cancel: turn the job's signals into flags the trainer polls at safe points.

- SIGUSR1 is a preemption notice (``#SBATCH --signal=USR1@N`` before the time limit,
  ``scancel --signal=USR1``, or forwarded by the batch shell): checkpoint at the next step
  end, then rank 0 calls ``requeue_current_job()`` and the requeued job resumes.
- SIGTERM is a stop (``scancel JOB``, the time limit itself, a preemption with Slurm's own
  ``PreemptMode=REQUEUE``, which requeues by itself): checkpoint at the next step end if
  the job lives that long, and exit without requeueing. After a USR1 it stays a preemption.

A signal handler must not checkpoint by itself: it can fire in the middle of a collective
or an optimizer step. So the handler only records the request; the trainer checks
``requested`` at the end of a step and agrees across ranks. Slurm delivers these signals to
every process of the job; the trainer's helper processes are shielded from them
(rhymerl.launch.child_signals). See slurm/README.md.

A USR1 sent to the batch shell (``--signal=B:USR1@lead``, ``scancel --batch``) is not
forwarded as a signal: it can arrive before the tasks have installed their handlers, and
kill them. The shell's trap creates the notice file named by ``RHYMERL_PREEMPT_NOTICE``
instead, which the handler treats as a USR1 when the trainer polls it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Iterable, Optional

NOTICE_ENV = "RHYMERL_PREEMPT_NOTICE"


PREEMPT_SIGNALS = frozenset({signal.SIGUSR1})


class PreemptionHandler:
    """Installs handlers for ``signals`` that set a flag; ``restore()`` puts the old ones back.

    Use as a context manager or keep it for the life of the process. Handlers can only be
    installed from the main thread (a Python rule); elsewhere this raises ValueError.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGUSR1, signal.SIGTERM), *, verbose: bool = True,
                 notice_file: Optional[str] = None):
        self._signals = tuple(signals)
        self._verbose = verbose
        notice_file = notice_file if notice_file is not None else os.environ.get(NOTICE_ENV, "")
        self._notice_file = Path(notice_file) if notice_file else None
        self._notice_seen = False
        self._requested_by: Optional[int] = None
        self._requested_at: Optional[float] = None
        self._previous: dict[int, object] = {}
        self._received: set[int] = set()
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        first = signum not in self._received
        self._received.add(signum)
        if self._requested_by is None:
            self._requested_by = signum
            self._requested_at = time.monotonic()
        if self._verbose and first:
            then = "requeue" if self._received & PREEMPT_SIGNALS else "stop without requeueing"
            # os.write: print() is not safe inside a signal handler (re-entrant buffered IO).
            os.write(sys.stderr.fileno(), f"[rhymerl] received {signal.Signals(signum).name}: "
                                          f"will checkpoint and {then} at the next safe point\n".encode())

    def _poll_notice(self) -> None:
        if self._notice_file is None or self._notice_seen or not self._notice_file.exists():
            return
        self._notice_seen = True
        already = signal.SIGUSR1 in self._received
        self._received.add(signal.SIGUSR1)
        if self._requested_by is None:
            self._requested_by = signal.SIGUSR1
            self._requested_at = time.monotonic()
        if self._verbose and not already:
            print(f"[rhymerl] received SIGUSR1 through the batch shell ({self._notice_file}): "
                  "will checkpoint and requeue at this safe point", file=sys.stderr, flush=True)

    @property
    def requested(self) -> bool:
        self._poll_notice()
        return self._requested_by is not None

    @property
    def requeue_requested(self) -> bool:
        """A preemption notice arrived (not only a stop): the job should be requeued."""
        self._poll_notice()
        return bool(self._received & PREEMPT_SIGNALS)

    @property
    def signal_name(self) -> Optional[str]:
        return signal.Signals(self._requested_by).name if self._requested_by is not None else None

    @property
    def seconds_since_request(self) -> Optional[float]:
        return None if self._requested_at is None else time.monotonic() - self._requested_at

    def clear(self) -> None:
        self._received.clear()
        self._requested_by = None
        self._requested_at = None

    def restore(self) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._previous.clear()

    def __enter__(self) -> "PreemptionHandler":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def requeue_current_job(timeout_s: float = 30.0) -> bool:
    """``scontrol requeue $SLURM_JOB_ID``; returns True when a requeue was issued.

    Call from rank 0 only, after the checkpoint is complete on every rank: the requeue
    terminates every task of the job. Returns False outside Slurm or when scontrol fails
    (the message goes to stderr), so the caller can simply exit 0 and let the user resubmit.
    """
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return False
    from rhymerl.launch.child_signals import shielded_start

    # In an array job SLURM_JOB_ID is this element's own id, which is what scontrol wants.
    # The requeue TERMs every process of the job step at once, scontrol included when it runs
    # inside the step: it starts with the job's signals blocked, so it lives to report success.
    try:
        with shielded_start():
            res = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True,
                                 timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"[rhymerl] scontrol requeue {job_id} failed: {e}", file=sys.stderr, flush=True)
        return False
    if res.returncode != 0:
        print(f"[rhymerl] scontrol requeue {job_id} failed (rc={res.returncode}): {res.stderr.strip()}",
              file=sys.stderr, flush=True)
        return False
    print(f"[rhymerl] requeued Slurm job {job_id}", file=sys.stderr, flush=True)
    return True
