"""Prompt keys: XXH64 (seed 0) of the token ids as little-endian int32, as the released HistoSpec."""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np

_M = (1 << 64) - 1
_P1 = 11400714785074694791
_P2 = 14029467366897019727
_P3 = 1609587929392839161
_P4 = 9650029242287828579
_P5 = 2870177450012600261


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M


def _round(acc: int, lane: int) -> int:
    acc = (acc + lane * _P2) & _M
    return (_rotl(acc, 31) * _P1) & _M


def _merge(acc: int, val: int) -> int:
    acc ^= _round(0, val)
    return (acc * _P1 + _P4) & _M


def xxh64_py(data: bytes, seed: int = 0) -> int:
    """Reference XXH64 (https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md)."""
    n = len(data)
    i = 0
    if n >= 32:
        v1 = (seed + _P1 + _P2) & _M
        v2 = (seed + _P2) & _M
        v3 = seed & _M
        v4 = (seed - _P1) & _M
        lanes = struct.unpack_from(f"<{(n // 32) * 4}Q", data)
        for j in range(0, len(lanes), 4):
            v1 = _round(v1, lanes[j])
            v2 = _round(v2, lanes[j + 1])
            v3 = _round(v3, lanes[j + 2])
            v4 = _round(v4, lanes[j + 3])
        i = (n // 32) * 32
        h = (_rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)) & _M
        for v in (v1, v2, v3, v4):
            h = _merge(h, v)
    else:
        h = (seed + _P5) & _M
    h = (h + n) & _M
    while i + 8 <= n:
        (k,) = struct.unpack_from("<Q", data, i)
        h ^= _round(0, k)
        h = (_rotl(h, 27) * _P1 + _P4) & _M
        i += 8
    if i + 4 <= n:
        (k,) = struct.unpack_from("<I", data, i)
        h ^= (k * _P1) & _M
        h = (_rotl(h, 23) * _P2 + _P3) & _M
        i += 4
    while i < n:
        h ^= (data[i] * _P5) & _M
        h = (_rotl(h, 11) * _P1) & _M
        i += 1
    h ^= h >> 33
    h = (h * _P2) & _M
    h ^= h >> 29
    h = (h * _P3) & _M
    h ^= h >> 32
    return h


try:
    import xxhash as _xxhash

    def _xxh64(data: bytes) -> int:
        return _xxhash.xxh64_intdigest(data, seed=0)

    HASH_BACKEND = "xxhash"
except ImportError:  # pragma: no cover - depends on the environment
    _xxh64 = xxh64_py
    HASH_BACKEND = "python"


def token_bytes(token_ids: Sequence[int]) -> bytes:
    return np.asarray(token_ids, dtype="<i4").tobytes()


def prompt_key(prompt_token_ids: Sequence[int]) -> int:
    """XXH64(seed 0) of the prompt's token ids as little-endian int32; equal in every process."""
    return _xxh64(token_bytes(prompt_token_ids))
