"""`python -m rhymerl export CKPT --hf OUT`: a training-backend checkpoint -> an HF folder.
CKPT: a run, checkpoint, step or backend folder; above a step folder, the newest *verified* step."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from rhymerl.config import AlgorithmConfig, CheckpointConfig, ParallelConfig
from rhymerl.distributed.process_groups import destroy_process_groups, init_process_groups
from rhymerl.outputs.atomic import atomic_folder
from rhymerl.outputs.checkpoint import _STEP_RE, MANIFEST, CheckpointManager, verify_checkpoint
from rhymerl.training.backend_checkpoint import BACKEND_META as META
from rhymerl.training.megatron_backend import DTYPES, MegatronBackend


class ExportError(ValueError):
    pass


def _verified_step_backend(step_dir: Path) -> Path:
    reason = verify_checkpoint(step_dir)
    if reason is not None:
        raise ExportError(f"checkpoint {step_dir} is incomplete or damaged: {reason}")
    if not (step_dir / "backend" / META).is_file():
        raise ExportError(f"checkpoint {step_dir}: no backend/{META} (not a RhymeRL training checkpoint)")
    return step_dir / "backend"


def find_backend_checkpoint(root: Path) -> Path:
    """The backend checkpoint folder that ``root`` designates (see the module docstring)."""
    root = Path(root)
    if not root.exists():
        raise ExportError(f"checkpoint {root} does not exist")
    if (root / META).is_file():
        return root
    if (root / MANIFEST).exists() or _STEP_RE.match(root.name):
        return _verified_step_backend(root)
    # A run folder keeps its checkpoints in checkpoints/ unless checkpoint.dir moved them.
    for folder in (root, root / "checkpoints"):
        mgr = CheckpointManager(CheckpointConfig(dir=str(folder)), root)
        if mgr.step_folders():
            found = mgr.newest_valid()
            if found is None:
                raise ExportError(f"checkpoint {folder}: no complete checkpoint among "
                                  f"{', '.join(p.name for _, p in mgr.step_folders())}")
            return _verified_step_backend(found)
    raise ExportError(f"checkpoint {root}: no step-* checkpoint or {META} in it (not a RhymeRL run or checkpoint)")


def _step_of_backend(ckpt: Path) -> str:
    return ckpt.parent.name if ckpt.name == "backend" and _STEP_RE.match(ckpt.parent.name) else ckpt.name


def _share_like_umask(folder: Path) -> None:
    """Give the export the modes a plain mkdir/open would (temp folders are created 0700)."""
    mask = os.umask(0)
    os.umask(mask)
    folder.chmod(0o777 & ~mask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~mask)


def _export_megatron(ckpt: Path, meta: dict) -> dict:
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
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="state")
    dtype = DTYPES[meta.get("dtype", "float32")]
    config = json.loads((ckpt / "hf_config" / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    return {k: v.to(dtype).contiguous() for k, v in sd.items() if isinstance(v, torch.Tensor)}


def export_checkpoint(checkpoint: Path, out: Path) -> Path:
    from safetensors.torch import save_file

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
        _share_like_umask(tmp)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rhymerl export", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--hf", required=True)
    args = ap.parse_args(argv)
    try:
        ckpt = find_backend_checkpoint(Path(args.checkpoint))
        out = export_checkpoint(ckpt, Path(args.hf))
    except (ExportError, FileNotFoundError) as e:
        print(f"rhymerl export: {e}", file=sys.stderr)
        return 5  # the checkpoint kind of user error (rhymerl.launch.user_errors)
    print(f"rhymerl export: wrote {out} from {_step_of_backend(ckpt)} ({ckpt})", file=sys.stderr)
    return 0
