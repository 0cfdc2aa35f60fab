"""The trainer's own watch on the Slurm time limit (Slurm's warning may come early or reach nobody)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Optional

log = logging.getLogger("rhymerl")

# squeue's %L: "[days-][hours:]minutes:seconds", or a word for jobs without a limit.
_TIME_LEFT = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)$")


def parse_time_left(text: str) -> Optional[float]:
    """Seconds from squeue's ``%L``; None for UNLIMITED / NOT_SET / INVALID or anything else."""
    m = _TIME_LEFT.match(text.strip())
    if not m:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def squeue_time_left(job_id: str, timeout_s: float = 20.0) -> Optional[float]:
    """The running job's time left from ``squeue -h -j JOB -o %L``; None if Slurm cannot say."""
    try:
        res = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%L"], capture_output=True, text=True,
                             timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("time-limit watch: squeue failed (%s); relying on Slurm's warning signal alone", e)
        return None
    if res.returncode != 0:
        log.warning("time-limit watch: squeue -j %s failed (rc=%d: %s); relying on Slurm's warning signal alone",
                    job_id, res.returncode, res.stderr.strip())
        return None
    return parse_time_left(res.stdout)


@dataclass
class TimeLimitWatch:
    """Decides at a step end whether to stop; ``query`` returns the seconds left (None: no limit)."""

    lead_s: float
    query: Callable[[], Optional[float]]
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._deadline: Optional[float] = None
        self._refresh()

    def _refresh(self) -> None:
        left = self.query()
        self._deadline = None if left is None else self.clock() + left

    @property
    def seconds_left(self) -> Optional[float]:
        return None if self._deadline is None else self._deadline - self.clock()

    def should_stop(self, next_step_s: float) -> Optional[str]:
        """The reason to stop now, or None: stop when ``next_step_s`` more would leave < lead."""
        left = self.seconds_left
        if left is None or left - next_step_s >= self.lead_s:
            return None
        self._refresh()  # the limit may have been raised since the start
        left = self.seconds_left
        if left is None or left - next_step_s >= self.lead_s:
            return None
        return (f"time limit: {left:.0f} s left, one more step (~{next_step_s:.0f} s) would leave less than "
                f"slurm.signal_lead_s={self.lead_s:g}")


def watch_from_env(lead_s: float) -> Optional[TimeLimitWatch]:
    """A watch on this Slurm job, or None outside Slurm or when its limit is unknown."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    watch = TimeLimitWatch(lead_s, lambda: squeue_time_left(job_id))
    if watch.seconds_left is None:
        return None
    log.info("time-limit watch: %.0f s left in Slurm job %s; checkpointing for a restart once a step would "
             "end with < %g s left", watch.seconds_left, job_id, lead_s)
    return watch
