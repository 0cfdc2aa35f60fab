"""Training backends (Megatron-core TP/PP/DP, DeepSpeed ZeRO) behind one interface (``base.py``)."""

from __future__ import annotations

from pathlib import Path

from rhymerl.config import AlgorithmConfig, ParallelConfig
from rhymerl.training.base import PolicyBatch, StepMetrics, TrainingBackend
from rhymerl.distributed.process_groups import ProcessGroups, destroy_process_groups, init_process_groups


def build_backend(parallel_cfg: ParallelConfig, algo_cfg: AlgorithmConfig, model_path: Path, groups: ProcessGroups,
                  dtype: str = "float32", seed: int = 0, **kwargs) -> TrainingBackend:
    """The backend ``parallel_cfg.backend`` names (``kwargs``: temperature, loss_fn, train=False)."""
    if parallel_cfg.backend == "megatron":
        from rhymerl.training.megatron_backend import MegatronBackend

        return MegatronBackend(parallel_cfg, algo_cfg, Path(model_path), groups, dtype=dtype, seed=seed, **kwargs)
    if parallel_cfg.backend == "deepspeed":
        from rhymerl.training.deepspeed_backend import DeepSpeedBackend

        return DeepSpeedBackend(parallel_cfg, algo_cfg, Path(model_path), groups, dtype=dtype, seed=seed, **kwargs)
    raise ValueError(f"parallel.backend: {parallel_cfg.backend!r} not allowed; allowed: 'megatron', 'deepspeed'")


__all__ = ["PolicyBatch", "ProcessGroups", "StepMetrics", "TrainingBackend", "build_backend",
           "destroy_process_groups", "init_process_groups"]
