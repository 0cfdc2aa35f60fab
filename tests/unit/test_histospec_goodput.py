import dataclasses
import json
import random

import numpy as np
import pytest

from rhymerl.config import HistoSpecConfig
from rhymerl.histospec import DraftProposer, HistoryStore
from rhymerl.histospec.goodput import (AcceptanceTracker, StepCostModel, draft_can_pay, expected_tokens, plan_step,
                                       remaining_cap)
from rhymerl.histospec.proposer import DRAFTING, Drafting
from rhymerl.histospec.step_costs import CPU_PRIOR, StepCosts

pytestmark = pytest.mark.cpu


def test_cost_model_recovers_step_costs_from_observed_steps():
    m = StepCostModel(0.055, 0.0046, 0.0016)
    rng = random.Random(0)
    for _ in range(3000):
        r = rng.randint(1, 32)
        t = r + rng.randint(0, 4 * r)
        m.observe_step(r, t, 0.01 + 0.001 * r + 0.0003 * t)
    f, pr, pt, pd = m.coef
    assert f == pytest.approx(0.01, rel=0.05) and pr == pytest.approx(0.001, rel=0.05) and pt == pytest.approx(0.0003, rel=0.05)
    assert pd == pytest.approx(0.0, abs=1e-4)
    # Before any measurement (and for nonsense input) the prior stands.
    p = StepCostModel(0.05, 0.004, 0.002)
    p.observe_step(0, 0, 1.0)
    p.observe_step(3, 2, 1.0)
    p.observe_step(3, 3, float("nan"))
    assert p.coef == (0.05, 0.004, 0.002, 0.0)
    with pytest.raises(ValueError):
        StepCostModel(0.05, 0.004, 0.0)


def test_expected_tokens_is_sum_of_survival_products():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_plan_maximises_tokens_per_second():
    cost = StepCostModel(0.05, 0.0, 0.01)  # a draft token costs 1/5 of a step's fixed cost
    surv = [[0.99] * 6, [0.3] * 6, [], [0.9, 0.05, 0.9]]
    plan = plan_step(surv, cost)
    # Exhaustive check over all length vectors: the greedy plan is optimal.
    import itertools

    def goodput(ls):
        e = sum(expected_tokens(s, k) for s, k in zip(surv, ls))
        return e / (0.05 + 0.01 * (len(surv) + sum(ls)))

    best = max(itertools.product(range(7), range(7), range(1), range(4)), key=goodput)
    assert goodput(plan.lengths) == pytest.approx(goodput(best))
    assert plan.lengths[1] == 0 and plan.lengths[0] > 0  # a poor draft does not pay; a sure one does
    assert plan.expected_tokens == pytest.approx(sum(expected_tokens(s, k) for s, k in zip(surv, plan.lengths)))


def test_nobody_drafts_when_no_token_pays():
    cost = StepCostModel(0.0, 0.0, 1.0)  # the step's whole cost is per scored token
    plan = plan_step([[0.6] * 8, [0.9] * 8], cost)
    assert plan.lengths == [0, 0] and plan.draft_tokens == 0
    # Caps (engine room, predicted remaining length) bound each request.
    cheap = StepCostModel(1.0, 0.0, 1e-4)
    assert plan_step([[1.0] * 8, [1.0] * 8], cheap, caps=[3, 0]).lengths == [3, 0]


def test_remaining_cap_follows_predicted_length():
    assert remaining_cap(10, None, 1.5) is None
    assert remaining_cap(10, 20, 0.0) is None
    assert remaining_cap(10, 20, 1.0) == 9  # 10 tokens left: the last is sampled, 9 can be drafted
    assert remaining_cap(10, 8, 1.0) is None  # past the prediction: the tail, no cap
    assert remaining_cap(0, 2, 1.0) == 1


def test_acceptance_tracker_learns_per_source_and_request():
    t = AcceptanceTracker(prior=0.5, prior_weight=2.0, request_weight=2.0)
    assert t.survival("r", "history", [1.0, 0.5]) == [0.5, 0.25]
    for _ in range(50):
        t.observe("a", "history", [1.0] * 4, 4)  # always fully accepted
        t.observe("b", "global", [1.0] * 4, 0)  # always rejected
    assert t.source_rate("history") > 0.9 and t.source_rate("global") < 0.1
    # A request that keeps failing on a good source is trusted less than a new one.
    for _ in range(20):
        t.observe("c", "history", [1.0] * 4, 0)
    assert t.survival("c", "history", [1.0])[0] < 0.5 * t.survival("new", "history", [1.0])[0]
    t.end("c")
    assert t.request_factor("c") == 1.0


# Drafts priced at almost nothing: every chain is drafted whole.
FREE = StepCosts(fixed_ms=1e3, per_request_ms=0.0, per_token_ms=1e-6)
NO_GLOBAL = Drafting(sources=("history", "group"))


def _proposer(**kw):
    cfg = dataclasses.replace(HistoSpecConfig(), **kw)
    store = HistoryStore(cfg)
    return store, cfg


