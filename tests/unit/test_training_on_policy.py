"""On-policy steps take the old log-probs from the loss's own forward: same gradient as a
separate no-grad pass, ratio exactly 1 (pure logic on a tiny randomly initialised Llama)."""

from __future__ import annotations

import pytest
import torch

from rhymerl.config import AlgorithmConfig
from rhymerl.training.base import PolicyBatch

pytestmark = pytest.mark.cpu


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float()


def _batch() -> PolicyBatch:
    g = torch.Generator().manual_seed(1)
    lengths, prompt, T = [20, 9, 31, 12, 7, 25], 5, 31
    ids = torch.randint(1, 97, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T)
    for i, n in enumerate(lengths):
        ids[i, n:] = 0
        mask[i, prompt:n] = 1.0
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, -0.3])
    return PolicyBatch(input_ids=ids, response_mask=mask, advantages=adv)


def _token_lp(model, ids):
    from rhymerl.training.deepspeed_backend import token_logprobs

    return token_logprobs(model(input_ids=ids).logits, ids)


def _grads(model, batch: PolicyBatch, cfg: AlgorithmConfig, dp: int = 2):
    from rhymerl.algorithms.losses import policy_loss
    from rhymerl.training.micro_loss import micro_batch_loss
    from rhymerl.training.microbatch import policy_micro_batches

    model.zero_grad()
    n_tok = float(batch.response_mask.sum())
    metrics = []
    # Two DP ranks' shards accumulate into one gradient, as the all-reduce would sum them.
    for rank in range(dp):
        _, micro = policy_micro_batches(batch, dp, rank, cfg.micro_batch_tokens, fixed_shape=False)
        for mb in micro:
            loss, m = micro_batch_loss(policy_loss, _token_lp(model, mb["input_ids"]), mb, cfg, n_tok,
                                       float(batch.input_ids.shape[0]))
            loss.backward()
            metrics.append(m)
    return {k: p.grad.clone() for k, p in model.named_parameters()}, metrics


@pytest.mark.parametrize("loss_agg", ["token", "sequence"])
def test_on_policy_gradient_equals_separate_pass(loss_agg):
    cfg = AlgorithmConfig(micro_batch_tokens=64, loss_agg=loss_agg)
    model = _model()
    batch = _batch()
    with torch.no_grad():
        old = _token_lp(model, batch.input_ids) * batch.response_mask
    separate = PolicyBatch(batch.input_ids, batch.response_mask, batch.advantages, old_logprobs=old)
    g_sep, m_sep = _grads(model, separate, cfg)
    g_on, m_on = _grads(model, batch, cfg)
    assert g_sep.keys() == g_on.keys()
    for k in g_on:
        assert g_on[k].abs().sum() > 0 or g_sep[k].abs().sum() == 0, k
        # The two passes differ only by float32 rounding of the ratio (~1e-7 of each tensor's
        # scale); an element-wise rtol alone fails on elements that nearly cancel.
        scale = float(g_sep[k].abs().max())
        torch.testing.assert_close(g_on[k], g_sep[k], rtol=1e-5, atol=1e-5 * scale + 1e-12, msg=k)
    # Ratio exactly 1, nothing clipped, and the separate pass agreed to float rounding.
    for m in m_on:
        if m["tokens"]:
            assert m["ratio_max"] == m["ratio_min"] == 1.0 and m["clip_frac"] == 0.0 and m["approx_kl"] == 0.0
    assert all(abs(m["ratio_max"] - 1.0) < 1e-5 for m in m_sep if m["tokens"])


def test_on_policy_micro_batches_carry_engine_logprobs_for_the_agreement_check():
    from rhymerl.algorithms.losses import policy_loss
    from rhymerl.training.megatron_backend import combine_metrics
    from rhymerl.training.micro_loss import engine_mismatch, micro_batch_loss
    from rhymerl.training.microbatch import policy_micro_batches

    cfg = AlgorithmConfig(micro_batch_tokens=64)
    model = _model()
    batch = _batch()
    with torch.no_grad():
        exact = _token_lp(model, batch.input_ids) * batch.response_mask
    batch.engine_logprobs = exact + 0.25 * batch.response_mask
    batch.engine_logprobs[2, 10] += 1.0
    _, micro = policy_micro_batches(batch, 1, 0, cfg.micro_batch_tokens, fixed_shape=False)
    assert all("old" not in mb and "engine" in mb for mb in micro)
    with torch.no_grad():
        ms = [micro_batch_loss(policy_loss, _token_lp(model, mb["input_ids"]), mb, cfg, 1.0, 6.0)[1] for mb in micro]
    extra = combine_metrics(ms)
    got = engine_mismatch(extra)
    n = float(batch.response_mask.sum())
    assert got["max_abs"] == pytest.approx(1.25, abs=1e-5)
    assert got["mean_abs"] == pytest.approx((0.25 * n + 1.0) / n, abs=1e-5)
    assert got["tokens"] == n and "engine_lp_diff_max" not in extra


def test_logprobs_from_the_last_positions_equal_the_full_ones():
    from rhymerl.training.deepspeed_backend import token_logprobs

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (2, 9), generator=g)
    logits = torch.randn(2, 9, 50, generator=g)
    full = token_logprobs(logits, ids, temperature=0.7)
    # Logits of the last 5 positions score tokens 5..8; everything before is 0.
    cut = token_logprobs(logits[:, 4:], ids, temperature=0.7)
    assert cut.shape == full.shape
    torch.testing.assert_close(cut[:, 5:], full[:, 5:])
    assert (cut[:, :5] == 0).all() and (full[:, 1:5] != 0).all()


