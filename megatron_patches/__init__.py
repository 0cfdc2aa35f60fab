"""Minimal, version-pinned patches that let megatron-core 0.16.1 run on a CPU host with gloo.

Nothing here edits megatron's source. Every patch is process-wide or scoped to one megatron
module's view of ``torch``, is applied explicitly (``apply_all()`` or ``apply(name)``), can be
reverted (``revert_all()``, for tests), and refuses to run against another megatron-core release:
the call sites it targets were read in 0.16.1 only.

On a CUDA host none of them is needed; ``apply_all()`` then applies nothing.

Patches (name: reason):
- ``cuda_current_device``: megatron allocates on ``torch.cuda.current_device()``, which raises without CUDA.
- ``cpu_rng_tracker``: megatron's model-parallel RNG tracker forks CUDA generator states; use the CPU generator.
- ``schedules_device``: the pipeline schedules allocate their token counter with ``device="cuda"``.
- ``optimizer_device``: optimizer, grad clipping (and its local multi-tensor l2 norm) and DDP grad buffers allocate scalars with ``device="cuda"``.
- ``causal_mask_device``: the default causal attention mask is built with ``device="cuda"``.
- ``grad_clip_cpu``: clipping asserts every grad is a ``torch.cuda.FloatTensor``; accept float32 CPU grads.
- ``cuda_synchronize``: p2p pipeline communication calls ``torch.cuda.synchronize()`` (PP > 1).
- ``checkpoint_rng``: activation recomputation saves and restores the CUDA generator's state; keep the CPU generator's and the tracker's.
- ``tensor_cuda``: tied embeddings with PP > 1 move the shared weight with ``Tensor.cuda()`` before the all-reduce.
- ``checkpoint_without_output_te``: selective recomputation (``recompute_modules=["layernorm"]``)
  takes Transformer Engine's FP8 path whenever it is built without arguments
  (``self.fp8 = fp8 is not None``) and raises NameError without Transformer Engine. Needed on any
  host without it, so the Megatron backend also applies it on CUDA when it uses that path.
"""

from __future__ import annotations

import functools
import importlib
import types
from dataclasses import dataclass
from typing import Callable

PINNED_MEGATRON_CORE = "0.16.1"

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like", "full_like")


class PatchVersionError(RuntimeError):
    """megatron-core is not the release these patches were written against."""


@dataclass(frozen=True)
class Patch:
    name: str
    reason: str
    apply: Callable[[], Callable[[], None]]  # returns its own undo


_applied: dict[str, Callable[[], None]] = {}


def megatron_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def check_version() -> None:
    found = megatron_version()
    if found != PINNED_MEGATRON_CORE:
        raise PatchVersionError(
            f"megatron_patches targets megatron-core {PINNED_MEGATRON_CORE} but {found} is installed; "
            f"re-read the patched call sites for {found} before changing PINNED_MEGATRON_CORE")


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, str):
        return device.startswith("cuda")
    return getattr(device, "type", None) == "cuda"


class _CpuDeviceTorch(types.ModuleType):
    """``torch`` as one megatron module sees it: tensor factories asked for ``device="cuda"`` get cpu."""

    def __init__(self, real):
        super().__init__("torch")
        self._real = real

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name not in _FACTORIES:
            return attr

        @functools.wraps(attr)
        def factory(*args, **kwargs):
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        return factory


def _shim_torch_in(module_names: tuple[str, ...]) -> Callable[[], None]:
    import torch

    saved = []
    for name in module_names:
        mod = importlib.import_module(name)
        saved.append((mod, mod.torch))
        mod.torch = _CpuDeviceTorch(torch)

    def undo():
        for mod, real in saved:
            mod.torch = real

    return undo


def _apply_cuda_current_device():
    import torch

    orig = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"

    def undo():
        torch.cuda.current_device = orig

    return undo


def _apply_cpu_rng_tracker():
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Same bookkeeping as megatron's tracker, but the forked state is the CPU generator's."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @mrandom.contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    saved = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED,
             mrandom.initialize_rng_tracker)
    tracker = CpuRNGStatesTracker()

    def initialize_rng_tracker(*args, force_reset: bool = False, **kwargs):
        if force_reset or not mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED:
            mrandom._CUDA_RNG_STATE_TRACKER = tracker
            mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    mrandom.initialize_rng_tracker = initialize_rng_tracker
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    def undo():
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED, mrandom.initialize_rng_tracker = saved

    return undo


def _apply_checkpoint_rng():
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    saved = (mrandom._get_all_rng_states, mrandom._set_all_rng_states)

    # CheckpointFunction and _fork_rng look these up at call time. Without CUDA there is no
    # device generator to save; the CPU generator and the tracker's (CPU) states are all the
    # recomputed forward draws from.
    def _get_all_rng_states():
        return torch.get_rng_state(), None, mrandom.get_cuda_rng_tracker().get_states()

    def _set_all_rng_states(cpu_rng_state, _device_rng_state, tracker_states):
        torch.set_rng_state(cpu_rng_state)
        mrandom.get_cuda_rng_tracker().set_states(tracker_states)

    mrandom._get_all_rng_states, mrandom._set_all_rng_states = _get_all_rng_states, _set_all_rng_states

    def undo():
        mrandom._get_all_rng_states, mrandom._set_all_rng_states = saved

    return undo