def test_goodput_rule_gives_empty_drafts_and_counts_bypassed_steps():
    store, cfg = _proposer()
    store.add_group(1, 0, [list(range(40))])
    p = DraftProposer(store, cfg, StepCosts(0.0, 0.0, 1.0), NO_GLOBAL)
    p.begin("a", 1)
    assert p.propose_step([("a", [0, 1, 2], 8)])[0].tokens == []  # every scored token costs the same: no draft pays
    st = p.stats()
    assert st["steps"] == 1 and st["steps_without_drafts"] == 1 and st["steps_without_drafts_fraction"] == 1.0
    # The same request drafts when the step has a fixed cost to amortise.
    store2, cfg2 = _proposer()
    store2.add_group(1, 0, [list(range(40))])
    q = DraftProposer(store2, cfg2, CPU_PRIOR, NO_GLOBAL)
    q.begin("a", 1)
    d = q.propose_step([("a", [0, 1, 2], 8)])[0]
    assert d.tokens == list(range(3, 3 + len(d.tokens))) and len(d.tokens) >= 2
    assert q.stats()["steps_without_drafts"] == 0


def test_predicted_length_caps_goodput_drafts():
    store, cfg = _proposer()
    store.add_group(1, 0, [list(range(40))])
    p = DraftProposer(store, cfg, CPU_PRIOR, dataclasses.replace(NO_GLOBAL, length_margin=1.0))
    p.begin("a", 1, predicted_len=6)
    assert len(p.propose_step([("a", [0, 1, 2], 8)])[0].tokens) == 2  # 3 tokens left, the last one is sampled
    assert p.stats()["capped_by_length"] == 1


def test_in_flight_siblings_and_own_output_are_draft_sources():
    # Uncapped: a's whole continuation, not as many tokens as b's match is long.
    store, cfg = _proposer()
    p = DraftProposer(store, cfg, FREE, dataclasses.replace(NO_GLOBAL, match_length_factor=0.0))
    p.begin("a", 7, group="g")
    p.begin("b", 7, group="g")
    # a is mid-flight: its emitted tokens are indexed as it goes, before it finishes.
    p.propose_step([("a", [5, 6, 7, 8, 9, 10], 4)])
    d = p.propose_step([("b", [5, 6], 4)])[0]
    assert d.tokens == [7, 8, 9, 10]
    # Its own earlier output: a repeats a phrase it wrote before.
    d = p.propose_step([("a", [5, 6, 7, 8, 9, 10, 1, 5, 6], 4)])[0]
    assert d.tokens[:2] == [7, 8]
    assert p.stats()["source/group/drafts"] == 2


def test_global_index_drafts_from_other_prompts():
    store, cfg = _proposer()
    store.add_group(1, 0, [[20, 21, 22, 23, 24, 25]])
    p = DraftProposer(store, cfg, FREE, Drafting(match_length_factor=0.0))
    p.begin("x", 999)  # an unseen prompt that phrases its answer like prompt 1
    assert p.propose_step([("x", [21, 22], 4)])[0].tokens == [23, 24, 25]
    st = p.stats()
    assert st["source/global/drafts"] == 1 and st["history_served_fraction"] == 0.0
    off = DraftProposer(store, cfg, FREE, dataclasses.replace(NO_GLOBAL, match_length_factor=0.0))
    off.begin("x", 999)
    assert off.propose_step([("x", [21, 22], 4)])[0].tokens == []


def test_prior_step_cost_ignores_timings_and_rollouts_carry_the_acceptance_at_its_weight():
    store, cfg = _proposer(step_cost="prior")
    p = DraftProposer(store, cfg)
    for _ in range(50):
        p.observe_step(8, 40, 5.0)
    assert p.cost.coef == (CPU_PRIOR.fixed_ms * 1e-3, CPU_PRIOR.per_request_ms * 1e-3,
                           CPU_PRIOR.per_token_ms * 1e-3, CPU_PRIOR.per_drafting_request_ms * 1e-3)
    rates = {}
    for carry in (0.0, 0.5, 1.0):
        q = DraftProposer(store, cfg, drafting=Drafting(acceptance_carry=carry))
        q.acceptance.observe("a", "history", [1.0] * 4, 4)
        learnt = q.acceptance.source_rate("history")
        q.start_rollout()
        rates[carry] = q.acceptance.source_rate("history")
    a, w, prior = 1.0, q.acceptance.prior_weight, q.acceptance.prior
    assert rates[0.0] == prior and rates[1.0] == learnt == pytest.approx((a + w * prior) / (1.0 + w))
    assert rates[0.5] == pytest.approx((0.5 * a + w * prior) / (0.5 + w))
    m = DraftProposer(store, dataclasses.replace(cfg, step_cost="measured"))
    for _ in range(50):
        m.observe_step(8, 40, 5.0)
    assert m.cost.coef != p.cost.coef


def test_prompt_joins_the_group_index():
    store, cfg = _proposer()
    p = DraftProposer(store, cfg, FREE, NO_GLOBAL)
    p.begin("a", 5, group="g", prompt=[40, 41, 42, 43, 44])
    assert p.propose_step([("a", [9, 41], 3)])[0].tokens == [42, 43, 44]


def test_cost_model_survives_rare_drafts_and_stretched_steps():
    """Drafts on 10% of steps, 30% of steps stretched 1-10x by other processes: the
    draft-token share of a row's cost stays near the truth (0.26), so drafting neither
    collapses nor runs away."""
    for seed in range(4):
        rng = random.Random(seed)
        m = StepCostModel(0.055, 0.0046, 0.0016)
        for _ in range(300):
            r = rng.randint(20, 32)
            d = 0 if rng.random() < 0.9 else rng.randint(1, r)
            stretch = 1.0 if rng.random() < 0.7 else rng.uniform(1, 10)
            m.observe_step(r, r + d, (0.055 + 0.0046 * r + 0.0016 * (r + d)) * stretch)
        _, per_req, per_tok, _ = m.coef
        assert 0.1 < per_tok / (per_req + per_tok) < 0.5, (seed, m.coef)


