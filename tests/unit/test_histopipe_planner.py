import random

import numpy as np
import pytest

from rhymerl.config import HistoPipeConfig
from rhymerl.histopipe import DecodeCostModel, HistoPipePlanner, LengthPredictor, NoopPlanner, Plan, PromptGroup

pytestmark = pytest.mark.cpu


def _groups(rng, count):
    return [PromptGroup(key=1000 + i, index=i, prompt_len=rng.randint(10, 900), n=rng.choice([1, 2, 8, 16])) for i in range(count)]


def _assert_exactly_once(plan: Plan, groups):
    want = sorted((g.index, s) for g in groups for s in range(g.n))
    assert sorted(plan.requests()) == want


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_request_planned_exactly_once(seed):
    rng = random.Random(seed)
    for trial in range(25):
        groups = _groups(rng, rng.randint(1, 60))
        N = rng.randint(1, 40)
        planner = HistoPipePlanner(N, max_batch=rng.choice([1, 8, 64]))
        pred = {g.index: float(rng.choice([1, 50, 3000, 16000])) for g in groups}
        plan = planner.plan_lengths(trial, groups, pred)
        assert len(plan.instances) == N
        _assert_exactly_once(plan, groups)


def test_hook_uses_predictor_and_history():
    pr = LengthPredictor(HistoPipeConfig(), max_tokens=4096)
    groups = [PromptGroup(key=k, index=i, prompt_len=50, n=4) for i, k in enumerate([7, 8, 9, 10])]
    hist = {7: [[4000] * 4], 8: [[100] * 4], 9: [[2000] * 4]}
    plan = HistoPipePlanner(2, max_batch=8).plan(1, groups, pr, hist.get)
    _assert_exactly_once(plan, groups)
    assert plan.predicted[0] > plan.predicted[2] > plan.predicted[1]
    assert plan.predicted[3] == pytest.approx(pr.predict(10, None))
    # Longest-predicted-first: each instance's list is in non-increasing predicted order.
    for inst in plan.instances:
        p = [plan.predicted[g] for g, _ in inst]
        assert p == sorted(p, reverse=True)
    assert all(plan.instances)


def test_balances_predicted_time_not_count():
    groups = [PromptGroup(key=i, index=i, prompt_len=100, n=1) for i in range(9)]
    pred = {0: 8000.0, **{i: 1000.0 for i in range(1, 9)}}
    plan = HistoPipePlanner(2, max_batch=64).plan_lengths(1, groups, pred)
    counts = sorted(len(inst) for inst in plan.instances)
    assert counts == [1, 8]  # the long response alone vs the eight short ones


def test_split_when_cost_model_says_so():
    groups = [PromptGroup(key=i, index=i, prompt_len=100, n=16) for i in range(2)]
    pred = {0: 6000.0, 1: 6000.0}
    auto = HistoPipePlanner(8, max_batch=64).plan_lengths(1, groups, pred)
    # Two whole groups would keep six of eight instances idle.
    assert sum(1 for inst in auto.instances if inst) == 8
    assert auto.info["grouping"] == "split"
    # Many small groups: keeping them whole balances as well and wins.
    many = [PromptGroup(key=i, index=i, prompt_len=100, n=16) for i in range(64)]
    p2 = {g.index: 1000.0 + 10 * g.index for g in many}
    assert HistoPipePlanner(8, max_batch=64).plan_lengths(1, many, p2).info["grouping"] == "keep"


def test_state_round_trips():
    groups = [PromptGroup(key=i, index=i, prompt_len=100, n=8) for i in range(64)]
    planner = HistoPipePlanner(16, max_batch=64)
    planner.plan_lengths(2, groups, {g.index: 200.0 * (1 + g.index) for g in groups})
    other = HistoPipePlanner(16, max_batch=64)
    other.load_state_dict(planner.state_dict())
    assert other.state_dict() == planner.state_dict() and planner.state_dict()["last_step"] == 2


def test_noop_planner_round_robin_in_dataset_order():
    groups = [PromptGroup(key=i, index=i, prompt_len=10, n=2) for i in range(5)]
    plan = NoopPlanner(2).plan(0, groups, None, None)
    assert plan.instances == [[(0, 0), (0, 1), (2, 0), (2, 1), (4, 0), (4, 1)], [(1, 0), (1, 1), (3, 0), (3, 1)]]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="num_instances"):
        HistoPipePlanner(0, 8)
    with pytest.raises(ValueError, match="twice"):
        NoopPlanner(2).plan(0, [PromptGroup(1, 0, 5, 1), PromptGroup(2, 0, 5, 1)])
    with pytest.raises(ValueError, match="n=0"):
        HistoPipePlanner(2, 8).plan_lengths(0, [PromptGroup(1, 0, 5, 0)], {0: 1.0})