def test_left_pad_columns_puts_zeros_before_the_scored_positions():
    from rhymerl.training.microbatch import left_pad_columns

    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert left_pad_columns(x, 4).tolist() == [[0.0, 0.0, 1.0, 2.0], [0.0, 0.0, 3.0, 4.0]]
    assert left_pad_columns(x, 2) is x


def _grads_of_rows(model, batch: PolicyBatch, kept: PolicyBatch, cfg: AlgorithmConfig, dp: int = 2):
    """``_grads`` of ``kept`` (rows of ``batch``) with the whole batch's loss normalisers."""
    from rhymerl.algorithms.losses import policy_loss
    from rhymerl.training.micro_loss import micro_batch_loss
    from rhymerl.training.microbatch import policy_micro_batches

    model.zero_grad()
    for rank in range(dp):
        _, micro = policy_micro_batches(kept, dp, rank, cfg.micro_batch_tokens, fixed_shape=False)
        for mb in micro:
            loss, _ = micro_batch_loss(policy_loss, _token_lp(model, mb["input_ids"]), mb, cfg,
                                       float(batch.response_mask.sum()), float(batch.input_ids.shape[0]))
            loss.backward()
    return {k: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for k, p in model.named_parameters()}


@pytest.mark.parametrize("loss_agg", ["token", "sequence"])
@pytest.mark.parametrize("separate_old", [False, True])
def test_rows_with_zero_advantage_left_out_give_the_same_gradient(loss_agg, separate_old):
    from rhymerl.algorithms.losses import policy_loss
    from rhymerl.training.micro_loss import rows_to_train

    cfg = AlgorithmConfig(micro_batch_tokens=64, loss_agg=loss_agg)
    model = _model()
    batch = _batch()
    batch.advantages = torch.tensor([1.0, 0.0, 0.7, 0.0, 0.0, -0.3])
    if separate_old:
        with torch.no_grad():
            # Another policy sampled: ratios differ from 1, so the clip is exercised too.
            batch.old_logprobs = (_token_lp(model, batch.input_ids) + 0.3) * batch.response_mask
    kept, skipped = rows_to_train(batch, cfg, policy_loss)
    assert skipped == 3 and kept.input_ids.shape[0] == 3
    torch.testing.assert_close(kept.input_ids, batch.input_ids[[0, 2, 5]])
    if separate_old:
        torch.testing.assert_close(kept.old_logprobs, batch.old_logprobs[[0, 2, 5]])
    g_all, _ = _grads(model, batch, cfg)
    g_kept = _grads_of_rows(model, batch, kept, cfg)
    for k in g_all:
        scale = float(g_all[k].abs().max())
        assert scale > 0, k
        torch.testing.assert_close(g_kept[k], g_all[k], rtol=1e-5, atol=1e-6 * scale, msg=k)


def test_a_batch_without_advantages_trains_its_shortest_row_at_zero_gradient():
    from rhymerl.algorithms.losses import policy_loss
    from rhymerl.training.micro_loss import rows_to_train

    cfg = AlgorithmConfig(micro_batch_tokens=64)
    model = _model()
    batch = _batch()
    batch.advantages = torch.zeros(6)
    kept, skipped = rows_to_train(batch, cfg, policy_loss)
    # Row lengths 20, 9, 31, 12, 7, 25: the 7-token row stays.
    assert skipped == 5 and kept.input_ids.shape[0] == 1
    torch.testing.assert_close(kept.input_ids, batch.input_ids[[4]])
    grads = _grads_of_rows(model, batch, kept, cfg)
    assert all(float(g.abs().max()) == 0.0 for g in grads.values())


def test_rows_are_kept_where_their_loss_is_not_zero():
    from rhymerl.algorithms.losses import policy_loss, rows_without_loss
    from rhymerl.training.micro_loss import rows_to_train

    batch = _batch()
    batch.advantages = torch.tensor([1.0, 0.0, 0.7, 0.0, 0.0, -0.3])
    on = AlgorithmConfig()
    # A KL term pulls every row towards the reference, whatever its advantage.
    batch.ref_logprobs = torch.zeros_like(batch.response_mask)
    assert rows_to_train(batch, AlgorithmConfig(kl_coef=0.1), policy_loss) == (batch, 0)
    assert rows_to_train(batch, on, policy_loss)[1] == 3  # a reference at kl_coef 0 adds nothing
    batch.ref_logprobs = None
    # A loss other than the policy loss may not vanish at zero advantage; the switch turns it off.
    assert rows_to_train(batch, on, lambda *a, **k: None) == (batch, 0)
    assert rows_to_train(batch, AlgorithmConfig(skip_zero_advantage_rows=False), policy_loss) == (batch, 0)
    # Per-token advantages: a row is idle only where every response token's advantage is 0.
    adv = torch.zeros_like(batch.response_mask)
    adv[0, 6] = 0.5
    adv[1, 0] = 2.0  # a prompt position: carries no loss
    assert rows_without_loss(adv, batch.response_mask, on).tolist() == [False, True, True, True, True, True]


def test_a_group_of_equal_rewards_has_advantage_exactly_zero():
    import numpy as np

    from rhymerl.algorithms.advantages import group_advantages

    # Three equal rewards whose float mean is not exactly the reward (0.1 + 0.1 + 0.1 != 0.3).
    r = np.array([0.1, 0.1, 0.1, 1.0, 0.0, 1.0])
    assert sum(r[:3]) / 3 != 0.1
    adv = group_advantages(r, [0, 0, 0, 1, 1, 1])
    assert (adv[:3] == 0.0).all() and (adv[3:] != 0.0).all()
    assert (group_advantages(r, [0, 0, 0, 1, 1, 1], scale_by_std=False)[:3] == 0.0).all()