def _closed_loop(true_cost, survival_of_step, steps, seed=0):
    """Plans drafts with a fresh measured model, 'runs' each step at the true cost (+-5%
    noise) and feeds the measurement back. Returns the model, the true goodput (tokens/s)
    of the last half and the goodput no drafting would have had on the same steps."""
    rng = random.Random(seed)
    m = StepCostModel(0.055, 0.0046, 0.0016)
    fixed, per_row, per_draft = true_cost
    tokens = seconds = base_s = base_tokens = 0.0
    for i in range(steps):
        surv = survival_of_step(rng)
        plan = plan_step(surv, m)
        r, d = len(surv), plan.draft_tokens
        noise = rng.uniform(0.95, 1.05)
        t = (fixed + per_row * r + per_draft * d) * noise
        m.observe_step(r, r + d, t)
        if i >= steps // 2:
            tokens += plan.expected_tokens
            seconds += t
            base_tokens += r
            base_s += (fixed + per_row * r) * noise
    return m, tokens / seconds, base_tokens / base_s


def _step_of(p_lo, p_hi):
    # 24-32 running requests (some finish), each with an 8-token chain of its own survival.
    return lambda rng: [[rng.uniform(p_lo, p_hi)] * 8 for _ in range(rng.randint(24, 32))]


def test_measured_cost_learns_that_drafts_do_not_pay_on_a_compute_bound_step():
    # A compute-bound step where a draft token costs ~2/3 of a row: a prior that prices it at
    # a quarter of that drafts 20-60%-survival tokens there and loses; the fitted model
    # learns the cost and reaches at least no-draft goodput.
    true = (0.050, 0.0075, 0.0047)
    for seed in range(3):
        m, goodput, no_draft = _closed_loop(true, _step_of(0.2, 0.6), 400, seed=seed)
        assert m.coef[2] == pytest.approx(0.0047, rel=0.25), m.coef
        assert goodput >= 0.99 * no_draft, (goodput, no_draft)
    surv = [[0.4] * 8 for _ in range(32)]
    lengths = plan_step(surv, StepCostModel(0.055, 0.0046, 0.0016)).draft_tokens
    assert lengths > 0 and 32 * 1.4 / (0.050 + 0.0075 * 32 + 0.0047 * lengths) < 32 / (0.050 + 0.0075 * 32)


def test_measured_cost_learns_that_cheap_drafts_pay():
    # A memory-bound GPU step: draft tokens nearly free. Starting from the same prior, the
    # fit lowers their cost and drafts deeper than the prior would.
    true = (0.020, 0.0002, 0.00005)
    for seed in range(3):
        m, goodput, no_draft = _closed_loop(true, _step_of(0.2, 0.6), 400, seed=seed)
        assert m.coef[2] < 0.0005, m.coef
        assert goodput > 1.3 * no_draft, (goodput, no_draft)
    surv = [[0.4] * 8 for _ in range(32)]
    m, _, _ = _closed_loop(true, _step_of(0.2, 0.6), 400)
    assert plan_step(surv, m).draft_tokens > plan_step(surv, StepCostModel(0.055, 0.0046, 0.0016)).draft_tokens


def test_first_steps_of_each_shape_are_not_fitted_and_plans_are_optimistic_while_unsure():
    m = StepCostModel(0.055, 0.0046, 0.0016, warmup=2)
    # The first drafted steps run a path for the first time (allocation): ten times slower.
    m.observe_step(1, 5, 2.0)
    m.observe_step(1, 5, 2.0)
    for _ in range(20):
        m.observe_step(8, 8, 0.055 + 0.0062 * 8)
    assert m.coef[2] == pytest.approx(0.0016, rel=0.05)  # untouched by the slow warm-up steps
    # No drafted step fitted yet: the draft-token cost is uncertain, plans assume it lower.
    assert m.planning_coef[2] < 0.8 * m.coef[2]
    assert m.planning_coef[2] >= 0.5 * m.coef[2]
    # Many drafted steps of a consistent cost: the plan's cost converges to the fitted one.
    rng = random.Random(1)
    for _ in range(300):
        r, d = rng.randint(1, 32), rng.randint(0, 64)
        m.observe_step(r, r + d, 0.055 + 0.0062 * r + 0.003 * d)
    assert m.coef[2] == pytest.approx(0.003, rel=0.05)
    assert m.planning_coef[2] == pytest.approx(m.coef[2], rel=0.05)
    with pytest.raises(ValueError):
        StepCostModel(0.05, 0.004, 0.002, z=-1.0)


