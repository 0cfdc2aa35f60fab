"""Small, version-guarded fixes to vLLM, applied explicitly by the rollout engine.

Each patch states its reason in one line, checks the vLLM version (and platform) it
was written for, and is idempotent. ``apply_all()`` returns the names it applied.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# vLLM versions whose CPU expand kernel drops its output (upstream issue #55005; 0.33.0 has the same code).
_EXPAND_FIX_VERSIONS = ("0.32.", "0.33.")

_applied: set[str] = set()


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "")


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def expand_batch_to_tokens_torch(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """Torch version of rejection_sampler.expand_batch_to_tokens (same contract)."""
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    src = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype, device=x.device), x)
    out = torch.repeat_interleave(src, counts, output_size=num_tokens)
    return out


def patch_cpu_rejection_expand() -> bool:
    """Reason: on CPU the expand kernel writes into an int64 temporary that is never copied back, so the
    rejection sampler reads uninitialised temperatures (and top-k/top-p) and sampled speculation is
    off-distribution."""
    name = "cpu_rejection_expand"
    if name in _applied:
        return True
    if not _vllm_version().startswith(_EXPAND_FIX_VERSIONS) or not _on_cpu():
        return False
    from vllm.v1.sample import rejection_sampler as rs

    rs._rhymerl_original_expand_batch_to_tokens = rs.expand_batch_to_tokens
    rs.expand_batch_to_tokens = expand_batch_to_tokens_torch
    _applied.add(name)
    logger.info("rhymerl: applied vLLM patch %s (vLLM %s)", name, _vllm_version())
    return True


def unpatch_cpu_rejection_expand() -> None:
    """Undo patch_cpu_rejection_expand (tests use it to show the unfixed path)."""
    from vllm.v1.sample import rejection_sampler as rs

    orig = getattr(rs, "_rhymerl_original_expand_batch_to_tokens", None)
    if orig is not None:
        rs.expand_batch_to_tokens = orig
    _applied.discard("cpu_rejection_expand")


def patch_idempotent_kernel_registration() -> bool:
    """Reason: every engine start re-registers the CPU kernel overrides, which rescans sys.modules and
    crashes (AttributeError in _rebind_kernels) once numba's llvmlite is loaded, e.g. after an ngram engine."""
    name = "idempotent_kernel_registration"
    if name in _applied:
        return True
    if not _vllm_version().startswith(_EXPAND_FIX_VERSIONS):
        return False
    from vllm.triton_utils import dispatcher

    original = dispatcher.register_kernels

    def register_kernels(overrides):
        fresh = {k: v for k, v in overrides.items() if dispatcher._registry.get(k, (None, None))[1] is not v}
        if fresh:
            original(fresh)

    dispatcher._rhymerl_original_register_kernels = original
    dispatcher.register_kernels = register_kernels
    _applied.add(name)
    return True


def apply_all() -> list[str]:
    applied = []
    if patch_cpu_rejection_expand():
        applied.append("cpu_rejection_expand")
    if patch_idempotent_kernel_registration():
        applied.append("idempotent_kernel_registration")
    return applied


def applied() -> set[str]:
    return set(_applied)
