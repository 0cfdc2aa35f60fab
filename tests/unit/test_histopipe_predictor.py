import math

import numpy as np
import pytest

from rhymerl.config import HistoPipeConfig
from rhymerl.histopipe import LengthPredictor
from benchmarks.simulate.simulator import predictions, predictor_error, trained_predictor
from benchmarks.simulate.workload import synthetic

pytestmark = pytest.mark.cpu


def test_unseen_prompt_gets_prior_which_learns_online():
    pr = LengthPredictor(HistoPipeConfig(), max_tokens=8192)
    first = pr.predict(1, None)
    assert first == pr.predict(2, [])
    for k in range(200):
        pr.observe(100 + k, [300, 310, 290, 305])
    assert abs(pr.predict(3, None) - 300) < 0.15 * 300
    assert first > 1000  # before evidence the prior is a quarter of the budget


def test_newer_epochs_weigh_more():
    pr = LengthPredictor(HistoPipeConfig(decay=0.5), max_tokens=8192)
    old_short = pr.predict(1, [[100] * 4, [1000] * 4])
    old_long = pr.predict(2, [[1000] * 4, [100] * 4])
    assert old_short > 2 * old_long
    flat = LengthPredictor(HistoPipeConfig(decay=1.0), max_tokens=8192)
    assert flat.predict(1, [[100] * 4, [1000] * 4]) == pytest.approx(flat.predict(2, [[1000] * 4, [100] * 4]))


def test_predictions_are_clipped_to_budget():
    pr = LengthPredictor(HistoPipeConfig(), max_tokens=512)
    assert pr.predict(1, [[512] * 8]) <= 512
    assert pr.predict(2, [[1] * 8]) >= 1


def test_learns_how_much_history_rhymes():
    cfg = HistoPipeConfig()
    good = synthetic(600, n=8, epochs=4, corr=0.95, seed=1)
    pr = trained_predictor(good, cfg)
    err = predictor_error(good, predictions(good, pr))
    assert pr.beta > 0.7
    assert err["spearman"] > 0.85
    # Relative error well below what the prior alone gives.
    prior_only = LengthPredictor(cfg, good.max_tokens)
    for hist, actual in good.warmup:
        for key, lens in actual.items():
            prior_only.observe(key, lens)
    flat = {g.index: prior_only.predict(g.key, None) for g in good.groups}
    assert err["mean_abs_rel_error"] < 0.6 * predictor_error(good, flat)["mean_abs_rel_error"]
    noise = synthetic(600, n=8, epochs=4, corr=0.0, seed=1)
    assert trained_predictor(noise, cfg).beta == 0.0


def test_error_report_counts_groups_with_history():
    w = synthetic(50, n=4, epochs=3, seed=3)
    pr = trained_predictor(w, HistoPipeConfig())
    rep = pr.error_report()
    assert rep["groups"] == 50  # epoch 1 predicted from epoch 0, then observed
    assert 0 < rep["mean_abs_rel_error"] < 1


def test_state_dict_round_trip():
    w = synthetic(100, n=4, epochs=3, seed=5)
    pr = trained_predictor(w, HistoPipeConfig())
    d = pr.state_dict()
    other = LengthPredictor(HistoPipeConfig(), w.max_tokens)
    other.load_state_dict(d)
    for g in w.groups[:20]:
        assert other.predict(g.key, w.history[g.key]) == pr.predict(g.key, w.history[g.key])
    assert other.predict(-1, None) == pr.predict(-1, None)
    with pytest.raises(ValueError, match="missing"):
        other.load_state_dict({"prior_log": 1.0})


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="decay"):
        LengthPredictor(HistoPipeConfig(decay=0.0), 100)
    with pytest.raises(ValueError, match="max_tokens"):
        LengthPredictor(HistoPipeConfig(), 0)
    pr = LengthPredictor(HistoPipeConfig(), 4096)
    assert pr.predict_quantile(1, [[100, 200, 400]], 0.9) > pr.predict_quantile(1, [[100, 200, 400]], 0.5)
    assert math.isfinite(pr.predict(1, [[100, 200, 400]]))
    with pytest.raises(ValueError):
        pr.predict_quantile(1, None, 1.0)
