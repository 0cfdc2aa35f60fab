"""Property tests of the scheduler state machine, its simulator driver, and HistoPipe
against the baselines."""

import math

import numpy as np
import pytest

from rhymerl.config import HistoPipeConfig
from rhymerl.histopipe import DecodeCostModel
from benchmarks.simulate.event_loop import simulate
from rhymerl.histopipe.scheduler import (HistoPipePolicy, Move, Policy, PriorityPolicy, Scheduler, StaticPolicy,
                                         censored_shift)
from benchmarks.simulate.simulator import run_scheduler, trained_predictor
from benchmarks.simulate.workload import reorder, synthetic

pytestmark = pytest.mark.cpu

COST = DecodeCostModel.for_instance(tp=4, max_batch=16)


def _policies(w, R, N, rng):
    perm = rng.permutation(R)
    pred = rng.uniform(2.0, 7.0, len(w.groups))  # deliberately bad estimates: many stragglers
    yield StaticPolicy([perm[i::N].tolist() for i in range(N)])
    yield Policy()
    yield PriorityPolicy(rng.uniform(0, 1, R))
    yield HistoPipePolicy(pred, 0.3, 0.2, COST, straggler_z=0.5)


def test_every_request_runs_exactly_once():
    rng = np.random.default_rng(0)
    for trial in range(6):
        N = int(rng.integers(1, 10))
        w = synthetic(int(rng.integers(1, 30)), n=int(rng.integers(1, 9)), corr=0.5, max_tokens=2048, seed=trial)
        R = w.num_requests
        for pol in _policies(w, R, N, rng):
            res = simulate(COST, N, w.lengths, w.prompt_lens(), w.group_of(), pol)
            assert np.isfinite(res.finish_s).all() and (res.placed_on >= 0).all()
            k = pol.s.counters
            # Every admission is a first start, a migration, or a resumption after preemption.
            assert res.starts == R + res.migrated + k.preempted
            assert res.makespan_s > 0 and 0 <= res.bubble_fraction < 1
            assert all(s == 2 for s in pol.s.state)


def test_lost_or_duplicated_requests_are_refused():
    w = synthetic(3, n=2, seed=1)
    args = (COST, 2, w.lengths, w.prompt_lens(), w.group_of())
    with pytest.raises(ValueError, match="dispatched 2 times"):
        simulate(*args, StaticPolicy([[0, 1, 2], [2, 3, 4, 5]]))
    with pytest.raises(ValueError, match="dispatched 0 times"):
        simulate(*args, StaticPolicy([[0, 1, 2], [3, 4]]))


def test_state_machine_refuses_impossible_events():
    s = Scheduler(2, 4, [0, 0, 1], [10, 10, 10], Policy())
    r = s.next_for(0)
    s.started(r, 0)
    with pytest.raises(ValueError, match="started twice"):
        s.started(r, 1)
    with pytest.raises(ValueError, match="not running"):
        s.finished(s.next_for(1), 5)
    with pytest.raises(ValueError, match="not running on instance 1"):
        s.migrated(Move(r, 1, 0), 3)
    s.preempted(r, 3)  # back in the queue, first in line again (dataset order)
    assert s.next_for(1) == r and s.generated[r] == 3


def test_single_request_time_matches_closed_form():
    cm = DecodeCostModel(a=0.01, b=0.001, c=1e-6, p=1e-4, max_batch=4, kv_capacity=10**6)
    res = simulate(cm, 1, [100], [50], [0], StaticPolicy([[0]]))
    want = 50 * 1e-4 + sum(0.01 + 0.001 + 1e-6 * (50 + k) for k in range(100))
    assert res.makespan_s == pytest.approx(want, rel=1e-9)
    res2 = simulate(cm, 1, [100, 40], [50, 50], [0, 1], StaticPolicy([[0, 1]]))
    assert res2.finish_s[1] < res2.finish_s[0]
    tight = DecodeCostModel(a=0.01, b=0.001, c=1e-6, p=1e-4, max_batch=4, kv_capacity=90)
    res3 = simulate(tight, 1, [100, 40], [50, 50], [0, 1], StaticPolicy([[0, 1]]))
    assert res3.finish_s[1] > res3.finish_s[0]
    # Speculation: 4 tokens per step -> 25 steps, each with 3 verified draft tokens at 0.002 s.
    res4 = simulate(cm, 1, [100], [50], [0], StaticPolicy([[0]]), tokens_per_step=[4.0], verify_cost=0.002,
                    draft_tokens=[3.0])
    want4 = 50 * 1e-4 + sum(0.01 + 0.001 + 0.006 + 1e-6 * (50 + 4 * k) for k in range(25))
    assert res4.makespan_s == pytest.approx(want4, rel=1e-9)
    # Drafting costs the proposer's CPU time per speculating request in every step.
    res5 = simulate(cm, 1, [100], [50], [0], StaticPolicy([[0]]), tokens_per_step=[4.0], verify_cost=0.002,
                    draft_tokens=[3.0], proposer_s=0.0005)
    assert res5.makespan_s == pytest.approx(want4 + 25 * 0.0005, rel=1e-9)


