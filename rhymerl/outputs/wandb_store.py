"""Which steps a W&B run already holds, read from its transaction logs (LevelDB's log format, ``:W&B`` header)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Iterator, Optional

_BLOCK = 32768
_HEADER = struct.Struct("<4sHB")     # ident, magic, version
_CHUNK = struct.Struct("<IHB")       # crc32, length, type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class UnreadableLog(ValueError):
    """A transaction log in a format this reader does not know."""


def records(path: Path) -> Iterator[bytes]:
    """The complete records of a transaction log, in order (a torn last one is left out)."""
    data = Path(path).read_bytes()
    if len(data) < _HEADER.size:
        return
    ident, magic, version = _HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1 or version != 0:
        raise UnreadableLog(f"{path}: not a W&B transaction log of version 0 ({ident!r}, {magic:#x}, {version})")
    pos, parts = _HEADER.size, []
    while pos + _CHUNK.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK.size:
            pos += left  # a block's tail too short for a chunk header is padding
            continue
        crc, length, kind = _CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:
            pos += left
            continue
        body = data[pos + _CHUNK.size: pos + _CHUNK.size + length]
        if len(body) < length or zlib.crc32(body, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            return  # torn or not yet flushed: the rest is not there
        pos += _CHUNK.size + length
        if kind == _FULL:
            yield body
        elif kind == _FIRST:
            parts = [body]
        elif kind == _MIDDLE:
            parts.append(body)
        elif kind == _LAST:
            parts.append(body)
            yield b"".join(parts)
            parts = []


def history_steps(path: Path) -> set[int]:
    """The steps of the history records in one transaction log."""
    from wandb.proto import wandb_internal_pb2

    steps = set()
    for raw in records(path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            steps.add(int(rec.history.step.num))
    return steps


def run_logs(wandb_dir: Path, run_id: str) -> list[Path]:
    """Every process's transaction log of run ``run_id`` (offline and online folders)."""
    return sorted(Path(wandb_dir).glob(f"*run-*-{run_id}/run-{run_id}.wandb"))


def logged_steps(wandb_dir: Path, run_id: str) -> Optional[set[int]]:
    """The steps of run ``run_id`` that W&B's files hold; None when one cannot be read."""
    steps: set[int] = set()
    try:
        for log in run_logs(wandb_dir, run_id):
            steps |= history_steps(log)
    except (OSError, UnreadableLog, ImportError, ValueError):
        return None
    return steps
