"""User errors (bad config, data, model folder, checkpoint, reward scorers) end a run with one
line naming the file, line or key, and an exit code per kind; the traceback goes to a log file.

Anything else is a bug and keeps its traceback on the console.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Optional

# (exception class, by "module.QualName" so that classifying imports nothing) -> (exit code, kind).
USER_ERRORS: dict[str, tuple[int, str]] = {
    "rhymerl.config.ConfigError": (2, "config"),
    "rhymerl.distributed.memory_plan.MemoryPlanError": (2, "memory plan"),
    "rhymerl.data.records.DatasetError": (3, "data"),
    "rhymerl.models.errors.ModelError": (4, "model"),
    "rhymerl.resharding.layout.LayoutError": (4, "model"),
    "rhymerl.outputs.checkpoint.CheckpointError": (5, "checkpoint"),
    "rhymerl.resharding.hf_export.ExportError": (5, "checkpoint"),
    "rhymerl.rewards.pool.RewardSetupError": (6, "reward"),
    "rhymerl.rewards.pool.RewardErrorRate": (6, "reward"),
}


def classify(exc: BaseException) -> Optional[tuple[int, str]]:
    """(exit code, kind) of a user error, or None for anything else."""
    for cls in type(exc).__mro__:
        found = USER_ERRORS.get(f"{cls.__module__}.{cls.__qualname__}")
        if found is not None:
            return found
    return None


def report(exc: BaseException, log_dir: Optional[Path], rank: int = 0) -> Optional[int]:
    """Print one line for a user error and write its traceback under ``log_dir``; returns the
    exit code, or None when ``exc`` is not a user error (the caller re-raises it)."""
    found = classify(exc)
    if found is None:
        return None
    code, kind = found
    where = ""
    if log_dir is not None:
        log = Path(log_dir) / (f"error-rank{rank}.log" if rank else "error.log")
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text("".join(traceback.format_exception(exc)))
            where = f" (traceback in {log})"
        except OSError:
            where = ""
    who = f"rank {rank}: " if rank else ""
    print(f"rhymerl: {who}{kind} error: {exc}{where}", file=sys.stderr, flush=True)
    return code