def test_probe_runs_first_and_siblings_inherit_its_length():
    # Two groups; history says group 0 is long, but group 1's probe comes back long.
    pol = HistoPipePolicy([math.log(1000), math.log(10)], hist_var=1.0, within_var=0.05, cost=COST,
                          migrate=False)
    s = Scheduler(1, 1, [0, 0, 0, 1, 1, 1], [5] * 6, pol)
    first = s.next_for(0)
    assert first in (0, 3)  # a probe
    s.started(first, 0)
    s.finished(first, 1000 if first == 0 else 10)
    other = s.next_for(0)
    assert other in (0, 3) and other != first  # the other group's probe is next
    s.started(other, 0)
    s.finished(other, 100000 if other == 3 else 1000)
    assert s.next_for(0) in (4, 5)  # group 1 proved longer: its siblings go first


def test_censored_shift_is_the_truncated_posterior_mean():
    # Monte Carlo of mu ~ N(m, var), y = mu + N(0, w), kept where y > x.
    rng = np.random.default_rng(0)
    m, var, w = 3.0, 0.4, 0.2
    mu = m + math.sqrt(var) * rng.standard_normal(2_000_000)
    y = mu + math.sqrt(w) * rng.standard_normal(mu.size)
    for x in (2.0, 3.0, 4.0, 5.0):
        want = mu[y > x].mean() - m
        assert censored_shift(m, var, w, x) == pytest.approx(want, abs=0.01)
    shifts = [censored_shift(m, var, w, x) for x in np.linspace(-5, 60, 200)]
    assert all(b > a for a, b in zip(shifts, shifts[1:]))  # longer runs, longer groups
    assert shifts[0] < 1e-6 and all(math.isfinite(v) for v in shifts)  # far below: no evidence


def test_running_probe_promotes_its_group_before_it_finishes():
    # History: group 0 ~1000 tokens, group 1 ~800 (and history is often wrong). Group 0's probe
    # comes back at 1000; group 1's is still running at 1200 tokens, short of its straggler
    # threshold (~1250): that it has run so long already puts its siblings first.
    def run(report: bool) -> int:
        pol = HistoPipePolicy([math.log(1000), math.log(800)], hist_var=1.0, within_var=0.05, cost=COST,
                              migrate=False)
        s = Scheduler(1, 2, [0, 0, 0, 1, 1, 1], [5] * 6, pol)
        for _ in range(2):
            s.started(s.next_for(0), 0)
        assert sorted(s.running[0]) == [0, 3]  # the probes
        if report:
            s.progress(3, 1200)
        s.finished(0, 1000)
        return s.next_for(0)

    assert run(report=False) in (1, 2)
    assert run(report=True) in (4, 5)


def test_a_probe_reported_every_token_counts_as_one_reported_at_its_rungs():
    # The live driver reports every round, the simulator when the policy asks: same policy.
    def run(every_token: bool):
        pol = HistoPipePolicy([math.log(300), math.log(200)], hist_var=0.5, within_var=0.2, cost=COST,
                              migrate=False)
        s = Scheduler(1, 2, [0, 0, 0, 1, 1, 1], [5] * 6, pol)
        for _ in range(2):
            s.started(s.next_for(0), 0)
        rungs = []
        if every_token:
            for n in range(1, 5001):
                s.progress(3, n)
        else:
            while (w := s.watch_tokens(3)) is not None and w <= 5000:
                rungs.append(w)
                s.progress(3, w)
        return pol.est_log, len(s._heap), rungs

    est_a, heap_a, _ = run(True)
    est_b, heap_b, rungs = run(False)
    assert est_a == est_b and heap_a == heap_b
    assert 5 <= len(rungs) <= 40 and heap_a <= 6 + 3 * len(rungs)  # re-sorts per rung, not per token
    assert est_a[1] > math.log(2000)  # a probe still running at 5000 tokens: a long group


