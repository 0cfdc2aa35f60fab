"""Streaming export of full HF-named tensors from a TP/PP-sharded Megatron model, the same buckets on every
rank. Unconverted tensors are views of live parameters: consumers copy them before the next step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from rhymerl.resharding.layout import ModelLayout, ParamSpec, hf_from_shards, param_specs


@dataclass
class HFExportStats:
    """Byte accounting of what the exporter allocates beyond the model's own parameters."""

    buckets: int = 0
    tensors: int = 0
    bytes_out: int = 0
    peak_extra_bytes: int = 0
    bucket_sizes: list[int] = field(default_factory=list)

    def observe(self, live: int) -> None:
        self.peak_extra_bytes = max(self.peak_extra_bytes, live)


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def _owned(t: torch.Tensor, base: torch.Tensor) -> int:
    """Bytes ``t`` holds that are not the parameter's own storage."""
    return 0 if t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() else t.numel() * t.element_size()


def _gather_tp(local: torch.Tensor, groups) -> list[torch.Tensor]:
    if groups is None or groups.tp_size == 1:
        return [local]
    sent = local.to(groups.collective_device(groups.tp)).contiguous()
    parts = [torch.empty_like(sent) for _ in range(groups.tp_size)]
    dist.all_gather(parts, sent, group=groups.tp)
    return [p.to(local.device) for p in parts]


def export_hf_buckets(module: torch.nn.Module, layout: ModelLayout, groups, bucket_bytes: int,
                      dtype: Optional[torch.dtype] = None, stats: Optional[HFExportStats] = None,
                      ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield ``(hf_name, tensor)`` buckets of at most ``bucket_bytes``; every rank must iterate to the end."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    stats = stats if stats is not None else HFExportStats()
    tp = groups.tp_size if groups is not None else 1
    pp = groups.pp_size if groups is not None else 1
    pp_rank = groups.pp_rank if groups is not None else 0
    params = dict(module.named_parameters())
    if dtype is None:
        dtype = next(iter(params.values())).dtype
    bucket: list[tuple[str, torch.Tensor]] = []
    used = 0        # bytes in the bucket (views included: they are what the consumer receives)
    owned = 0       # bytes the bucket holds beyond the parameters' storage

    for spec in param_specs(layout, pp):
        size = sum(_nbytes(s, dtype) for s in spec.hf_shapes(layout))
        if bucket and used + size > bucket_bytes:
            stats.buckets += 1
            stats.bucket_sizes.append(used)
            yield bucket
            bucket, used, owned = [], 0, 0
        hf = _one_param(spec, params, layout, groups, tp, pp, pp_rank, dtype, stats, owned)
        for name, t in hf:
            bucket.append((name, t))
            used += t.numel() * t.element_size()
            base = params.get(spec.local_name(layout, pp)) if spec.stage == pp_rank else None
            owned += _owned(t, base) if base is not None else t.numel() * t.element_size()
        stats.tensors += len(hf)
        stats.bytes_out += sum(t.numel() * t.element_size() for _, t in hf)
        stats.observe(owned)
    if bucket:
        stats.buckets += 1
        stats.bucket_sizes.append(used)
        yield bucket


def _one_param(spec: ParamSpec, params: dict, layout: ModelLayout, groups, tp: int, pp: int, pp_rank: int,
               dtype: torch.dtype, stats: HFExportStats, owned_before: int) -> list[tuple[str, torch.Tensor]]:
    if spec.stage == pp_rank:
        local = params[spec.local_name(layout, pp)].detach()
        shards = _gather_tp(local, groups)
        gathered = 0 if tp == 1 else sum(s.numel() * s.element_size() for s in shards)
        hf = hf_from_shards(spec, layout, shards)
        made = sum(_owned(t, local) for _, t in hf)
        stats.observe(owned_before + gathered + made)  # Shards and their conversion are alive together for a moment.
        hf = [(n, t if t.dtype == dtype else t.to(dtype)) for n, t in hf]
    else:
        hf = [(n, torch.empty(s, dtype=dtype, device=groups.device))
              for n, s in zip(spec.hf_names, spec.hf_shapes(layout))]
    if pp > 1:
        src = groups.pp_global_rank(spec.stage)
        dev = groups.collective_device(groups.pp)
        moved = [(n, t.to(dev).contiguous()) for n, t in hf]
        for _, t in moved:
            dist.broadcast(t, src=src, group=groups.pp)
        hf = [(n, t.to(groups.device)) for n, t in moved]
    return hf
