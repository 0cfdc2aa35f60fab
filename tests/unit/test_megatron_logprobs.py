"""The Megatron backend's token log-probs, computed in place on the logits (no copy of the
vocabulary-sized buffer), equal log_softmax(logits / T) in value and in gradient."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.cpu


@pytest.fixture
def one_rank(one_rank_gloo):
    import megatron_patches

    from rhymerl.config import ParallelConfig
    from rhymerl.training.process_groups import destroy_process_groups, init_process_groups

    fresh = not megatron_patches.applied()
    try:
        init_process_groups(ParallelConfig(), 1, 0)
        yield
    finally:
        destroy_process_groups()
        if fresh:
            megatron_patches.revert_all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_in_place_logprobs_match_log_softmax_and_its_gradient(one_rank, temperature):
    from rhymerl.training.megatron_backend import MegatronBackend

    torch.manual_seed(0)
    B, T, V = 3, 7, 50
    base = torch.randn(B, T, V, requires_grad=True)
    ids = torch.randint(0, V, (B, T))
    weights = torch.randn(B, T)

    ref = torch.log_softmax(base / temperature, dim=-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    ref = torch.cat([torch.zeros(B, 1), ref], dim=1)
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), base)

    logits = base * 1.0  # a non-leaf, as the model's output is: the backend writes into it
    lp = MegatronBackend._token_logprobs(SimpleNamespace(temperature=temperature), logits, ids)
    (grad,) = torch.autograd.grad((lp * weights).sum(), base)

    assert lp.shape == (B, T) and torch.all(lp[:, 0] == 0)
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
