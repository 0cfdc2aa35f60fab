"""Free space for a checkpoint: checked before a save, and named when a write runs out anyway."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Iterator, Optional

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# Below this much free space, a failed write is taken for a full disk even without an estimate.
NEARLY_FULL_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s (or its nearest existing ancestor's) filesystem."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def folder_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(nbytes) < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"


def _chain(exc: BaseException, depth: int = 0) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the per-rank failures torch's CheckpointException holds."""
    if depth > 20:
        return
    yield exc
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for value in failures.values():
            inner = value[0] if isinstance(value, tuple) and value else value
            if isinstance(inner, BaseException):
                yield from _chain(inner, depth + 1)
    for nxt in (exc.__cause__, exc.__context__):
        if nxt is not None and nxt is not exc:
            yield from _chain(nxt, depth + 1)


def says_full(exc: BaseException) -> bool:
    """ENOSPC/EDQUOT anywhere in ``exc``'s chain (or their text, where a C++ layer kept only that)."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return True
        text = str(e)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
    return False


def ran_out(exc: BaseException, written: int, free: int, need: Optional[int]) -> bool:
    """Whether a write that failed with ``exc`` ran out of space (``need``: estimated size or None)."""
    if says_full(exc):
        return True
    if need is not None and written + free < need:
        return True
    return free < NEARLY_FULL_BYTES


def full_message(where: Path, free: int, need: Optional[int]) -> str:
    needs = f", the checkpoint needs about {human(need)}" if need else ""
    return f"No space left on device in {where} ({human(free)} free{needs})"


def checkpoint_bytes_estimate(model_folder: Path, dtype: str) -> int:
    """A first checkpoint's size: weights, Adam's two fp32 moments and, below fp32, an fp32 master copy."""
    folder = Path(model_folder)
    weights = sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    try:
        hf = json.loads((folder / "config.json").read_text())
        stored = hf.get("dtype") or hf.get("torch_dtype") or dtype
    except (OSError, ValueError):
        stored = dtype
    params = weights // (4 if stored == "float32" else 2)
    elem = 4 if dtype == "float32" else 2
    return params * (elem + (8 if elem == 4 else 12))