def test_drafting_row_cost_is_fitted_and_planned():
    # Each drafting row costs 3 ms besides its tokens (multi-token attention query,
    # rejection sampling): the fit finds it, and the plan then prefers few rows with long
    # drafts over many rows with one token each.
    rng = random.Random(3)
    m = StepCostModel(0.05, 0.005, 0.002)
    for _ in range(2000):
        r = rng.randint(1, 32)
        n = rng.randint(0, r)
        d = n * rng.randint(1, 6) if n else 0
        m.observe_step(r, r + d, (0.04 + 0.006 * r + 0.002 * d + 0.003 * n) * rng.uniform(0.97, 1.03), n)
    f, pr, pt, pd = m.coef
    assert pd == pytest.approx(0.003, rel=0.15) and pt == pytest.approx(0.002, rel=0.15), m.coef
    assert m.predict(10, 30, 4) == pytest.approx(0.04 + 0.006 * 10 + 0.002 * 20 + 0.003 * 4, rel=0.05)
    # 16 rows whose first token is 90% sure and the rest worthless, 1 row with a sure chain.
    surv = [[0.9, 0.0] for _ in range(16)] + [[1.0] * 8]
    cheap_rows = plan_step(surv, StepCostModel(0.04, 0.004, 0.002, 0.0))
    costly_rows = plan_step(surv, StepCostModel(0.04, 0.004, 0.002, 0.05))
    assert cheap_rows.lengths == [1] * 16 + [8]
    assert costly_rows.lengths == [0] * 16 + [8]
    # The plan is the best ratio: no single change of one row's length improves it.
    cost = StepCostModel(0.04, 0.004, 0.002, 0.004)
    surv = [[rng.uniform(0.3, 1.0) for _ in range(6)] for _ in range(12)]
    best = plan_step(surv, cost)
    f, pr, pt, pd = cost.planning_coef

    def ratio(lengths):
        e, t = float(len(surv)), f + (pr + pt) * len(surv)
        for s_, k in zip(surv, lengths):
            p = 1.0
            for q in s_[:k]:
                p *= q
                e += p
            t += (pd + pt * k) if k else 0.0
        return e / t

    assert ratio(best.lengths) == pytest.approx(best.expected_tokens / best.predicted_s)
    for r in range(len(surv)):
        for k in range(7):
            alt = list(best.lengths)
            alt[r] = k
            assert ratio(alt) <= ratio(best.lengths) + 1e-12


def test_hurdle_drops_marginal_plans_and_keeps_clear_wins():
    cost = StepCostModel(0.05, 0.004, 0.004)
    marginal = [[0.55] * 4 for _ in range(32)]  # predicted a few % better than no drafts
    clear = [[0.99] * 4]  # one tail request with a sure chain: 4x the tokens for little
    m = plan_step(marginal, cost)
    e0, t0 = 32.0, 0.05 + 0.008 * 32
    gain = (m.expected_tokens / m.predicted_s) / (e0 / t0) - 1.0
    assert m.draft_tokens > 0 and 0.0 < gain < 0.10, gain
    assert plan_step(marginal, cost, hurdle=0.10).draft_tokens == 0
    assert plan_step(marginal, cost, hurdle=gain / 2).lengths == m.lengths  # below the hurdle's reach: unchanged
    assert plan_step(clear, cost, hurdle=0.10).lengths == [4]
    # The fit's relative error is the scatter of its residuals.
    rng = random.Random(0)
    fit = StepCostModel(0.05, 0.004, 0.004)
    assert fit.relative_error == 0.0
    for _ in range(500):
        r = rng.randint(1, 32)
        fit.observe_step(r, r, (0.05 + 0.008 * r) * rng.uniform(0.8, 1.2))
    assert 0.08 < fit.relative_error < 0.15  # uniform +-20%: sd 11.5%


def test_prior_costs_clear_the_hurdle_too():
    """With the configured (prior) costs a step drafts only where its plan beats drafting
    nothing by min_goodput_gain, as with measured costs: a prior is no surer than a fit."""
    def drafts(gain_floor):
        store, cfg = _proposer(step_cost="prior", min_goodput_gain=gain_floor)
        store.add_group(1, 0, [list(range(40))])
        p = DraftProposer(store, cfg, CPU_PRIOR, NO_GLOBAL)
        items = []
        for i in range(32):
            p.begin(f"r{i}", 1)
            items.append((f"r{i}", [0, 1, 2], 8))
        return p, [len(d.tokens) for d in p.propose_step(items)]

    p, lengths = drafts(0.0)
    assert sum(lengths) > 0
    t0, per_tok, per_drow = p.cost.plan_prices(32)
    surv = p.acceptance.survival("r0", "history", [1.0] * 8)
    e = 32 + sum(expected_tokens(surv, k) - 1.0 for k in lengths)
    t = t0 + per_tok * sum(lengths) + per_drow * sum(1 for k in lengths if k)
    gain = (e / t) / (32 / t0) - 1.0
    assert 0.0 < gain < 0.5, gain
    assert sum(drafts(gain * 1.05)[1]) == 0  # the plan falls short of the floor: nobody drafts
    assert drafts(gain * 0.95)[1] == lengths  # within its reach: the same plan


def _stretched_loop(m, survival, steps, rng):
    """2 requests with history chains of the given survival (0: no history), on a host where
    60% of steps are stretched 1-10x by other processes. Returns how many steps drafted."""
    drafted = 0
    for _ in range(steps):
        plan = plan_step([[survival] * 8 if survival else []] * 2, m, hurdle=m.hurdle(0.05))
        n = sum(1 for k in plan.lengths if k)
        stretch = rng.uniform(1, 10) if rng.random() < 0.6 else 1.0
        t = (0.03 + 0.006 * 2 + 0.002 * plan.draft_tokens + 0.002 * n) * stretch * rng.uniform(0.9, 1.1)
        m.observe_step(2, 2 + plan.draft_tokens, t, n)
        drafted += plan.draft_tokens > 0
    return drafted


