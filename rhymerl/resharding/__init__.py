"""Megatron <-> HF weight layouts and the bucketed streaming exporter that feeds the rollout engine."""

from rhymerl.resharding.stream import HFExportStats, export_hf_buckets
from rhymerl.resharding.layout import LayoutError, ModelLayout, ParamSpec, hf_from_shards, param_specs, shard_from_hf

__all__ = ["HFExportStats", "LayoutError", "ModelLayout", "ParamSpec", "export_hf_buckets", "hf_from_shards",
           "param_specs", "shard_from_hf"]
