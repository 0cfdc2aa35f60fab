import random

import pytest

from rhymerl.config import HistoPipeConfig
from rhymerl.histopipe import DecodeCostModel, HistoPipePlanner, LengthPredictor, NoopPlanner, Plan, PromptGroup

pytestmark = pytest.mark.cpu


def _groups(rng, count):
    return [PromptGroup(key=1000 + i, index=i, prompt_len=rng.randint(10, 900), n=rng.choice([1, 2, 8, 16])) for i in range(count)]


def _assert_exactly_once(plan: Plan, groups):
    want = sorted((g.index, s) for g in groups for s in range(g.n))
    assert sorted(plan.requests()) == want


@pytest.mark.parametrize("tier2", ["lpf", "paper"])
@pytest.mark.parametrize("split", ["auto", "never", "always"])
def test_every_request_planned_exactly_once(tier2, split):
    rng = random.Random(hash((tier2, split)) & 0xFFFF)
    for trial in range(25):
        groups = _groups(rng, rng.randint(1, 60))
        N = rng.randint(1, 40)
        cfg = HistoPipeConfig(split_groups=split, num_groups=rng.randint(1, 6))
        planner = HistoPipePlanner(cfg, N, max_batch=rng.choice([1, 8, 64]), tier2=tier2)
        pred = {g.index: float(rng.choice([1, 50, 3000, 16000])) for g in groups}
        plan = planner.plan_lengths(trial, groups, pred)
        assert len(plan.instances) == N
        _assert_exactly_once(plan, groups)


def test_hook_uses_predictor_and_history():
    cfg = HistoPipeConfig(split_groups="never")
    pr = LengthPredictor(cfg, max_tokens=4096)
    groups = [PromptGroup(key=k, index=i, prompt_len=50, n=4) for i, k in enumerate([7, 8, 9, 10])]
    hist = {7: [[4000] * 4], 8: [[100] * 4], 9: [[2000] * 4]}
    plan = HistoPipePlanner(cfg, 2, max_batch=8).plan(1, groups, pr, hist.get)
    _assert_exactly_once(plan, groups)
    assert plan.predicted[0] > plan.predicted[2] > plan.predicted[1]
    assert plan.predicted[3] == pytest.approx(pr.predict(10, None))
    # Longest-predicted-first: each instance's list is in non-increasing predicted order.
    for inst in plan.instances:
        p = [plan.predicted[g] for g, _ in inst]
        assert p == sorted(p, reverse=True)
    # The longest group does not share an instance with the second longest.
    where = {g: i for i, inst in enumerate(plan.instances) for g, _ in inst}
    assert where[0] != where[2]


def test_balances_predicted_time_not_count():
    cfg = HistoPipeConfig(split_groups="never")
    groups = [PromptGroup(key=i, index=i, prompt_len=100, n=4) for i in range(9)]
    pred = {0: 8000.0, **{i: 1000.0 for i in range(1, 9)}}
    plan = HistoPipePlanner(cfg, 2, max_batch=64).plan_lengths(1, groups, pred)
    counts = sorted(len(inst) for inst in plan.instances)
    assert counts == [4, 32]  # the long group alone vs the eight short ones


def test_split_when_cost_model_says_so():
    groups = [PromptGroup(key=i, index=i, prompt_len=100, n=16) for i in range(2)]
    pred = {0: 6000.0, 1: 6000.0}
    keep = HistoPipePlanner(HistoPipeConfig(split_groups="never"), 8, max_batch=64).plan_lengths(1, groups, pred)
    auto = HistoPipePlanner(HistoPipeConfig(split_groups="auto"), 8, max_batch=64).plan_lengths(1, groups, pred)
    assert sum(1 for inst in keep.instances if inst) == 2
    assert sum(1 for inst in auto.instances if inst) == 8
    assert auto.info["grouping"] == "split"
    # Many small groups: keeping them whole balances as well and wins.
    many = [PromptGroup(key=i, index=i, prompt_len=100, n=16) for i in range(64)]
    p2 = {g.index: 1000.0 + 10 * g.index for g in many}
    assert HistoPipePlanner(HistoPipeConfig(), 8, max_batch=64).plan_lengths(1, many, p2).info["grouping"] == "keep"


def test_paper_tier2_alternates_and_gives_long_groups_more_workers():
    cfg = HistoPipeConfig(num_groups=4)
    groups = [PromptGroup(key=i, index=i, prompt_len=100, n=8) for i in range(64)]
    pred = {g.index: 200.0 * (1 + g.index) for g in groups}
    planner = HistoPipePlanner(cfg, 16, max_batch=64, tier2="paper")
    odd = planner.plan_lengths(1, groups, pred)
    even = planner.plan_lengths(2, groups, pred)
    ws = odd.info["workers_per_length_group"]
    assert sum(ws) == 16 and ws == sorted(ws) and ws[-1] > ws[0]
    for inst in odd.instances:
        p = [pred[g] for g, _ in inst]
        assert p == sorted(p)
    for inst in even.instances:
        p = [pred[g] for g, _ in inst]
        assert p == sorted(p, reverse=True)
    st = planner.state_dict()
    other = HistoPipePlanner(cfg, 16, max_batch=64, tier2="paper")
    other.load_state_dict(st)
    assert other.state_dict() == st and st["last_step"] == 2


def test_noop_planner_round_robin_in_dataset_order():
    groups = [PromptGroup(key=i, index=i, prompt_len=10, n=2) for i in range(5)]
    plan = NoopPlanner(2).plan(0, groups, None, None)
    assert plan.instances == [[(0, 0), (0, 1), (2, 0), (2, 1), (4, 0), (4, 1)], [(1, 0), (1, 1), (3, 0), (3, 1)]]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="num_instances"):
        HistoPipePlanner(HistoPipeConfig(), 0, 8)
    with pytest.raises(ValueError, match="tier2"):
        HistoPipePlanner(HistoPipeConfig(), 2, 8, tier2="fastest")
    with pytest.raises(ValueError, match="twice"):
        NoopPlanner(2).plan(0, [PromptGroup(1, 0, 5, 1), PromptGroup(2, 0, 5, 1)])
    with pytest.raises(ValueError, match="n=0"):
        HistoPipePlanner(HistoPipeConfig(), 2, 8).plan_lengths(0, [PromptGroup(1, 0, 5, 0)], {0: 1.0})


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