def test_a_probe_moved_past_its_next_rung_reports_at_its_next_token():
    pol = HistoPipePolicy([math.log(300), math.log(200)], hist_var=0.5, within_var=0.2, cost=COST,
                          migrate=False)
    s = Scheduler(2, 2, [0, 0, 1, 1], [5] * 4, pol)
    s.started(0, 0)
    rung = s.watch_tokens(0)
    s.progress(0, rung)
    nxt = s.watch_tokens(0)
    assert nxt > rung
    s.migrated(Move(0, 0, 1), nxt + 40)  # carried past its next rung, as a move reports it
    assert s.watch_tokens(0) == nxt + 41


def test_simulator_reports_progress_at_every_token_count_the_policy_asks_for():
    class Every10(Policy):
        def bind(self, sched):
            super().bind(sched)
            self.seen = []

        def watch_tokens(self, rid):
            return self.s.generated[rid] + 10

        def on_progress(self, rid, generated):
            self.seen.append((rid, generated))

    pol = Every10()
    simulate(COST, 1, [35, 12], [5, 5], [0, 1], pol)
    assert sorted(pol.seen) == [(0, 10), (0, 20), (0, 30), (1, 10)]


def test_queue_empty_a_pair_of_stragglers_splits_onto_the_idle_instance():
    # Two long runners share instance 0 while instances 1 and 2 have run dry: one of them
    # moves (two batches of one), not both (that would leave instance 0 idle for nothing).
    pol = HistoPipePolicy([math.log(10), math.log(10)], hist_var=0.01, within_var=0.01, cost=COST)
    s = Scheduler(3, 4, [0, 1], [5, 5], pol)
    for r in (0, 1):
        s.started(r, 0)
    assert s.queue_empty() and not s.running[1] and not s.running[2]
    for r in (0, 1):
        s.progress(r, 5000)
    moves = s.moves()
    assert len(moves) == 1 and moves[0].src == 0 and moves[0].dst in (1, 2)
    s.migrated(moves[0], 5000)
    assert s.moves() == []  # each runs alone now


def test_perfect_group_knowledge_beats_least_loaded():
    w = synthetic(16 * 16, n=16, sigma_sample=0.0, seed=0)
    cfg = HistoPipeConfig()
    cost = DecodeCostModel.for_instance(tp=4, max_batch=64)
    gm = w.true_group_mean()
    pol = HistoPipePolicy([math.log(gm[g.index]) for g in w.groups], 1e-4, 1e-4, cost, max_tokens=w.max_tokens)
    hp = simulate(cost, 16, w.lengths, w.prompt_lens(), w.group_of(), pol)
    oracle = run_scheduler("oracle", w, 16, cost, cfg)
    assert hp.makespan_s <= 1.05 * oracle.makespan_s


@pytest.mark.parametrize("N", [15, 16])
def test_rhyming_history_beats_least_loaded_and_random(N):
    w = synthetic(16 * N, n=16, corr=0.9, seed=4)
    cfg = HistoPipeConfig()
    cost = DecodeCostModel.for_instance(tp=4, max_batch=64)
    for shuffled in (False, True):
        if shuffled:
            w = reorder(w, np.random.default_rng(1).permutation(len(w.groups)).tolist())
        pr = trained_predictor(w, cfg)
        hp = run_scheduler("histopipe", w, N, cost, cfg, pr=pr)
        rnd = run_scheduler("random", w, N, cost, cfg)
        ll = run_scheduler("least_loaded", w, N, cost, cfg)
        assert hp.bubble_fraction <= 0.5 * rnd.bubble_fraction
        assert hp.makespan_s < ll.makespan_s < rnd.makespan_s


def test_zero_correlation_not_much_worse_than_least_loaded():
    w = synthetic(16 * 16, n=16, corr=0.0, seed=0)
    cfg = HistoPipeConfig()
    cost = DecodeCostModel.for_instance(tp=4, max_batch=64)
    hp = run_scheduler("histopipe", w, 16, cost, cfg)
    ll = run_scheduler("least_loaded", w, 16, cost, cfg)
    assert hp.makespan_s <= 1.05 * ll.makespan_s
