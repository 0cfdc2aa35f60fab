"""User errors end a run with one line and an exit code per kind, the traceback appended to a log file."""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

# (exception class, by "module.QualName" so that classifying imports nothing) -> (exit code, kind).
USER_ERRORS: dict[str, tuple[int, str]] = {
    "rhymerl.config.ConfigError": (2, "config"), "rhymerl.distributed.memory_plan.MemoryPlanError": (2, "memory plan"),
    "rhymerl.data.records.DatasetError": (3, "data"),
    "rhymerl.models.errors.ModelError": (4, "model"), "rhymerl.resharding.layout.LayoutError": (4, "model"),
    "rhymerl.outputs.checkpoint.CheckpointError": (5, "checkpoint"),
    "rhymerl.resharding.hf_export.ExportError": (5, "checkpoint"),
    "rhymerl.rewards.pool.RewardSetupError": (6, "reward"), "rhymerl.rewards.pool.RewardErrorRate": (6, "reward"),
    "rhymerl.outputs.run_lock.RunFolderBusy": (7, "run folder"),
    "rhymerl.distributed.peer_watch.PeerLost": (8, "lost rank"),
}


def classify(exc: BaseException) -> Optional[tuple[int, str]]:
    """(exit code, kind) of a user error, or None for anything else."""
    for cls in type(exc).__mro__:
        found = USER_ERRORS.get(f"{cls.__module__}.{cls.__qualname__}")
        if found is not None:
            return found
    return None


def report(exc: BaseException, log_dir: Optional[Path], rank: int = 0) -> Optional[int]:
    """Print one line for a user error, log its traceback; the exit code, or None when not a user error."""
    found = classify(exc)
    if found is None:
        return None
    code, kind = found
    where = ""
    if log_dir is not None:
        log = Path(log_dir) / (f"error-rank{rank}.log" if rank else "error.log")
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("a") as f:
                f.write(attempt_header(rank) + "".join(traceback.format_exception(exc)))
            where = f" (traceback in {log})"
        except OSError:
            where = ""
    who = f"rank {rank}: " if rank else ""
    print(f"rhymerl: {who}{kind} error: {exc}{where}", file=sys.stderr, flush=True)
    return code


def attempt_header(rank: int, env: Optional[dict] = None) -> str:
    """The line that opens one attempt's entry in an error log."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    segment = f", Slurm job {job} restart {env.get('SLURM_RESTART_COUNT', '0')}" if job else ""
    when = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return f"==== {when} rank {rank} on {socket.gethostname()}, pid {os.getpid()}{segment} ====\n"