def test_a_busy_host_does_not_lock_measured_costs_out_of_drafting():
    """The first drafted steps measured on a busy host once priced drafting out for good: a
    stretched step inflated the draft-token cost and the fit's error became a hurdle no plan
    passed, so no later drafted step could correct either. Until ``explore`` drafted steps are
    fitted, plans draft at no more than the prior's cost ratio and without the hurdle."""
    locked = 0
    for seed in range(8):
        rng = random.Random(seed)
        no_explore = StepCostModel(0.055, 0.0046, 0.0016, explore=0)
        _stretched_loop(no_explore, 0.0, 40, rng)  # no-draft steps first: the fit learns the host's scatter
        locked += _stretched_loop(no_explore, 0.8, 60, rng) < 30
        rng = random.Random(seed)
        m = StepCostModel(0.055, 0.0046, 0.0016)
        assert m.exploring and m.hurdle(0.05) == 0.0
        _stretched_loop(m, 0.0, 40, rng)
        assert _stretched_loop(m, 0.8, 60, rng) == 60, seed
        assert not m.exploring and m.hurdle(0.05) >= 0.05
        st = m.state()
        assert st["drafted_steps_fitted"] >= m.explore and st["exploring"] is False
    assert locked > 0  # the lock-out this guards against happens on such a host


def test_plan_is_the_best_plan():
    # Brute force over every combination of draft lengths (no drafting-row cost).
    import itertools
    rng = random.Random(5)
    for _ in range(300):
        cost = StepCostModel(rng.uniform(0.01, 0.06), rng.uniform(0, 0.006), rng.uniform(5e-4, 0.006))
        f, pr, pt, _ = cost.planning_coef
        n = rng.randint(1, 3)
        surv = [[rng.uniform(0.0, 1.0) for _ in range(rng.randint(0, 4))] for _ in range(n)]

        def goodput(ks):
            e = sum(expected_tokens(sv, k) for sv, k in zip(surv, ks))
            return e / (f + (pr + pt) * n + pt * sum(ks))

        best = max(goodput(ks) for ks in itertools.product(*[range(len(sv) + 1) for sv in surv]))
        plan = plan_step(surv, cost)
        assert goodput(plan.lengths) == pytest.approx(best, rel=1e-9)


def test_draft_can_pay_is_an_upper_bound_on_the_plan():
    rng = random.Random(3)
    for _ in range(400):
        cost = StepCostModel(rng.uniform(0, 0.05), rng.uniform(0, 0.01), rng.uniform(1e-4, 0.01),
                             rng.choice([0.0, rng.uniform(0, 0.005)]))
        fixed, per_req, per_tok, per_drow = cost.planning_coef
        n = rng.randint(1, 40)
        lam0 = n / (fixed + (per_req + per_tok) * n)
        rates = [rng.uniform(0.0, 1.5) for _ in range(8)]
        f = rng.uniform(0.05, 1.5)
        qs = [[rng.uniform(0.1, 1.0) for _ in range(8)] for _ in range(n)]
        surv = [[min(1.0, f * a * q) for a, q in zip(rates, qq)] for qq in qs]
        plan = plan_step(surv, cost, hurdle=rng.choice([0.0, 0.1]))
        if not draft_can_pay([min(1.0, f * a) for a in rates], lam0, per_tok, per_drow):
            assert plan.lengths == [0] * n  # no chain of these rates can enter any plan
    # A search cost raises the bar; a sure draft at a cheap token still pays.
    assert draft_can_pay([1.0] * 4, 10.0, 0.001, 0.0)
    assert not draft_can_pay([1.0] * 4, 10.0, 0.001, 0.0, evaluation_s=0.4)
    assert not draft_can_pay([0.025] * 4, 10.0, 0.01, 0.0)  # 2.5% acceptance cannot repay 10% of a row


def _replay_drafts(trace, cfg, costs=CPU_PRIOR, drafting=DRAFTING, as_array=False):
    """Engine-order replay of a synthetic trace: every step's drafts and the proposer's stats;
    ``as_array``: each request's tokens so far as a view of an int32 array, as the engine passes them."""
    from rhymerl.histospec import prompt_key
    from rhymerl.histospec.acceptance import accepted_prefix
    from rhymerl.outputs.traces import by_epoch
    ep = by_epoch(trace)
    store = HistoryStore(cfg)
    p = DraftProposer(store, cfg, costs, drafting)
    for pid, recs in ep[0].items():
        store.add_group(prompt_key(recs[0].prompt_token_ids), 0, [r.token_ids for r in recs])
    drafts = []
    for e in sorted(ep)[1:]:
        active = []
        for pid, recs in sorted(ep[e].items()):
            for r in recs:
                rid = f"{e}:{pid}:{r.sample_idx}"
                p.begin(rid, prompt_key(r.prompt_token_ids), group=f"{e}:{pid}")
                active.append([rid, r.token_ids, 0])
        arrays = {rid: np.asarray(seq, dtype=np.int32) for rid, seq, _ in active} if as_array else {}
        while active:
            ds = p.propose_step([(rid, arrays[rid][:pos] if as_array else seq[:pos], 8) for rid, seq, pos in active])
            still = []
            for item, d in zip(active, ds):
                rid, seq, pos = item
                drafts.append(tuple(d.tokens))
                a = accepted_prefix(d.tokens, seq[pos:])
                p.feedback(rid, len(d.tokens), a)
                item[2] = min(len(seq), pos + a + 1)
                if item[2] < len(seq):
                    still.append(item)
                else:
                    p.end(rid, seq)
            active = still
        for pid, recs in ep[e].items():
            store.add_group(prompt_key(recs[0].prompt_token_ids), e, [r.token_ids for r in recs])
    return drafts, p.stats()


