"""Checks of what a config names, run before anything is queued or started.

`--print-config` and `slurm render|submit` call ``preflight``: a job that would fail at
start-up (an unknown reasoning-gym task, a missing model folder or data file, a TP size
the model's heads do not allow, a response longer than the engine's context) is refused
on the login node, not after it has waited in the queue. Each failure is a ConfigError
naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rhymerl.config import ConfigError, RunConfig, validate


def check_lengths(cfg: RunConfig) -> None:
    r = cfg.rollout
    if r.max_tokens >= r.max_model_len:
        raise ConfigError(f"rollout.max_tokens: {r.max_tokens} leaves no room for the prompt in "
                          f"rollout.max_model_len={r.max_model_len}; responses would be cut silently")


def check_model(cfg: RunConfig, world_size: Optional[int]) -> None:
    """A folder must be a loadable HF model whose shape allows the parallel layout."""
    from rhymerl.models.registry import BUILTIN_SMOLLM2, BUILTIN_TINY, ModelError, model_shape, validate_model_folder

    path = cfg.model.path
    if path in (BUILTIN_SMOLLM2, BUILTIN_TINY):
        return  # built on first use, by the job itself
    if path.startswith("builtin:"):
        raise ConfigError(f"model.path: unknown built-in {path!r}; allowed: {BUILTIN_SMOLLM2!r}, {BUILTIN_TINY!r}, "
                          "or an HF folder")
    try:
        folder = Path(path).expanduser()
        validate_model_folder(folder)
        validate(cfg, model_shape(folder), world_size=world_size)
    except ModelError as e:
        raise ConfigError(str(e)) from None


def check_data(cfg: RunConfig) -> None:
    """Builds the prompt records as the job will: every row, task name and task argument."""
    from rhymerl.data.records import DatasetError, load_records

    try:
        load_records(cfg.data)
    except DatasetError as e:
        raise ConfigError(str(e) if str(e).startswith("data") else f"data.path: {e}") from None


def preflight(cfg: RunConfig, world_size: Optional[int] = None) -> None:
    """Everything about ``cfg`` that can be checked before the run starts; raises ConfigError."""
    check_lengths(cfg)
    check_model(cfg, world_size)
    check_data(cfg)
