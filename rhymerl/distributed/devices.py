"""The one place that knows devices: where a rank computes, where each process group's
collectives take their tensors, and which lower precision a device computes in natively
(``parallel.autocast``).

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
    """The index of the GPU a rank computes on: ``local_rank`` when the task sees every GPU of
    its node, 0 when it was given exactly one (per-task binding)."""
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
    """Make ``cuda:i`` (``rank_cuda_index``) this process's current device before anything else
    touches CUDA, and remember it. With one GPU visible, LOCAL_RANK becomes 0 as well: vLLM's
    external launcher takes its device index from it."""
    import os

    visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = rank_cuda_index(local_rank, visible_device_count(visible_env, torch.cuda.device_count()), visible_env)
    if index != local_rank:
        os.environ["LOCAL_RANK"] = str(index)
    torch.cuda.set_device(index)
    device = torch.device("cuda", index)
    set_rank_device(device)
    return device


def check_rank_device(where: str) -> None:
    """Fail with one line when the current CUDA device is no longer the rank's own (a library
    that set another one would put this rank's later allocations on a GPU it shares)."""
    if _rank_cuda is None:
        return
    current = torch.cuda.current_device()
    if current != _rank_cuda.index:
        raise DeviceBindingError(f"{where}: the current CUDA device is cuda:{current}, but this rank "
                                 f"(LOCAL_RANK={_rank_cuda.index}) computes on {_rank_cuda}")


def native_backend_device(backend: str) -> torch.device:
    """The device ``backend`` takes without any declaration (CUDA: the rank's own GPU, not
    whichever device is current)."""
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


def cpu_has_native_bf16(cpuinfo: Optional[str] = None) -> bool:
    """Whether this CPU (``cpuinfo``: the text of /proc/cpuinfo, read when None) multiplies
    bfloat16 matrices in hardware (x86: AVX512-BF16 or AMX; Arm: the BF16 extension). Without it
    torch emulates bfloat16 matmuls, slower than float32."""
    text = cpuinfo
    if text is None:
        try:
            with open("/proc/cpuinfo") as f:
                text = f.read()
        except OSError:
            return False
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def autocast_dtype(mode: str, device: torch.device, params_dtype: torch.dtype) -> Optional[torch.dtype]:
    """The dtype a float32 model's matmuls run in under ``parallel.autocast`` = ``mode`` on
    ``device``, or None to run them in the weights' own dtype.

    "auto" picks bfloat16 on a CPU with native bfloat16 matmuls (on two cores of such a host a
    135M model's training phase took 1.71x less time) and nothing elsewhere: CUDA runs train
    with bfloat16 weights and megatron's mixed-precision optimizer instead."""
    if mode not in ("none", "bfloat16", "auto"):
        raise ValueError(f"parallel.autocast: {mode!r} not allowed; allowed: none, bfloat16, auto")
    if mode == "bfloat16" and params_dtype != torch.float32:
        raise ValueError(f"parallel.autocast: bfloat16 needs model.dtype float32 (weights in {params_dtype} "
                         "already compute in that type); set parallel.autocast to none or auto")
    if mode == "none" or params_dtype != torch.float32:
        return None
    if mode == "bfloat16":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cpu" and cpu_has_native_bf16() else None


def autocast(device: torch.device, dtype: Optional[torch.dtype]):
    """Mixed precision on ``device`` for the forwards and backwards inside; a no-op context for
    ``dtype`` None.

    Without autocast's cache of cast weights: it would keep a bfloat16 copy of every weight
    for the whole region, a training step's forward and backward over all its micro-batches,
    on top of the float32 weights (the main job's config with parallel.autocast=auto, bench
    memory: 31.3 bytes per parameter with it, 29.7 without, training time the same)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None, cache_enabled=False)


# oneDNN keeps every matmul primitive it creates, up to 1024 of them. Micro-batches cut to
# their longest row give bfloat16 matmuls new shapes every step, so the cache grew the training
# peak step by step (bench memory with parallel.autocast=auto over six steps: 28.7 to 32.8
# bytes per parameter). At 128 (about a step's primitives): 28.7 to 31.5; at 8: 28.3 to 30.8.
# Recreated primitives cost time: the main job's training phase took 45.9 s unbounded, 52.5 s
# at 128 and 58.3 s at 8 (76.6 s in float32).
ONEDNN_PRIMITIVE_CACHE = 128


def bound_cpu_kernel_cache() -> None:
    """Bound oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, read when the cache is
    first used, so this runs before the first bfloat16 matmul; a value already set wins)."""
    import os

    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE))


def without_autocast(device: torch.device):
    """Float32 inside an autocast region (the output layer and its log-softmax over the
    vocabulary, where bfloat16's 8 mantissa bits would blur the log-probs)."""
    return torch.autocast(device.type, enabled=False)


def float32_backward(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t``, whose producing node then runs its backward with autocast off on ``device``.

    A forward run in float32 inside an autocast region (``without_autocast``) would otherwise
    take bfloat16 copies of its weight and incoming gradient in backward, when the region
    covers backward too: for the output layer of a 49k vocabulary that is a weight's worth of
    copies per micro-batch, and a gradient of the tied embedding rounded to bfloat16."""
    node = t.grad_fn
    if node is None:
        return t
    saved: list[bool] = []

    def off(grad_outputs):
        saved.append(torch.is_autocast_enabled(device.type))
        torch.set_autocast_enabled(device.type, False)

    def restore(grad_inputs, grad_outputs):
        torch.set_autocast_enabled(device.type, saved.pop())

    node.register_prehook(off)
    node.register_hook(restore)
    return t
