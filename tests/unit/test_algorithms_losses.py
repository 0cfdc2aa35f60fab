import numpy as np
import pytest
import torch

from rhymerl.algorithms.losses import logprob_mismatch, policy_loss, update_gain
from rhymerl.config import AlgorithmConfig

pytestmark = pytest.mark.cpu


def _batch(seed=0, b=3, t=5):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    mask = torch.ones(b, t, dtype=torch.float64)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    adv = torch.tensor([1.5, -0.5, 2.0], dtype=torch.float64)[:b]
    return lp, mask, adv


def test_ratio_one_token_agg_loss_and_gradient():
    lp, mask, adv = _batch()
    x = lp.clone().requires_grad_(True)
    loss, m = policy_loss(x, lp, adv, mask, AlgorithmConfig(loss_agg="token"))
    n = mask.sum()
    expected = -(adv[:, None] * mask).sum() / n
    torch.testing.assert_close(loss, expected)
    loss.backward()
    torch.testing.assert_close(x.grad, -adv[:, None].expand_as(mask) * mask / n)
    assert m["clip_frac"] == 0.0 and m["ratio_mean"] == pytest.approx(1.0) and m["approx_kl"] == pytest.approx(0.0)
    assert m["tokens"] == float(n)
    assert m["entropy"] == pytest.approx(float(-(lp * mask).sum() / n))


def test_ratio_one_sequence_agg_loss_and_gradient():
    lp, mask, adv = _batch()
    x = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(x, lp, adv, mask, AlgorithmConfig(loss_agg="sequence"))
    torch.testing.assert_close(loss, -adv.mean())
    loss.backward()
    per_seq = mask.sum(1, keepdim=True)
    torch.testing.assert_close(x.grad, -adv[:, None] * mask / per_seq / 3)


def test_token_and_sequence_aggregation_differ_as_defined():
    lp, mask, adv = _batch()
    cur = lp + 0.05
    tok, _ = policy_loss(cur, lp, adv, mask, AlgorithmConfig(loss_agg="token"))
    seq, _ = policy_loss(cur, lp, adv, mask, AlgorithmConfig(loss_agg="sequence"))
    per_tok = -adv[:, None] * torch.exp(cur - lp)
    torch.testing.assert_close(tok, (per_tok * mask).sum() / mask.sum())
    torch.testing.assert_close(seq, ((per_tok * mask).sum(1) / mask.sum(1)).mean())
    assert abs(float(tok - seq)) > 1e-3


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_clip_zeroes_gradient_only_on_the_improving_side(sign):
    cfg = AlgorithmConfig(eps_low=0.2, eps_high=0.28)
    old = torch.zeros(1, 6, dtype=torch.float64)
    ratios = torch.tensor([[0.5, 0.79, 0.9, 1.1, 1.27, 1.6]], dtype=torch.float64)
    x = torch.log(ratios).requires_grad_(True)
    adv = torch.tensor([sign], dtype=torch.float64)
    loss, m = policy_loss(x, old, adv, torch.ones_like(old), cfg)
    loss.backward()
    g = x.grad[0]
    # Positive advantage: gradient vanishes only above 1+eps_high (no further increase rewarded).
    # Negative advantage: only below 1-eps_low.
    clipped = [False, False, False, False, False, True] if sign > 0 else [True, True, False, False, False, False]
    for j, c in enumerate(clipped):
        if c:
            assert g[j] == 0.0, (j, g)
        else:
            torch.testing.assert_close(g[j], -sign * ratios[0, j] / 6)
    assert m["clip_frac"] == pytest.approx(sum(clipped) / 6)
    assert m["clip_frac_high" if sign > 0 else "clip_frac_low"] == pytest.approx(sum(clipped) / 6)
    assert m["ratio_max"] == pytest.approx(1.6) and m["ratio_min"] == pytest.approx(0.5)