def test_cost_model_shape():
    cm = DecodeCostModel.for_instance(tp=4, max_batch=64)
    assert cm.step_time(64, 1e5) > cm.step_time(8, 1e5) > cm.step_time(8, 1e3)
    # A response twice as long costs more than twice (its KV reads grow with it).
    assert cm.request_work(2000, 100) > 2 * cm.request_work(1000, 100) - cm.prefill_time(100)
    # A fuller batch shares the fixed step cost.
    assert cm.request_work(1000, 100, occupancy=64) < cm.request_work(1000, 100, occupancy=1)
    assert DecodeCostModel.for_instance(tp=8).a < cm.a
    with pytest.raises(ValueError, match="does not fit"):
        DecodeCostModel.for_instance(tp=1, weights_gb=100)


def test_nonnegative_lstsq_is_the_constrained_optimum():
    """Exact on random problems: x >= 0 and the KKT conditions of the convex problem hold (the
    residual's gradient is zero on x's support and points outward, >= 0, off it)."""
    from rhymerl.histopipe.calibration import nonnegative_lstsq

    rng = np.random.default_rng(0)
    clipped = 0
    for _ in range(200):
        a = rng.normal(size=(12, 4))
        b = rng.normal(size=12)
        x = nonnegative_lstsq(a, b)
        g = a.T @ (a @ x - b)
        assert (x >= 0).all()
        assert np.allclose(g[x > 0], 0, atol=1e-9) and (g[x == 0] >= -1e-9).all()
        clipped += (x == 0).any()
    assert clipped > 50  # the constraint binds in many of them
    a = rng.uniform(size=(20, 3))
    assert np.allclose(nonnegative_lstsq(a, a @ np.array([0.5, 2.0, 0.1])), [0.5, 2.0, 0.1])


def test_step_cost_fit_keeps_every_cost_nonnegative():
    """Steps whose unconstrained fit has a negative fixed cost: the other costs are fitted with
    the fixed cost at its bound, not fitted beside a negative one and then clipped."""
    from rhymerl.histopipe import calibration

    fit = calibration.StepCostFit(DecodeCostModel(a=1.0, b=0.0, c=0.0, p=1e-4, max_batch=8, kv_capacity=10**6))
    rows = [(B, K, 0.003 * B - 0.001 + 2e-7 * K) for B in range(1, 9) for K in (100, 1000, 5000)]
    for B, K, t in rows:
        fit.add(B, K, t)
    got = fit.fit()
    assert got.a == 1e-6 and got.b > 0 and got.c > 0

    def sse(m):
        return sum((m.a + m.b * B + m.c * K - t) ** 2 for B, K, t in rows)

    clipped = DecodeCostModel(a=1e-6, b=0.003, c=2e-7, p=1e-4, max_batch=8, kv_capacity=10**6)
    assert sse(got) < sse(clipped) / 2
    # Prefill that the step times cannot tell from free keeps the prior's price: at zero, every
    # move between instances (a re-prefill) would look free to the scheduler.
    for B, F in ((2, 300), (5, 40), (7, 1000)):
        fit.add(B, 1000, 0.003 * B - 0.001 + 2e-7 * 1000 - 1e-6 * F, prefill_tokens=F)
    assert fit.fit().p == 1e-4


def test_calibration_file_and_step_cost_fit(tmp_path):
    from rhymerl.histopipe import calibration

    cost, source, _ = calibration.load()
    assert "not a measurement" in source and cost.max_batch >= 1
    true = DecodeCostModel(a=0.01, b=0.002, c=1e-6, p=1e-4, max_batch=8, kv_capacity=10**6)
    fit = calibration.StepCostFit(DecodeCostModel(a=1.0, b=0.0, c=0.0, p=1e-4, max_batch=8, kv_capacity=10**6))
    assert fit.fit().a == 1.0  # no samples yet: the prior
    for B in range(1, 9):
        for K in (100, 1000, 5000):
            fit.add(B, K, true.step_time(B, K))
    got = fit.fit()
    assert got.a == pytest.approx(0.01, rel=1e-6) and got.b == pytest.approx(0.002, rel=1e-6)
    assert got.c == pytest.approx(1e-6, rel=1e-6) and got.p == 1e-4  # no prefill seen: the prior's
    for B, F in ((2, 300), (5, 40), (7, 1000)):
        fit.add(B, 1000, true.step_time(B, 1000) + 3e-4 * F, prefill_tokens=F)
    assert fit.fit().p == pytest.approx(3e-4, rel=1e-6)
    calibration.save(tmp_path / "cal.json", got, "fitted in a test")
    assert calibration.load(tmp_path / "cal.json")[1] == "fitted in a test"
    (tmp_path / "bad.json").write_text('{"source": "x", "cost": {"a": -1}}')
    with pytest.raises(ValueError, match="cost field"):
        calibration.load(tmp_path / "bad.json")
