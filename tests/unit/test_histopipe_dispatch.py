import random

import pytest

from rhymerl.config import HistoPipeConfig
from rhymerl.histopipe import HistoPipePlanner, PromptGroup
from rhymerl.histopipe.dispatch import PlanDispatcher, is_straggler

pytestmark = pytest.mark.cpu


def test_dispatch_hands_out_every_request_exactly_once():
    rng = random.Random(3)
    for trial in range(20):
        groups = [PromptGroup(key=i, index=i, prompt_len=10, n=rng.randint(1, 8)) for i in range(rng.randint(1, 30))]
        N = rng.randint(1, 8)
        plan = HistoPipePlanner(HistoPipeConfig(), N, max_batch=8).plan_lengths(
            trial, groups, {g.index: float(rng.randint(1, 5000)) for g in groups})
        d = PlanDispatcher(plan, rebalance=bool(trial % 2))
        got = []
        while d.pending():
            i = rng.randrange(N)  # instances free slots in arbitrary order
            r = d.next_for(i)
            if r is not None:
                got.append(r)
            elif not d.rebalance:
                continue
            else:
                raise AssertionError("rebalancing dispatcher returned None with work pending")
        assert sorted(got) == sorted(plan.requests())
        assert all(d.next_for(i) is None for i in range(N))


def test_rebalance_takes_longer_queued_work_from_a_lagging_instance():
    groups = [PromptGroup(key=i, index=i, prompt_len=10, n=1) for i in range(4)]
    plan = HistoPipePlanner(HistoPipeConfig(split_groups="never"), 2, max_batch=8).plan_lengths(
        1, groups, {0: 4000.0, 1: 3000.0, 2: 2000.0, 3: 1000.0})
    d = PlanDispatcher(plan)
    first = {i: plan.instances[i][0] for i in range(2)}
    # Instance 1 frees slots first and takes both instance 0's and its own queued work in
    # global longest-first order.
    order = [d.next_for(1) for _ in range(4)]
    assert [plan.predicted[g] for g, _ in order] == [4000.0, 3000.0, 2000.0, 1000.0]
    assert d.moved == 2 and first[0] in order


def test_straggler_rule():
    cfg = HistoPipeConfig(straggler_fraction=0.1, straggler_threshold=1.5)
    assert is_straggler(cfg, generated=1600, predicted=1000, group_left=2, group_n=16)
    assert not is_straggler(cfg, generated=1600, predicted=1000, group_left=3, group_n=16)
    assert not is_straggler(cfg, generated=1400, predicted=1000, group_left=1, group_n=16)
