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
