"""Property tests of the simulator engine and of HistoPipe against the baselines."""

import numpy as np
import pytest

from rhymerl.config import HistoPipeConfig
from rhymerl.histopipe import DecodeCostModel
from rhymerl.histopipe.engine import Runtime, simulate
from rhymerl.histopipe.simulator import predictions, run_scheduler, trained_predictor
from rhymerl.histopipe.workload import synthetic

pytestmark = pytest.mark.cpu

COST = DecodeCostModel.for_instance(tp=4, max_batch=16)


def _check_once(res, R):
    done = np.isfinite(res.finish_s)
    assert int((~done).sum()) == res.deferred
    assert sorted(res.deferred_ids) == sorted(np.flatnonzero(~done).tolist())
    assert (res.placed_on[done] >= 0).all()
    assert res.starts == R + res.migrated  # a migrated request is admitted twice, finished once


@pytest.mark.parametrize("runtime", [Runtime(), Runtime(steal=True), Runtime(steal=True, migrate=True),
                                     Runtime(steal=True, migrate=True, allow_defer=True, straggler_threshold=1.0)])
def test_every_request_runs_exactly_once(runtime):
    rng = np.random.default_rng(0)
    for trial in range(8):
        N = int(rng.integers(1, 12))
        w = synthetic(int(rng.integers(1, 40)), n=int(rng.integers(1, 9)), corr=0.5, max_tokens=2048, seed=trial)
        R = w.num_requests
        perm = rng.permutation(R)
        queues = [perm[i::N].tolist() for i in range(N)]
        pred = rng.uniform(10, 500, R)  # deliberately bad predictions: many stragglers
        res = simulate(COST, N, w.lengths, w.prompt_lens(), w.group_of(), queues=queues, predicted=pred, runtime=runtime)
        _check_once(res, R)
        if not runtime.allow_defer:
            assert res.deferred == 0 and np.isfinite(res.finish_s).all()
        assert res.makespan_s > 0 and 0 <= res.bubble_fraction < 1


def test_lost_or_duplicated_requests_are_refused():
    w = synthetic(3, n=2, seed=1)
    args = (COST, 2, w.lengths, w.prompt_lens(), w.group_of())
    with pytest.raises(ValueError, match="dispatched 2 times"):
        simulate(*args, queues=[[0, 1, 2], [2, 3, 4, 5]])
    with pytest.raises(ValueError, match="dispatched 0 times"):
        simulate(*args, queues=[[0, 1, 2], [3, 4]])
    with pytest.raises(ValueError, match="exactly one"):
        simulate(*args)


def test_single_request_time_matches_closed_form():
    cm = DecodeCostModel(a=0.01, b=0.001, c=1e-6, p=1e-4, max_batch=4, kv_capacity=10**6)
    res = simulate(cm, 1, [100], [50], [0], queues=[[0]])
    want = 50 * 1e-4 + sum(0.01 + 0.001 + 1e-6 * (50 + k) for k in range(100))
    assert res.makespan_s == pytest.approx(want, rel=1e-9)
    # Two requests in one batch share the step; the longer one ends the step.
    res2 = simulate(cm, 1, [100, 40], [50, 50], [0, 1], queues=[[0, 1]])
    assert res2.finish_s[1] < res2.finish_s[0]
    # KV capacity gates admission: with room for one sequence they run back to back.
    tight = DecodeCostModel(a=0.01, b=0.001, c=1e-6, p=1e-4, max_batch=4, kv_capacity=90)
    res3 = simulate(tight, 1, [100, 40], [50, 50], [0, 1], queues=[[0, 1]])
    assert res3.finish_s[1] > res3.finish_s[0]


@pytest.mark.parametrize("N,seed", [(16, 0), (16, 1), (64, 2)])
def test_perfect_predictions_within_5pct_of_oracle(N, seed):
    # No within-group noise: the per-group prediction is then every response's true length.
    w = synthetic(16 * N, n=16, sigma_sample=0.0, seed=seed)
    cfg = HistoPipeConfig()
    cost = DecodeCostModel.for_instance(tp=4, max_batch=64)
    hp = run_scheduler("histopipe", w, N, cost, cfg, pred=w.true_group_mean())
    oracle = run_scheduler("oracle", w, N, cost, cfg)
    assert hp.makespan_s <= 1.05 * oracle.makespan_s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_zero_correlation_never_worse_than_least_loaded(seed):
    w = synthetic(16 * 32, n=16, corr=0.0, seed=seed)
    cfg = HistoPipeConfig()
    cost = DecodeCostModel.for_instance(tp=4, max_batch=64)
    hp = run_scheduler("histopipe", w, 32, cost, cfg)
    ll = run_scheduler("least_loaded", w, 32, cost, cfg)
    assert hp.makespan_s <= 1.02 * ll.makespan_s


def test_rhyming_history_beats_random_dispatch():
    w = synthetic(16 * 32, n=16, corr=0.9, seed=4)
    cfg = HistoPipeConfig()
    cost = DecodeCostModel.for_instance(tp=4, max_batch=64)
    pred = predictions(w, trained_predictor(w, cfg))
    hp = run_scheduler("histopipe", w, 32, cost, cfg, pred=pred)
    rnd = run_scheduler("random", w, 32, cost, cfg)
    ll = run_scheduler("least_loaded", w, 32, cost, cfg)
    assert hp.bubble_fraction <= 0.5 * rnd.bubble_fraction
    assert hp.makespan_s < ll.makespan_s < rnd.makespan_s
    assert hp.deferred == 0  # allow_defer is off by default


def test_deferral_only_when_allowed_and_counted():
    w = synthetic(16 * 8, n=16, corr=0.9, seed=5)
    cost = DecodeCostModel.for_instance(tp=4, max_batch=64)
    off = run_scheduler("histopipe", w, 8, cost, HistoPipeConfig())
    on = run_scheduler("histopipe", w, 8, cost, HistoPipeConfig(allow_defer=True))
    assert off.deferred == 0
    assert on.deferred > 0 and on.makespan_s < off.makespan_s
    assert on.deferred < 0.1 * w.num_requests
