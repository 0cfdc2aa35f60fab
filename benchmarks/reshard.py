"""Megatron -> engine weight transfer: GB/s and peak extra memory per bucket size.

For each model (the tiny built-in Llama, and a synthetic Qwen2-0.5B-shaped model with random
weights created in memory) a Megatron GPTModel (TP=PP=1, this process) is streamed through
``export_hf_weights`` in buckets and loaded into an HF-layout target model by name, in place
(``param.copy_``, what an engine's ``load_weights`` does). The baseline, in the same process, is a
plain ``dst.load_state_dict(src.state_dict())`` between two Megatron models of the same layout:
a straight copy of the same bytes with no renaming, fusing or bucketing.

peak_extra_mb is the exporter's own accounting of bytes it allocated beyond the model's
parameters (gathered shards, fused-tensor splits, bucket contents), the quantity bounded by
one bucket; rss_extra_mb is the resident-set growth seen at bucket boundaries (allocator noise
included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

QWEN2_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "torch_dtype": "float32",
}


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _megatron(folder: Path, groups, load_weights: bool):
    from rhymerl.config import AlgorithmConfig, ParallelConfig
    from rhymerl.training.megatron_backend import MegatronBackend

    return MegatronBackend(ParallelConfig(), AlgorithmConfig(), folder, groups, train=False, load_weights=load_weights)


def _hf_target(config: dict):
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    cls = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        model = cls(cfg)
    return model.to_empty(device="cpu")


def _measure(backend, target, bucket_bytes: int) -> dict:
    import torch

    from rhymerl.resharding.stream import HFExportStats

    params = dict(target.named_parameters())
    stats = HFExportStats()
    rss0 = _rss()
    rss_peak = rss0
    t0 = time.perf_counter()
    with torch.no_grad():
        for bucket in backend.export_hf_weights(bucket_bytes, stats=stats):
            for name, t in bucket:
                params[name].copy_(t)
            rss_peak = max(rss_peak, _rss())
            del bucket
    dt = time.perf_counter() - t0
    return {"seconds": dt, "bytes": stats.bytes_out, "buckets": stats.buckets, "tensors": stats.tensors,
            "peak_extra_bytes": stats.peak_extra_bytes, "max_bucket_bytes": max(stats.bucket_sizes),
            "rss_extra_bytes": max(rss_peak - rss0, 0)}


def _baseline(src, dst, repeats: int) -> float:
    import torch

    sd = src.module.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in sd.values() if isinstance(t, torch.Tensor))
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.module.load_state_dict(src.module.state_dict(), strict=True)
            best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def run_model(name: str, folder: Path, config: dict, groups, bucket_mbs: list[float], random_fill: bool,
              repeats: int) -> list[dict]:
    import torch

    src = _megatron(folder, groups, load_weights=not random_fill)
    if random_fill:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in src.module.parameters():
                p.uniform_(-0.05, 0.05, generator=gen)
    dst = _megatron(folder, groups, load_weights=False)
    target = _hf_target(config)
    # Touch every page of the targets once so neither side pays first-touch faults.
    _measure(src, target, 256 << 20)
    base_gbps = _baseline(src, dst, repeats)
    rows = []
    for mb in bucket_mbs:
        best = None
        for _ in range(repeats):
            m = _measure(src, target, int(mb * (1 << 20)))
            if best is None or m["seconds"] < best["seconds"]:
                best = m
        gbps = best["bytes"] / best["seconds"] / 1e9
        rows.append({
            "model": name, "bucket_mb": mb, "gb_per_s": round(gbps, 3),
            "peak_extra_mb": round(best["peak_extra_bytes"] / 2**20, 3),
            "ratio_to_state_dict_copy": round(gbps / base_gbps, 3),
            "state_dict_copy_gb_per_s": round(base_gbps, 3), "seconds": round(best["seconds"], 4),
            "bytes": best["bytes"], "buckets": best["buckets"], "tensors": best["tensors"],
            "max_bucket_mb": round(best["max_bucket_bytes"] / 2**20, 3),
            "peak_extra_within_bucket": best["peak_extra_bytes"] <= max(mb * (1 << 20), best["max_bucket_bytes"]),
            "rss_extra_mb": round(best["rss_extra_bytes"] / 2**20, 1),
        })
    # The transfer must also be exact: every target tensor equals a fresh export, bit for bit.
    params = dict(target.named_parameters())
    exact = all(torch.equal(params[n], t) for b in src.export_hf_weights(256 << 20) for n, t in b)
    for r in rows:
        r["exact"] = exact
    del src, dst, target
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks reshard", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--buckets-mb", default="1,16,64,256", help="comma-separated bucket sizes in MiB")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-large", action="store_true", help="only the tiny model (quick check)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    buckets = [float(x) for x in args.buckets_mb.split(",")]

    import torch

    from rhymerl.config import ModelConfig, ParallelConfig
    from rhymerl.models import resolve_model
    from rhymerl.distributed.process_groups import destroy_process_groups, init_process_groups

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    groups = init_process_groups(ParallelConfig(), 1, 0)
    results = []
    t0 = time.perf_counter()
    tiny = resolve_model(ModelConfig(path="builtin:tiny"))
    tiny_cfg = json.loads((tiny / "config.json").read_text())
    results += run_model("tiny-llama", tiny, tiny_cfg, groups, [b for b in buckets if b <= 16] or buckets[:1],
                         False, args.repeats)
    if not args.skip_large:
        with tempfile.TemporaryDirectory(prefix="rhymerl-bench-") as d:
            (Path(d) / "config.json").write_text(json.dumps(QWEN2_05B))
            results += run_model("synthetic-qwen2-0.5b", Path(d), QWEN2_05B, groups, buckets, True, args.repeats)
    destroy_process_groups()
    wall = time.perf_counter() - t0

    hdr = f"{'model':<22} {'bucket MB':>9} {'GB/s':>7} {'x state_dict':>12} {'peak extra MB':>13} {'rss MB':>7} {'buckets':>7}"
    print(hdr, file=sys.stderr)
    for r in results:
        print(f"{r['model']:<22} {r['bucket_mb']:>9g} {r['gb_per_s']:>7.2f} {r['ratio_to_state_dict_copy']:>12.2f} "
              f"{r['peak_extra_mb']:>13.2f} {r['rss_extra_mb']:>7.1f} {r['buckets']:>7}", file=sys.stderr)
    print(f"(baseline: state_dict()+load_state_dict between two Megatron models; wall {wall:.1f} s)", file=sys.stderr)
    if args.json:
        print(json.dumps({"results": results, "wall_s": round(wall, 2), "threads": torch.get_num_threads()}))
    return 0
