"""Megatron's recomputation options change memory only: one training step with the norms
recomputed (selective) or whole layers recomputed (full) computes the plain step's gradients (to
float rounding)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cpu


@pytest.fixture
def one_rank(one_rank_gloo):
    import megatron_patches

    from rhymerl.config import ParallelConfig
    from rhymerl.distributed.process_groups import destroy_process_groups, init_process_groups

    fresh = not megatron_patches.applied()
    try:
        yield lambda pc: init_process_groups(pc, 1, 0)
    finally:
        destroy_process_groups()
        if fresh:
            megatron_patches.revert_all()


def _step(groups_for, model_dir, **parallel_kw) -> tuple:
    from rhymerl.config import AlgorithmConfig, ParallelConfig
    from rhymerl.training.base import PolicyBatch
    from rhymerl.training.megatron_backend import MegatronBackend

    pc = ParallelConfig(**parallel_kw)
    b = MegatronBackend(pc, AlgorithmConfig(lr=1e-2), model_dir, groups_for(pc))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (3, 12), generator=g)
    mask = torch.ones(3, 12)
    mask[2, 8:] = 0
    metrics = b.train_step(PolicyBatch(ids, mask, torch.tensor([1.0, -0.5, 0.25]), torch.full((3, 12), -5.0)))
    # The gradients, not the updated weights: Adam's first step is lr * sign(g) wherever |g| is
    # tiny, so float rounding there would show up at the size of the learning rate.
    return metrics, {n: p.main_grad.detach().clone() for n, p in b.model.named_parameters()}


def test_recomputation_leaves_the_step_unchanged(one_rank, tiny_model_dir):
    ref_metrics, ref = _step(one_rank, tiny_model_dir)
    assert all(g.abs().sum() > 0 for g in ref.values())
    for kw in ({"recompute_norms": True}, {"recompute_activations": True}):
        metrics, got = _step(one_rank, tiny_model_dir, **kw)
        assert metrics.grad_norm == pytest.approx(ref_metrics.grad_norm, rel=1e-5) and ref_metrics.grad_norm > 0, kw
        assert metrics.loss == pytest.approx(ref_metrics.loss, rel=1e-5, abs=1e-7), kw
        moved = 0
        for name, p in ref.items():
            torch.testing.assert_close(got[name], p, rtol=1e-4, atol=1e-7, msg=f"{kw}: {name}")
            moved += 1
        assert moved == len(ref)
