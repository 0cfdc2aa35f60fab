import random

import pytest

from rhymerl.histospec import draft_calibration as calibration
from rhymerl.histospec.draft_calibration import Calibration

pytestmark = pytest.mark.cpu


def test_positions_are_bucketed_by_prediction_and_only_reached_ones_count():
    c = Calibration()
    c.observe([0.95, 0.85, 0.55, 0.3], 2)  # two accepted, the third rejected, the fourth never reached
    c.observe([0.95], 1)
    c.observe([0.05, 0.99], 0)
    got = {r["bucket"]: r for r in calibration.table(c.counts())}
    assert set(got) == {"0.0-0.1", "0.5-0.6", "0.8-0.9", "0.9-1.0"}
    assert got["0.9-1.0"]["tokens"] == 2 and got["0.9-1.0"]["realised"] == 1.0
    assert got["0.9-1.0"]["predicted"] == pytest.approx(0.95)
    assert got["0.5-0.6"] == {"bucket": "0.5-0.6", "tokens": 1, "predicted": 0.55, "realised": 0.0, "gap": -0.55,
                              "standard_error": 0.0}
    assert got["0.0-0.1"]["realised"] == 0.0 and got["0.0-0.1"]["tokens"] == 1
    c.reset()
    assert calibration.table(c.counts()) == [] and calibration.worst_gap(c.counts()) == 0.0


def test_counts_add_up_over_engines_and_a_calibrated_model_has_small_gaps():
    rng = random.Random(0)
    engines = [Calibration() for _ in range(3)]
    for c in engines:
        for _ in range(3000):
            surv = [rng.random() for _ in range(4)]
            acc = 0
            while acc < len(surv) and rng.random() < surv[acc]:  # accepted as predicted
                acc += 1
            c.observe(surv, acc)
    summed: dict = {}
    for c in engines:
        for k, v in c.counts().items():
            summed[k] = summed.get(k, 0) + v
    rows = calibration.table(summed)
    assert len(rows) == calibration.BUCKETS and sum(r["tokens"] for r in rows) > 3 * 3000
    assert calibration.worst_gap(summed) < 0.03
    # A model that predicts twice what happens is caught.
    off = Calibration()
    for _ in range(3000):
        p = rng.uniform(0.6, 1.0)
        off.observe([p], int(rng.random() < p / 2))
    assert calibration.worst_gap(off.counts()) > 0.2


def test_chance_over_is_what_sampling_alone_puts_past_the_target():
    # 100 positions at 0.5: a standard error of 0.05, so a calibrated rule is 5 points off 31.7% of the time.
    half = {"calibration/0.5/tokens": 100, "calibration/0.5/predicted": 50.0, "calibration/0.5/accepted": 50}
    assert calibration.chance_over(half, min_tokens=100) == pytest.approx(0.3173, abs=1e-4)
    assert calibration.chance_over(half) == 0.0  # under MIN_TOKENS: not read
    assert calibration.count_over(half, min_tokens=100) == 0
    off = dict(half, **{"calibration/0.5/accepted": 56})
    assert calibration.count_over(off, min_tokens=100) == 1 and calibration.count_over(off) == 0
    # Summed over buckets, and matching how often simulated calibrated buckets do cross the line.
    rng = random.Random(1)
    crossed, expected = 0, 0.0
    for _ in range(200):
        c = Calibration()
        for _ in range(300):
            p = rng.choice([0.65, 0.85])
            c.observe([p], int(rng.random() < p))
        counts = c.counts()
        expected += calibration.chance_over(counts, min_tokens=100)
        crossed += calibration.count_over(counts, min_tokens=100)
    assert expected == pytest.approx(crossed, rel=0.25) and crossed > 0
