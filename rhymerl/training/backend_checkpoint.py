"""The folder protocol both backends' checkpoints share (collective, atomic, with the HF side files)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

from rhymerl.launch.child_signals import shielded_start, start_shielded_manager
from rhymerl.outputs.atomic import atomic_write_text, fsync_tree

BACKEND_META = "rhymerl_backend.json"
# Weight files of a model folder; every other file travels with a checkpoint.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth", ".gguf",
                    ".h5", ".msgpack", ".ckpt")


def hf_side_files(model_path: Path) -> list[Path]:
    return sorted(p for p in Path(model_path).iterdir()
                  if p.is_file() and not p.name.startswith(".") and not p.name.endswith(_WEIGHT_SUFFIXES))


def save_backend_checkpoint(folder: Path, model_path: Path, meta: dict, write_state: Callable[[Path], None]) -> None:
    """Collective: ``write_state(tmp)`` runs on every rank, then rank 0 finalises ``folder``."""
    folder = Path(folder)
    tmp = folder.parent / f".{folder.name}.tmp"
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    # The backend's writer forks worker processes: they must not take the job's signals.
    with shielded_start():
        write_state(tmp)
    dist.barrier()
    if rank0:
        hf = tmp / "hf_config"
        hf.mkdir()
        for f in hf_side_files(model_path):
            shutil.copy2(f, hf / f.name)
        atomic_write_text(tmp / BACKEND_META, json.dumps(meta, indent=2))
        fsync_tree(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    dist.barrier()


_writer_manager: Optional[Any] = None


def shield_megatron_writer() -> None:
    """Serve megatron-core's writer queue from a shielded process (its own dies with the job's signals)."""
    global _writer_manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _writer_manager is None:
        _writer_manager = start_shielded_manager()
        filesystem_async._results_queue = _writer_manager.Queue()
    elif filesystem_async._results_queue is None:
        filesystem_async._results_queue = _writer_manager.Queue()


def read_backend_meta(folder: Path, kind: str) -> dict:
    """The checkpoint's metadata; refuses a folder that is not a ``kind`` backend checkpoint."""
    meta_file = Path(folder) / BACKEND_META
    if not meta_file.is_file():
        raise FileNotFoundError(f"checkpoint {folder} has no {BACKEND_META}: not a RhymeRL backend checkpoint")
    meta = json.loads(meta_file.read_text())
    if meta.get("kind") != kind:
        raise ValueError(f"checkpoint {folder} was written by the {meta.get('kind')} backend, not {kind}")
    return meta
