"""Token-budget micro-batching and metric merging (pure logic)."""

from __future__ import annotations

import pytest
import torch

from rhymerl.training.microbatch import pad_rows, plan_micro_batches, rank_slice, split_micro

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("rows,seq,dp,budget", [(4, 16, 1, 32), (5, 16, 2, 32), (3, 100, 2, 10), (8, 4, 4, 1000)])
def test_every_row_lands_once(rows, seq, dp, budget):
    plan = plan_micro_batches(rows, seq, dp, budget)
    assert plan.rows_per_micro * seq <= max(budget, seq)
    ids = torch.arange(rows)[:, None].expand(-1, seq) + 1
    got = []
    for r in range(dp):
        local = rank_slice(ids, plan, r)
        micro = split_micro(local, plan)
        assert len(micro) == plan.num_micro
        assert all(m.shape == (plan.rows_per_micro, seq) for m in micro)
        got += [int(x) for x in local[:, 0] if x != 0]
    assert sorted(got) == list(range(1, rows + 1))


def test_pad_rows_fills_with_value():
    t = pad_rows(torch.ones(2, 3), 4, value=7)
    assert t.shape == (4, 3) and torch.all(t[2:] == 7)


def test_empty_batch_is_an_error():
    with pytest.raises(ValueError):
        plan_micro_batches(0, 4, 1, 10)


def test_combine_metrics():
    from rhymerl.training.megatron_backend import combine_metrics

    m = combine_metrics([{"tokens": 10.0, "clip_frac": 0.5, "ratio_max": 1.2, "ratio_min": 0.9},
                         {"tokens": 30.0, "clip_frac": 0.1, "ratio_max": 1.5, "ratio_min": 0.7},
                         {"tokens": 0.0, "clip_frac": 0.0, "ratio_max": -1e30, "ratio_min": 1e30}])
    assert m["tokens"] == 40.0
    assert m["clip_frac"] == pytest.approx((0.5 * 10 + 0.1 * 30) / 40)
    assert m["ratio_max"] == 1.5 and m["ratio_min"] == 0.7


def _ragged_mask(lengths: list[int], prompt: int, width: int) -> torch.Tensor:
    mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        mask[i, prompt:n] = 1.0
    return mask


@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize("fixed_shape", [False, True])
def test_length_ordered_micro_batches_cover_every_row_and_cut_padding(dp, fixed_shape):
    from rhymerl.training.microbatch import pad_columns, row_lengths, split_policy_rows, unpermute_rows

    lengths = [40, 6, 9, 33, 7, 12, 8]
    T = max(lengths)
    mask = _ragged_mask(lengths, 3, T)
    ids = torch.arange(1, len(lengths) * T + 1).view(len(lengths), T) * (torch.arange(T) < torch.tensor(lengths)[:, None])
    assert row_lengths(mask).tolist() == lengths
    parts, cells = [], 0
    for r in range(dp):
        plan, perm, micro = split_policy_rows({"input_ids": ids, "mask": mask}, mask, dp, r, 2 * T, fixed_shape)
        assert sorted(perm.tolist()) == list(range(len(lengths)))
        for mb in micro:
            width = mb["input_ids"].shape[1]
            # No real token is ever cut off, and without fixed shapes nothing wider than its longest row.
            assert width == T if fixed_shape else width == max(int(row_lengths(mb["mask"]).max()), 1)
            cells += mb["input_ids"].numel()
        parts.append(torch.cat([pad_columns(mb["input_ids"], T) for mb in micro])[: plan.rows_per_rank])
    # A per-row result computed on the micro-batches comes back in the batch's order, exactly.
    assert torch.equal(unpermute_rows(torch.cat(parts), perm), ids)
    if not fixed_shape and dp == 1:
        # Longest rows together: the two long ones share a micro-batch, the short ones do not pay for them.
        assert cells < len(lengths) * T * 0.6


def test_length_order_balances_ranks():
    from rhymerl.training.microbatch import length_order, plan_micro_batches

    plan = plan_micro_batches(6, 10, 2, 100)
    perm = length_order(torch.tensor([1, 9, 2, 8, 3, 7]), plan, 2)
    # Longest first, dealt in turn: each rank gets one of the two longest rows.
    assert perm.tolist() == [1, 5, 2, 3, 4, 0]


def test_unscored_prefix_keeps_the_position_that_predicts_the_first_response_token():
    from rhymerl.training.microbatch import unscored_prefix

    mask = torch.zeros(3, 10)
    mask[0, 6:9] = 1
    mask[1, 4:7] = 1  # the earliest response token of the micro-batch: position 3 predicts it
    assert unscored_prefix(mask) == 3
    assert unscored_prefix(mask[:1]) == 5
    # A response from position 1 (or 0) leaves nothing to skip; an all-padding micro-batch
    # keeps one position so the forward still has an output.
    mask[2, 1] = 1
    assert unscored_prefix(mask) == 0
    assert unscored_prefix(torch.zeros(2, 7)) == 6