def test_kl_term_zero_at_reference_and_positive_away():
    lp, mask, adv = _batch()
    cfg = AlgorithmConfig(kl_coef=0.1)
    x = lp.clone().requires_grad_(True)
    base, _ = policy_loss(x, lp, adv, mask, AlgorithmConfig())
    with_kl, m = policy_loss(x, lp, adv, mask, cfg, ref_logprobs=lp)
    torch.testing.assert_close(with_kl, base)
    assert m["kl_ref"] == 0.0
    with_kl.backward()
    torch.testing.assert_close(x.grad, -adv[:, None] * mask / mask.sum())

    ref = lp - 0.3
    loss, m = policy_loss(lp, lp, adv, mask, cfg, ref_logprobs=ref)
    k3 = np.exp(-0.3) + 0.3 - 1
    assert m["kl_ref"] == pytest.approx(k3)
    torch.testing.assert_close(loss, base + 0.1 * k3)


def test_global_normaliser_makes_microbatches_sum_to_full_batch():
    lp, mask, adv = _batch(seed=1)
    cur = (lp + 0.1 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    for agg, key in (("token", "num_tokens"), ("sequence", "num_sequences")):
        cfg = AlgorithmConfig(loss_agg=agg)
        x = cur.clone().requires_grad_(True)
        full, _ = policy_loss(x, lp, adv, mask, cfg)
        full.backward()
        total = float(mask.sum()) if agg == "token" else 3.0
        y = cur.clone().requires_grad_(True)
        parts = [policy_loss(y[s], lp[s], adv[s], mask[s], cfg, **{key: total})[0] for s in (slice(0, 1), slice(1, 3))]
        sum(parts).backward()
        torch.testing.assert_close(sum(parts), full)
        torch.testing.assert_close(y.grad, x.grad)


def test_shape_errors_and_mismatch():
    lp, mask, adv = _batch()
    with pytest.raises(ValueError, match="same"):
        policy_loss(lp, lp[:, :2], adv, mask, AlgorithmConfig())
    eng = lp.clone()
    eng[1, 2] += 0.25
    eng[0, 4] += 5.0  # masked out: must not count
    out = logprob_mismatch(eng, lp, mask)
    assert out["max_abs"] == pytest.approx(0.25)
    assert out["mean_abs"] == pytest.approx(0.25 / float(mask.sum()))
    assert logprob_mismatch(eng.numpy(), lp.numpy(), mask.numpy())["max_abs"] == pytest.approx(0.25)


def test_bf16_inputs_are_computed_in_fp32():
    t = 600  # more tokens than bf16 counts exactly
    lp = torch.full((1, t), -1.0, dtype=torch.bfloat16, requires_grad=True)
    loss, m = policy_loss(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, t), AlgorithmConfig())
    assert loss.dtype == torch.float32 and m["tokens"] == float(t)
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp.grad.float(), torch.full((1, t), -1.0 / t), rtol=1e-2, atol=0)


def test_update_gain_weighs_each_token_change_by_its_advantage():
    lp, mask, adv = _batch()
    after = lp.clone()
    after[0, 0] += 0.3  # advantage 1.5, in the mask
    after[1, 4] -= 0.2  # advantage -0.5, in the mask
    after[2, 3] += 9.0  # masked out
    n = mask.sum().item()
    assert update_gain(adv, lp, after, mask) == pytest.approx((1.5 * 0.3 + 0.5 * 0.2) / n)
    assert update_gain(-adv, lp, after, mask) == pytest.approx(-(1.5 * 0.3 + 0.5 * 0.2) / n)
    per_token = adv[:, None].expand_as(lp)
    assert update_gain(per_token, lp, after, mask) == pytest.approx(update_gain(adv, lp, after, mask))
    assert update_gain(adv, lp, after, torch.zeros_like(mask)) == 0.0
    with pytest.raises(ValueError, match="must agree"):
        update_gain(adv, lp, after[:, :3], mask)
