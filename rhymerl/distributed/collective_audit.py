"""An audit of the devices of tensors handed to torch.distributed collectives (own calls: declared device)."""

from __future__ import annotations

import importlib
import inspect
import sys
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist

from rhymerl.distributed import devices

TENSOR_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter",
                      "reduce_scatter_tensor", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv")
OWN_PACKAGES = ("rhymerl",)

_lazy_ready = False


def lazy_device() -> torch.device:
    """PyTorch's ``lazy`` device (data on the CPU, but a device of its own), started once per process."""
    global _lazy_ready
    if not _lazy_ready:
        importlib.import_module("torch._lazy.ts_backend").init()
        _lazy_ready = True
    return torch.device("lazy")


class CollectiveDeviceError(RuntimeError):
    """A collective was handed a tensor on a device its group's backend does not take."""


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _caller() -> tuple[str, str]:
    """(module, "file:line function") of the frame that called the collective."""
    f = sys._getframe(2)
    return f.f_globals.get("__name__", "?"), f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}"


class CollectiveAudit:
    def __init__(self, own_packages: tuple[str, ...] = OWN_PACKAGES):
        self.own_packages = own_packages
        self.checked: Counter = Counter()      # (op, "own"|"library") -> calls
        self.bridged = 0
        self._originals: dict[str, Callable] = {}

    def _is_own(self, module: str) -> bool:
        return module == "__main__" or any(module == p or module.startswith(p + ".") for p in self.own_packages)

    def _wrap(self, name: str, real: Callable) -> Callable:
        sig = inspect.signature(real)

        def audited(*args: Any, **kwargs: Any) -> Any:
            module, where = _caller()
            bound = sig.bind(*args, **kwargs)
            group = bound.arguments.get("group")
            backend = devices.group_backend(group)
            native = devices.native_backend_device(backend)
            own = self._is_own(module)
            want = devices.backend_device(backend) if own else native
            for arg, value in bound.arguments.items():
                for t in _tensors(value):
                    if not _same_device(t.device, want):
                        raise CollectiveDeviceError(
                            f"torch.distributed.{name}({arg}=...) from {where} ({module}): tensor on {t.device}, "
                            f"but the group's {backend} backend takes {want}")
            self.checked[(name, "own" if own else "library")] += 1
            if _same_device(want, native):
                return real(*bound.args, **bound.kwargs)
            return self._bridged(real, bound, native)

        audited.__wrapped__ = real
        return audited

    def _bridged(self, real: Callable, bound: inspect.BoundArguments, native: torch.device) -> Any:
        if bound.arguments.get("async_op"):
            raise CollectiveDeviceError("the audit cannot bridge an async collective to the native device")
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        args = dict(bound.arguments)
        for arg, value in bound.arguments.items():
            if isinstance(value, torch.Tensor):
                moved = value.to(native)
                pairs.append((value, moved))
                args[arg] = moved
            elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
                moved_list = [v.to(native) if isinstance(v, torch.Tensor) else v for v in value]
                pairs.extend((v, m) for v, m in zip(value, moved_list) if isinstance(v, torch.Tensor))
                args[arg] = moved_list
        out = real(**args)
        for orig, moved in pairs:
            orig.copy_(moved)
        self.bridged += 1
        return out

    def install(self) -> "CollectiveAudit":
        for name in TENSOR_COLLECTIVES:
            real = getattr(dist, name)
            self._originals[name] = real
            setattr(dist, name, self._wrap(name, real))
        return self

    def uninstall(self) -> None:
        for name, real in self._originals.items():
            setattr(dist, name, real)
        self._originals.clear()

    def summary(self) -> dict:
        return {"checked": {f"{op}/{who}": n for (op, who), n in sorted(self.checked.items())}, "bridged": self.bridged}
