"""The one place that knows devices: a rank's GPU, and where each group's collectives take their tensors."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

# The device type each torch.distributed backend's collectives take.
BACKEND_DEVICE_TYPES = {"nccl": "cuda", "gloo": "cpu", "mpi": "cpu", "ucc": "cpu"}

_declared: dict[str, torch.device] = {}


def declare_backend_device(backend: str, device: Optional[Any]) -> None:
    """Make ``backend``'s collectives take tensors on ``device`` (None: back to the default)."""
    if device is None:
        _declared.pop(backend, None)
    else:
        _declared[backend] = torch.device(device)


class DeviceBindingError(RuntimeError):
    """A rank cannot be bound to its own GPU, or is no longer on it; the message says why."""


# The GPU this rank computes on, set once by bind_rank_device before anything touches CUDA.
_rank_cuda: Optional[torch.device] = None


def visible_device_count(cuda_visible_devices: Optional[str], device_count: int) -> int:
    """GPUs this process sees: the entries of CUDA_VISIBLE_DEVICES when set, else the driver's count."""
    if cuda_visible_devices is None:
        return device_count
    return len([d for d in cuda_visible_devices.split(",") if d.strip()])


def rank_cuda_index(local_rank: int, visible: int, cuda_visible_devices: Optional[str] = None) -> int:
    """The rank's GPU index: ``local_rank`` when the task sees every GPU of its node, 0 when it sees one."""
    shown = f" (CUDA_VISIBLE_DEVICES={cuda_visible_devices})" if cuda_visible_devices is not None else ""
    if visible < 1:
        raise DeviceBindingError(f"rank with LOCAL_RANK={local_rank} sees no GPU{shown}: a CUDA run needs one "
                                 "GPU per rank (check the job's --gpus-per-node and the node's driver)")
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise DeviceBindingError(f"LOCAL_RANK={local_rank} but this task sees {visible} GPUs{shown}: give every "
                                 "task all the node's GPUs (srun --gpu-bind=none) or exactly one")
    return local_rank


def set_rank_device(device: Optional[torch.device]) -> None:
    """Record the GPU this rank computes on (None forgets it)."""
    global _rank_cuda
    _rank_cuda = None if device is None else torch.device(device)


def rank_device() -> Optional[torch.device]:
    """The GPU this rank bound itself to, or None before binding (and on CPU ranks)."""
    return _rank_cuda


def bind_rank_device(local_rank: int) -> torch.device:
    """Make the rank's GPU current before CUDA is touched; with one GPU visible LOCAL_RANK becomes 0 (vLLM reads it)."""
    visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = rank_cuda_index(local_rank, visible_device_count(visible_env, torch.cuda.device_count()), visible_env)
    if index != local_rank:
        os.environ["LOCAL_RANK"] = str(index)
    torch.cuda.set_device(index)
    device = torch.device("cuda", index)
    set_rank_device(device)
    return device


def check_rank_device(where: str) -> None:
    """Fail when a library changed the current CUDA device away from the rank's own."""
    if _rank_cuda is None:
        return
    current = torch.cuda.current_device()
    if current != _rank_cuda.index:
        raise DeviceBindingError(f"{where}: the current CUDA device is cuda:{current}, but this rank "
                                 f"(LOCAL_RANK={_rank_cuda.index}) computes on {_rank_cuda}")


def native_backend_device(backend: str) -> torch.device:
    """The device ``backend`` takes without any declaration (CUDA: the rank's own GPU)."""
    kind = BACKEND_DEVICE_TYPES.get(backend)
    if kind is None:
        raise ValueError(f"unknown torch.distributed backend {backend!r}; known: {', '.join(BACKEND_DEVICE_TYPES)}")
    if kind == "cuda":
        return _rank_cuda if _rank_cuda is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def backend_device(backend: str) -> torch.device:
    return _declared.get(backend) or native_backend_device(backend)


def compute_device(backend: str) -> torch.device:
    """Where a rank whose world runs ``backend`` keeps its model: the GPU with NCCL, else the CPU."""
    return native_backend_device(backend) if backend == "nccl" else torch.device("cpu")


def group_backend(group: Any = None) -> str:
    return str(dist.get_backend(group))


def collective_device(group: Any = None) -> torch.device:
    """The device ``group``'s collectives take (``None``: the default group; CPU without torch.distributed)."""
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
    """A function returning freed heap pages to the OS (glibc's ``malloc_trim``, else the phases pile up), or None."""
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
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def get_cpu_threads() -> int:
    """torch's intra-op threads on this host."""
    return torch.get_num_threads()


def set_cpu_threads(n: int) -> None:
    """Set torch's intra-op threads via torch._C: with a vLLM CPU engine built, the public setter is a no-op."""
    if n < 1:
        raise ValueError(f"CPU threads must be >= 1, got {n}")
    torch._C.set_num_threads(int(n))
