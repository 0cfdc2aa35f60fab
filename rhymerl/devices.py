"""The one place that knows devices: where a rank computes, and where each process group's
collectives take their tensors.

NCCL takes CUDA tensors only and gloo CPU tensors (PyTorch refuses anything else with "No
backend type associated with device type ..."), so every tensor handed to a collective goes
through ``collective_device(group)`` first; on a GPU rank with NCCL and on a CPU rank with gloo
the move is a no-op. ``declare_backend_device`` overrides what a backend takes (gloo also takes
CUDA tensors for some collectives; tests declare another device to prove that every collective
asks this module instead of assuming).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

# The device type each torch.distributed backend's collectives take.
BACKEND_DEVICE_TYPES = {"nccl": "cuda", "gloo": "cpu", "mpi": "cpu", "ucc": "cpu"}

_declared: dict[str, torch.device] = {}


def declare_backend_device(backend: str, device: Optional[Any]) -> None:
    """Make ``backend``'s collectives take tensors on ``device`` (None: back to the default)."""
    if device is None:
        _declared.pop(backend, None)
    else:
        _declared[backend] = torch.device(device)


def native_backend_device(backend: str) -> torch.device:
    """The device ``backend`` takes without any declaration (CUDA: this rank's current device)."""
    kind = BACKEND_DEVICE_TYPES.get(backend)
    if kind is None:
        raise ValueError(f"unknown torch.distributed backend {backend!r}; known: {', '.join(BACKEND_DEVICE_TYPES)}")
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def backend_device(backend: str) -> torch.device:
    return _declared.get(backend) or native_backend_device(backend)


def compute_device(backend: str) -> torch.device:
    """Where a rank whose world runs ``backend`` keeps its model: the GPU with NCCL, else the CPU."""
    return native_backend_device(backend) if backend == "nccl" else torch.device("cpu")


def group_backend(group: Any = None) -> str:
    import torch.distributed as dist

    return str(dist.get_backend(group))


def collective_device(group: Any = None) -> torch.device:
    """The device ``group``'s collectives take (``None``: the default group; CPU without torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    return backend_device(group_backend(group))


def to_collective(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``t`` on ``group``'s collective device, contiguous (collectives need both)."""
    return t.to(collective_device(group)).contiguous()


def free_memory_probe(device: torch.device):
    """A function returning the device's free bytes (CUDA), or None where there is no such figure."""
    if device.type != "cuda":
        return None
    return lambda: int(torch.cuda.mem_get_info(device)[0])


def host_heap_trimmer():
    """A function returning freed host-heap pages to the OS (glibc's ``malloc_trim``), or None
    where the C library has no such call.

    Tensors of a few MB (weights, Adam's moments, activations of a layer) live in glibc's heap,
    which keeps freed blocks resident for reuse. A colocated step changes what is resident at
    each phase (the engine's packed weights and KV cache, then activations, then the engine's
    again), so without a trim the resident set is the sum of every phase's fragments, growing
    from step to step, instead of the largest phase."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # no C library to load, or not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int

    def trim_heap() -> int:
        """Bytes of resident memory the trim released (0 where /proc is not there to say)."""
        before = resident_bytes()
        trim(0)
        return max(before - resident_bytes(), 0)
    return trim_heap


def resident_bytes() -> int:
    """This process's resident set in bytes (Linux), 0 elsewhere."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def get_cpu_threads() -> int:
    """torch's intra-op threads on this host."""
    return torch.get_num_threads()


def set_cpu_threads(n: int) -> None:
    """Set torch's intra-op threads on this host. Through torch._C's setter: once a vLLM CPU
    engine is built, ``torch.set_num_threads`` is vLLM's no-op (its worker binds the threads of
    its own processes; ours runs in this one), and a later call would be dropped with a
    warning."""
    if n < 1:
        raise ValueError(f"CPU threads must be >= 1, got {n}")
    torch._C.set_num_threads(int(n))