def test_compiled_index_reads_draft_what_the_python_reads_draft(monkeypatch):
    """The proposer reads frozen indexes (history, global) through ``_samc`` when it is
    compiled: every draft of an engine-order replay is the one its pure-Python walks give,
    from lists and from NumPy views alike."""
    from rhymerl.histospec import index
    from benchmarks.synthetic import synthetic_trace
    trace = synthetic_trace(num_prompts=5, n=4, epochs=3, similarity=0.6, mean_len=80, seed=4)
    # Sources compared unscaled: on this trace the shared index then wins drafts too, so its
    # compiled reads are checked as well as the history's.
    cfg = HistoSpecConfig()
    gpu = StepCosts(1.0, 0.2, 0.05)
    unscaled = Drafting(match_confidence_tokens=0.0, match_length_factor=0.0)
    assert index.DRAFT_READS
    compiled, st = _replay_drafts(trace, cfg, gpu, unscaled)
    # The engine passes views of its token table: the same drafts from them.
    assert _replay_drafts(trace, cfg, gpu, unscaled, as_array=True)[0] == compiled
    monkeypatch.setattr(index, "DRAFT_READS", False)
    python, st2 = _replay_drafts(trace, cfg, gpu, unscaled)
    assert compiled == python
    assert _replay_drafts(trace, cfg, gpu, unscaled, as_array=True)[0] == python
    assert st["drafts"] == st2["drafts"] > 0 and st["source/history/drafts"] > 0 and st["source/global/drafts"] > 0
    # And with the defaults' capped chains and scaled comparison.
    python_capped = _replay_drafts(trace, cfg, gpu)[0]
    monkeypatch.setattr(index, "DRAFT_READS", True)
    assert _replay_drafts(trace, cfg, gpu)[0] == python_capped != python


def test_skipped_searches_change_no_draft(monkeypatch):
    """With no search cost the skip is exact: the drafts are those of searching every request."""
    from rhymerl.histospec import proposer as proposer_mod
    from benchmarks.synthetic import synthetic_trace
    # A searched chain that is declined still teaches the acceptance model, so a skipped search
    # changes later evidence; with that learning off, only the skip's bound decides.
    monkeypatch.setattr(proposer_mod.DraftProposer, "_check_declined", lambda *a, **k: None)
    trace = synthetic_trace(num_prompts=6, n=4, epochs=3, similarity=0.3, mean_len=60, seed=1)
    # Half the prompts' later responses are their tokens shuffled: the history still matches
    # single tokens and drafts, and the drafts keep failing (a policy that moved away).
    rng = random.Random(0)
    for rec in trace:
        if rec.epoch > 0 and int(rec.prompt_id[1:]) % 2 == 0:
            rng.shuffle(rec.token_ids)
    # A GPU-like prior (a draft token ~1/4 of a row): low-acceptance requests' drafts do not pay.
    cfg = HistoSpecConfig()
    gpu = StepCosts(1.0, 0.2, 0.05, search_us=0.0)
    skipped, st = _replay_drafts(trace, cfg, gpu)
    assert st["searches_skipped"] > 0 and st["drafts"] > 0
    monkeypatch.setattr(proposer_mod, "draft_can_pay", lambda *a, **k: True)
    searched, st2 = _replay_drafts(trace, cfg, gpu)
    assert st2["searches_skipped"] == 0
    assert skipped == searched
    # A search cost skips more, never fewer.
    monkeypatch.setattr(proposer_mod, "draft_can_pay", draft_can_pay)
    _, st3 = _replay_drafts(trace, cfg, dataclasses.replace(gpu, search_us=200.0))
    assert st3["searches_skipped"] > st["searches_skipped"]


def test_measured_search_cost_recovers_from_an_overestimate():
    """With step_cost: measured the search's price is measured: a prior that skips every
    search decays until requests are searched again, and then their time sets it."""
    store, cfg = _proposer(step_cost="measured")
    store.add_group(1, 0, [list(range(400))])
    slow_search = dataclasses.replace(CPU_PRIOR, search_us=1e7)
    history_only = Drafting(sources=("history",))
    p = DraftProposer(store, cfg, slow_search, history_only)
    p.begin("a", 1)
    assert p.propose_step([("a", [0, 1, 2], 8)])[0].tokens == []  # a 10 s search never pays
    assert p.stats()["searches_skipped"] == 1
    drafted = 0
    for n in range(3, 300):
        drafted += len(p.propose_step([("a", list(range(n)), 8)])[0].tokens)
    st = p.stats()
    assert st["searches"] > 0 and drafted > 0
    assert st["search_us_per_request"] < 1e6  # measured searches, not the prior, price it now
    # The prior mode keeps the configured price: deterministic drafts for exact replays.
    q = DraftProposer(store, dataclasses.replace(cfg, step_cost="prior"), slow_search, history_only)
    q.begin("a", 1)
    for n in range(3, 60):
        assert q.propose_step([("a", list(range(n)), 8)])[0].tokens == []
    assert q.stats()["search_us_per_request"] == pytest.approx(1e7) and q.stats()["searches"] == 0


