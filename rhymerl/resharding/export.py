"""`python -m rhymerl export CKPT --hf OUT`: a training-backend checkpoint -> an HF folder.

CKPT is a backend checkpoint folder (it holds ``rhymerl_backend.json``), or any folder above
one (a RhymeRL checkpoint or run folder): then the newest backend checkpoint below it is used.
Megatron checkpoints are loaded in this single process at TP=PP=1 (dist_checkpointing
reshards on load) and streamed out through the same exporter that feeds the rollout engine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from rhymerl.training.backend_checkpoint import BACKEND_META as META


class ExportError(ValueError):
    pass


def find_backend_checkpoint(root: Path) -> Path:
    root = Path(root)
    if not root.exists():
        raise ExportError(f"checkpoint {root} does not exist")
    if (root / META).is_file():
        return root
    found = [p.parent for p in root.rglob(META) if not any(part.startswith(".") for part in p.relative_to(root).parts)]
    if not found:
        raise ExportError(f"checkpoint {root}: no {META} below it (not a RhymeRL training checkpoint)")
    return max(found, key=lambda p: (p.stat().st_mtime, str(p)))


def _export_megatron(ckpt: Path, meta: dict) -> dict:
    from rhymerl.config import AlgorithmConfig, ParallelConfig
    from rhymerl.training.megatron_backend import MegatronBackend
    from rhymerl.training.process_groups import destroy_process_groups, init_process_groups

    pc = ParallelConfig()
    groups = init_process_groups(pc, 1, 0)
    backend = MegatronBackend(pc, AlgorithmConfig(), ckpt / "hf_config", groups, dtype=meta.get("dtype", "float32"),
                              train=False, load_weights=False)
    backend.load_checkpoint(ckpt, load_optimizer=False)
    out = {}
    for bucket in backend.export_hf_weights(256 << 20):
        for name, t in bucket:
            # Buckets may alias the live parameters; the file needs its own copy.
            out[name] = t.detach().to("cpu", copy=True).contiguous()
    del backend
    destroy_process_groups()
    return out


def _export_deepspeed(ckpt: Path, meta: dict) -> dict:
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from rhymerl.training.megatron_backend import DTYPES

    sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="state")
    dtype = DTYPES[meta.get("dtype", "float32")]
    config = json.loads((ckpt / "hf_config" / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    return {k: v.to(dtype).contiguous() for k, v in sd.items() if isinstance(v, torch.Tensor)}


def export_checkpoint(checkpoint: Path, out: Path) -> Path:
    from safetensors.torch import save_file

    from rhymerl.atomic import atomic_folder

    ckpt = find_backend_checkpoint(checkpoint)
    meta = json.loads((ckpt / META).read_text())
    kind = meta.get("kind")
    if kind == "megatron":
        weights = _export_megatron(ckpt, meta)
    elif kind == "deepspeed":
        weights = _export_deepspeed(ckpt, meta)
    else:
        raise ExportError(f"{ckpt / META}: unknown backend kind {kind!r}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"--hf {out} exists and is not empty")
    if out.exists():
        out.rmdir()
    with atomic_folder(out) as tmp:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for f in (ckpt / "hf_config").iterdir():
            shutil.copy2(f, tmp / f.name)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rhymerl export", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--hf", required=True)
    args = ap.parse_args(argv)
    try:
        out = export_checkpoint(Path(args.checkpoint), Path(args.hf))
    except (ExportError, FileNotFoundError) as e:
        print(f"rhymerl export: {e}", file=sys.stderr)
        return 2
    print(f"rhymerl export: wrote {out}", file=sys.stderr)
    return 0
