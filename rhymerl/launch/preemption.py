"""Preemption and cancel: the job's signals become flags the trainer polls at safe points."""

from __future__ import annotations

import os
import re
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
    """Installs flag-setting handlers for ``signals`` (main thread only); ``restore()`` puts the old back."""

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
            # os.write: print() is unsafe here. No promise: Slurm also TERMs ranks when one died.
            os.write(sys.stderr.fileno(), f"[rhymerl] received {signal.Signals(signum).name}: "
                                          f"will checkpoint and {then} at the next safe point, if every rank "
                                          "gets there\n".encode())

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
    """``scontrol requeue $SLURM_JOB_ID`` (rank 0, once the checkpoint is complete); False if not issued."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return False
    from rhymerl.launch.child_signals import shielded_start

    # The requeue TERMs the whole job step, scontrol included: it starts with the signals blocked.
    try:
        with shielded_start():
            res = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"[rhymerl] scontrol requeue {job_id} failed: {e}", file=sys.stderr, flush=True)
        return False
    if res.returncode != 0:
        print(f"[rhymerl] scontrol requeue {job_id} failed (rc={res.returncode}): {res.stderr.strip()}",
              file=sys.stderr, flush=True)
        return False
    print(f"[rhymerl] requeued Slurm job {job_id}", file=sys.stderr, flush=True)
    return True


def restarts_of(show_job: str) -> Optional[int]:
    """The ``Restarts=N`` of ``scontrol show job -o`` output; None if absent."""
    m = re.search(r"\bRestarts=(\d+)", show_job)
    return int(m.group(1)) if m else None


def requeued_by_slurm(timeout_s: float = 10.0) -> Optional[bool]:
    """After a SIGTERM: whether Slurm is requeueing this job itself; None when it cannot say."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    from rhymerl.launch.child_signals import shielded_start

    try:
        with shielded_start():
            res = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                                 timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    restarts = restarts_of(res.stdout) if res.returncode == 0 else None
    if restarts is None:
        return None
    return restarts > int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
