"""Checkpoint state as tagged JSON: round-trips exactly and, unlike pickle, runs no code when read."""

from __future__ import annotations

import base64
import json
import math
from typing import Any

_TAG = "__rhymerl__"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def encode(obj: Any, where: str = "state") -> Any:
    """``obj`` as JSON-ready data (see the module docstring); TypeError for anything else."""
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {_TAG: "float", "v": repr(obj)}
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {_TAG: "bytes", "v": _b64(bytes(obj))}
    if isinstance(obj, tuple):
        return {_TAG: "tuple", "v": [encode(x, f"{where}[{i}]") for i, x in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(x, f"{where}[{i}]") for i, x in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and _TAG not in obj:
            return {k: encode(v, f"{where}.{k}") for k, v in obj.items()}
        return {_TAG: "items", "v": [[encode(k, where), encode(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    mod = type(obj).__module__
    if mod == "numpy":
        import numpy as np

        if isinstance(obj, np.ndarray):
            if obj.dtype == object:
                raise TypeError(f"{where}: object arrays cannot be stored in a checkpoint")
            return {_TAG: "ndarray", "dtype": obj.dtype.str, "shape": list(obj.shape),
                    "v": _b64(np.ascontiguousarray(obj).tobytes())}
        if isinstance(obj, np.generic):
            return encode(obj.item(), where)
    if mod == "torch":
        import torch

        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            return {_TAG: "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                    "v": _b64(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")}
    raise TypeError(f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be stored in a checkpoint "
                    "(use plain numbers, strings, lists, dicts, bytes, numpy arrays or tensors)")


def decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [decode(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(_TAG)
    if tag is None:
        return {k: decode(v) for k, v in obj.items()}
    if tag == "float":
        return float(obj["v"])
    if tag == "bytes":
        return base64.b64decode(obj["v"])
    if tag == "tuple":
        return tuple(decode(x) for x in obj["v"])
    if tag == "items":
        return {_hashable(decode(k)): decode(v) for k, v in obj["v"]}
    if tag == "ndarray":
        import numpy as np

        return np.frombuffer(base64.b64decode(obj["v"]), dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    if tag == "tensor":
        import torch

        raw = bytearray(base64.b64decode(obj["v"]))
        dtype = getattr(torch, obj["dtype"])
        flat = torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
        return flat.reshape(obj["shape"]).clone()
    raise ValueError(f"unknown tag {tag!r} in checkpoint state")


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def dumps(obj: Any, where: str = "state") -> bytes:
    return json.dumps(encode(obj, where), separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    return decode(json.loads(data))