def test_source_rates_extend_a_prefix_to_the_depth_asked_for():
    """Rates are computed only as deep as a caller asks (the cache is dropped after every
    verified draft); at every depth they equal the whole table's recurrence."""
    rng = random.Random(5)
    t = AcceptanceTracker(prior=0.4, prior_weight=3.0)

    def full(src):
        table, prev, out = t._src.get(src, []), t.prior, []
        for i in range(max(len(table), 64)):
            acc, mass = table[i] if i < len(table) else (0.0, 0.0)
            prev = (acc + t.prior_weight * prev) / (mass + t.prior_weight)
            out.append(prev)
        return out

    for step in range(300):
        src = rng.choice(["history", "group"])
        probs = [rng.random() for _ in range(rng.randint(1, 40))]
        t.observe(f"r{step % 7}", src, probs, rng.randint(0, len(probs)))
        for n in sorted(rng.sample(range(1, 64), 3)):
            got = t.source_rates(src, n)
            assert len(got) >= n and got[:n] == full(src)[:n]
    t.observe("r0", "group", [0.9] * 30, 3)
    assert len(t.source_rates("group", 2)) == 2 < len(t._src["group"])  # not the whole table


def test_bound_is_the_most_any_chain_can_expect():
    rng = random.Random(9)
    t = AcceptanceTracker(prior=0.6)
    for step in range(200):
        probs = [rng.random() for _ in range(rng.randint(1, 20))]
        t.observe(f"r{step % 3}", "history", probs, rng.randint(0, len(probs)))
        for req in ("r0", "r1", "unseen"):
            for n in (0, 1, 5, 17):
                bound = t.bound(req, "history", n)
                assert bound == pytest.approx(sum(np.cumprod(t.rate_bounds(req, "history", n))), abs=1e-12)
                for _ in range(5):
                    chain = [rng.choice([1.0, rng.random()]) for _ in range(n)]
                    assert t.expected_accepted(req, "history", chain)[0] <= bound + 1e-12
    # Before any evidence m = 1: q = 1 is where x m(x) peaks, so a certain chain reaches the bound.
    fresh = AcceptanceTracker(prior=0.6)
    assert fresh.bound("r", "history", 6) == pytest.approx(fresh.expected_accepted("r", "history", [1.0] * 6)[0])


def test_acceptance_bends_where_the_history_splits():
    """Acceptance is not proportional to q: where the history splits 70/30 the likelier token
    is accepted 90% of the time. m(q) learns the bend, and unanimous chains keep their rate."""
    rng = random.Random(4)
    t = AcceptanceTracker(prior=0.9)
    for step in range(3000):
        q = rng.choice([1.0, 0.7])
        t.observe(f"r{step % 50}", "history", [q], int(rng.random() < 0.9))
    lo, hi = t.survival("new", "history", [0.7])[0], t.survival("new", "history", [1.0])[0]
    assert lo == pytest.approx(0.9, abs=0.05) and hi == pytest.approx(0.9, abs=0.05)
    flat = AcceptanceTracker(prior=0.9)
    assert flat.survival("new", "history", [0.7])[0] == pytest.approx(0.63)  # q x a before any evidence


def test_acceptance_vs_forecast_compares_outcomes_with_the_models_own_forecasts():
    t = AcceptanceTracker(prior=0.5, prior_weight=4.0, request_weight=4.0)
    assert t.accepted_over_forecast() == 0.0 and t.state()["acceptance_vs_forecast"] == 0.0
    forecast = accepted = 0.0
    for i in range(30):
        req, q, acc = f"r{i % 5}", [1.0, 0.5, 1.0], (0, 1, 3)[i % 3]
        forecast += sum(t.survival(req, "history", q)[:min(3, acc + 1)])  # positions reached
        accepted += acc
        t.observe(req, "history", q, acc)
    assert t.accepted_over_forecast() == pytest.approx(accepted / forecast)
    assert t.state()["acceptance_vs_forecast"] == pytest.approx(accepted / forecast, abs=1e-4)