def _apply_cuda_synchronize():
    import torch

    orig = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: None

    def undo():
        torch.cuda.synchronize = orig

    return undo


def _apply_tensor_cuda():
    import torch

    orig = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self

    def undo():
        torch.Tensor.cuda = orig

    return undo


def _apply_grad_clip_cpu():
    import torch
    from megatron.core.optimizer import clip_grads, optimizer

    orig = clip_grads.clip_grad_by_total_norm_fp32

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        """megatron's clipping (scale all grads by max_norm / total_norm when that is < 1), minus the CUDA assert."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = []
        for p in parameters:
            g = getattr(p, attr, None)
            if g is not None:
                if g.dtype not in (torch.float32, torch.bfloat16) or (not use_decoupled_grad and g.dtype != torch.float32):
                    raise TypeError(f"gradient clipping expects float32 grads, got {g.dtype}")
                grads.append(clip_grads.to_local_if_dtensor(g).detach())
        coeff = max_norm / (total_norm + 1.0e-6)
        if coeff < 1.0 and grads:
            torch._foreach_mul_(grads, coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32

    def undo():
        clip_grads.clip_grad_by_total_norm_fp32 = orig
        optimizer.clip_grad_by_total_norm_fp32 = orig

    return undo


def _apply_checkpoint_without_output_te():
    from megatron.core.tensor_parallel import random as mrandom

    cls = mrandom.CheckpointWithoutOutput
    orig = cls.__init__

    # Upstream's "fp8 is not None" is True for the default fp8=False; with Transformer Engine
    # its FP8 state says "off" and nothing changes, without it the FP8 path cannot run at all.
    def __init__(self, fp8=False):
        orig(self, fp8)
        if not mrandom.HAVE_TE:
            self.fp8 = False

    cls.__init__ = __init__

    def undo():
        cls.__init__ = orig

    return undo


PATCHES: dict[str, Patch] = {p.name: p for p in (
    Patch("cuda_current_device", "megatron allocates on torch.cuda.current_device(), which raises without CUDA",
          _apply_cuda_current_device),
    Patch("cpu_rng_tracker", "megatron's model-parallel RNG tracker forks CUDA generator states; use the CPU generator",
          _apply_cpu_rng_tracker),
    Patch("schedules_device", "the pipeline schedules allocate their token counter with device='cuda'",
          lambda: _shim_torch_in(("megatron.core.pipeline_parallel.schedules",))),
    Patch("optimizer_device", "optimizer, grad clipping (and its local multi-tensor l2 norm) and DDP grad buffers allocate scalars with device='cuda'",
          lambda: _shim_torch_in(("megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
                                  "megatron.core.distributed.param_and_grad_buffer",
                                  "megatron.core.utils"))),
    Patch("causal_mask_device", "the default causal attention mask is built with device='cuda'",
          lambda: _shim_torch_in(("megatron.core.transformer.utils",))),
    Patch("grad_clip_cpu", "clipping asserts every grad is a torch.cuda.FloatTensor; accept float32 CPU grads",
          _apply_grad_clip_cpu),
    Patch("cuda_synchronize", "p2p pipeline communication calls torch.cuda.synchronize() (PP > 1)",
          _apply_cuda_synchronize),
    Patch("checkpoint_rng", "activation recomputation saves and restores the CUDA generator's state; keep the CPU "
          "generator's and the tracker's", _apply_checkpoint_rng),
    Patch("tensor_cuda", "tied embeddings with PP > 1 move the shared weight with Tensor.cuda() before the all-reduce",
          _apply_tensor_cuda),
    Patch("checkpoint_without_output_te", "selective norm recomputation takes Transformer Engine's FP8 path "
          "whenever it is built without arguments, and raises without Transformer Engine",
          _apply_checkpoint_without_output_te),
)}


def apply(name: str) -> None:
    """Apply one patch (idempotent)."""
    if name not in PATCHES:
        raise KeyError(f"unknown megatron patch {name!r}; known: {', '.join(PATCHES)}")
    if name in _applied:
        return
    check_version()
    _applied[name] = PATCHES[name].apply()


def revert(name: str) -> None:
    undo = _applied.pop(name, None)
    if undo is not None:
        undo()


def apply_all(device: str = "auto", skip: tuple[str, ...] = ()) -> list[str]:
    """Apply every patch a CPU host needs; returns the names applied. ``device="cuda"`` applies none."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        return []
    for name in PATCHES:
        if name not in skip:
            apply(name)
    return [n for n in PATCHES if n in _applied]


def revert_all() -> None:
    for name in reversed(list(_applied)):
        revert(name)


def applied() -> list[str]:
    return list(_applied)
