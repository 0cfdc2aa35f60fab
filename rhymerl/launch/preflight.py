"""Checks of what a config names, before anything is queued or started (ConfigError naming the key)."""

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
    """A loadable HF model whose shape allows the parallel layout and the prompt and response lengths."""
    from rhymerl.models.registry import ModelError, builtin_shape, model_shape, validate_model_folder

    path = cfg.model.path
    try:
        if path.startswith("builtin:"):
            shape = builtin_shape(cfg.model)
        else:
            folder = Path(path).expanduser()
            validate_model_folder(folder)
            shape = model_shape(folder)
        validate(cfg, shape, world_size=world_size)
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