def test_acceptance_carry_scales_the_evidence_and_its_state_round_trips():
    t = AcceptanceTracker(prior=0.5, prior_weight=4.0)
    t.observe("a", "history", [0.8, 0.6, 0.5], 2)
    t.observe("b", "group", [1.0, 1.0], 0)
    state = t.state_dict()
    assert state["sources"] == {"history": [[1.0, 0.8], [1.0, 0.6], [0.0, 0.5]], "group": [[0.0, 1.0]]}
    assert sum(a for a, _ in state["q"]["history"]) == 2.0 and len(state["q"]["group"]) == AcceptanceTracker.Q_BUCKETS
    restored = AcceptanceTracker(prior=0.5, prior_weight=4.0)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.source_rates("history", 3) == t.source_rates("history", 3)
    assert restored.survival("x", "history", [0.8, 0.6]) == t.survival("x", "history", [0.8, 0.6])
    # A checkpoint written before m(q) existed loads with m = 1.
    old = AcceptanceTracker(prior=0.5, prior_weight=4.0)
    old.load_state_dict({"sources": state["sources"]})
    assert old.q_multipliers("history") == [1.0] * AcceptanceTracker.Q_BUCKETS
    # One written when m was kept per tenth of q (10 rows) loads with m = 1 too: its rows meant other buckets.
    by_q = AcceptanceTracker(prior=0.5, prior_weight=4.0)
    by_q.load_state_dict({"sources": state["sources"], "q": {"history": [[5.0, 1.0]] * 10}})
    assert by_q.q_multipliers("history") == [1.0] * AcceptanceTracker.Q_BUCKETS
    q_before = [list(row) for row in state["q"]["history"]]
    t.carry(0.5)
    assert t.state_dict()["sources"] == {"history": [[0.5, 0.4], [0.5, 0.3], [0.0, 0.25]], "group": [[0.0, 0.5]]}
    assert t.state_dict()["q"]["history"] == [[a / 2, p / 2] for a, p in q_before]
    assert t.request_factor("a") == 1.0 and t.accepted_over_forecast() == 0.0
    t.carry(0.0)
    assert t.state_dict()["sources"] == {} and t.source_rate("history") == 0.5
    assert t.q_multipliers("history") == [1.0] * AcceptanceTracker.Q_BUCKETS
    with pytest.raises(ValueError, match="carry weight"):
        t.carry(1.5)


def test_a_declined_chain_is_checked_against_the_tokens_written_after_it():
    """Matched positions count as accepted, the first mismatch as rejected, positions not yet
    written not at all; the forecast metric keeps to drafted chains."""
    store, cfg = _proposer()
    store.add_group(1, 0, [list(range(100))])
    p = DraftProposer(store, cfg, CPU_PRIOR, Drafting(sources=("history",), acceptance_prior=0.7))
    for rid, written, accepted, tried in (("a", [10, 11, 12, 13], 4, 4),  # all written tokens match: 4 known
                                          ("b", [10, 11, 99, 13, 14], 2, 3),  # third differs: 2 accepted of 3
                                          ("c", [], 0, 0)):  # nothing written yet: nothing learnt
        p.begin(rid, 1)
        p._reqs[rid].declined = (10, list(range(10, 18)), [1.0] * 8, "history")
        before = p.acceptance.state_dict()["q"].get("history", [[0.0, 0.0]])
        p.propose_step([(rid, list(range(10)) + written, 0)])
        rows = p.acceptance.state_dict()["q"].get("history", [[0.0, 0.0]])
        assert sum(a for a, _ in rows) - sum(a for a, _ in before) == accepted
        # Each position tried adds its prediction x = f_req a q = 1 x 0.7 x 1 (a new request, the prior).
        assert sum(x for _, x in rows) - sum(x for _, x in before) == pytest.approx(0.7 * tried)
        assert p.acceptance.accepted_over_forecast() == 0.0  # declined chains are no forecast
        assert (p._reqs[rid].declined is None) == bool(written)
    assert p.acceptance.state_dict()["sources"] == {}  # per-depth rates keep to drafted chains


def test_declined_chains_let_the_first_epoch_draft_what_pays():
    """With no history the rule starts from a prior; chains it declines are checked against
    what the requests go on to write, so where it underrates a source it learns so. On the
    shipped trace's first epoch that drafts more and finishes sooner on the modelled clock."""
    from rhymerl.histospec import proposer as proposer_mod
    from benchmarks.histospec import HistoSpecMethod, StepTime, simulate
    from rhymerl.outputs.traces import by_epoch, read_trace
    epochs = by_epoch(read_trace("benchmarks/traces/smollm2-basic-arithmetic-steps-grpo.jsonl"))
    costs = dataclasses.replace(CPU_PRIOR, per_drafting_request_ms=0.0)
    clock = StepTime(costs.fixed_ms * 1e-3, costs.per_request_ms * 1e-3, costs.per_token_ms * 1e-3)

    def first_epoch():
        return simulate(HistoSpecMethod(HistoSpecConfig(), "first", costs), epochs, 16, cold=True, step_time=clock)

    learning = first_epoch()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(proposer_mod.DraftProposer, "_check_declined", lambda *a, **k: None)
        drafted_only = first_epoch()
    assert learning["tokens_per_forward"] > drafted_only["tokens_per_forward"]
    assert learning["modelled_step_time_s"] < drafted_only["modelled_step_time_s"]


def test_predictions_are_calibrated_where_requests_run_lucky():
    """Every position is accepted 90% of the time whatever the request. A request's lucky run
    lifts its factor, and f x a x q passes 1: corrected per bucket of that prediction itself
    (up to x = 2), the top buckets come within 3 points (3.4 when corrected per tenth of q)."""
    from rhymerl.histospec.draft_calibration import Calibration, table
    rng = random.Random(5)
    t = AcceptanceTracker(prior=0.9)
    cal = Calibration()
    for r in range(400):
        req = f"r{r}"
        for _ in range(12):
            surv = t.survival(req, "history", [1.0] * 4)
            accepted = next((i for i in range(4) if rng.random() >= 0.9), 4)
            if r >= 200:  # scored once the corrections have had their evidence
                cal.observe(surv, accepted)
            t.observe(req, "history", [1.0] * 4, accepted)
        t.end(req)
    rows = [row for row in table(cal.counts()) if row["tokens"] >= 500]
    assert rows and max(abs(row["gap"]) for row in rows) < 0.03, rows
