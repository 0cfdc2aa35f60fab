import math
import pickle

import numpy as np
import pytest

from rhymerl.algorithms.advantages import (
    DynamicSamplingBuffer,
    compute_advantages,
    filter_groups,
    group_advantages,
    overlong_penalty,
    shape_overlong,
)

pytestmark = pytest.mark.cpu


def test_grpo_advantages_hand_computed():
    # Group a: rewards 1,0,0,1 -> mean .5, unbiased std sqrt(1/3).
    # Group b: 2,0 -> mean 1, std sqrt(2).
    rewards = [1.0, 0.0, 2.0, 0.0, 0.0, 1.0]
    ids = ["a", "a", "b", "a", "b", "a"]
    adv = group_advantages(rewards, ids, eps=0.0)
    sa = math.sqrt(1 / 3)
    sb = math.sqrt(2)
    expected = [0.5 / sa, -0.5 / sa, 1 / sb, -0.5 / sa, -1 / sb, 0.5 / sa]
    np.testing.assert_allclose(adv, expected, rtol=1e-12)


def test_grpo_eps_and_centre_only():
    adv = group_advantages(np.array([[1.0, 0.0]]), eps=0.5)
    s = math.sqrt(0.5)
    np.testing.assert_allclose(adv, [[0.5 / (s + 0.5), -0.5 / (s + 0.5)]])
    cen = group_advantages(np.array([[3.0, 1.0, 2.0], [5.0, 5.0, 8.0]]), scale_by_std=False)
    np.testing.assert_allclose(cen, [[1.0, -1.0, 0.0], [-1.0, -1.0, 2.0]])


def test_grpo_constant_and_singleton_groups_are_zero():
    adv = group_advantages([1.0, 1.0, 1.0, 7.0], [0, 0, 0, 1])
    np.testing.assert_array_equal(adv, [0.0, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages([1.0, 2.0])


def test_overlong_penalty_linear_ramp():
    pen = overlong_penalty([10, 12, 14, 16, 20], max_tokens=16, buffer=4, penalty=0.5)
    np.testing.assert_allclose(pen, [0.0, 0.0, -0.25, -0.5, -0.5])
    np.testing.assert_array_equal(overlong_penalty([16], 16, 0), [0.0])
    np.testing.assert_allclose(shape_overlong([1.0, 1.0], [13, 15], 16, 4), [0.75, 0.25])
    with pytest.raises(ValueError, match="smaller than max_tokens"):
        overlong_penalty([1], 4, 4)


def test_filter_groups_reports_dropped():
    rewards = [1, 1, 0, 1, 0, 0, 1, 1]
    ids = ["p0", "p0", "p1", "p1", "p2", "p2", "p3", "p3"]
    f = filter_groups(rewards, ids)
    assert f.kept_groups == ["p1"]
    assert f.dropped_groups == ["p0", "p2", "p3"]
    assert f.dropped_by_reward == {1.0: 2, 0.0: 1}
    np.testing.assert_array_equal(f.keep_mask, [0, 0, 1, 1, 0, 0, 0, 0])
    assert filter_groups([0.5, 0.5000001], [0, 0], tol=1e-3).num_dropped == 1


def test_dynamic_sampling_buffer_refills_and_checkpoints():
    buf = DynamicSamplingBuffer(target_groups=3, max_rounds=4)
    buf.begin_step()
    f = buf.add(["g0", "g1", "g2"], [[1, 1], [0, 1], [0, 0]])
    assert f.dropped_groups == [0, 2] and len(buf) == 1 and not buf.ready
    state = pickle.loads(pickle.dumps(buf.state_dict()))

    buf.add(["g3", "g4"], [[1, 0], [1, 1]])
    buf.add(["g5", "g6"], [[0, 1], [1, 0]])
    assert buf.ready
    assert buf.take() == ["g1", "g3", "g5"]  # overflow g6 is dropped: it would be off-policy next step
    assert len(buf) == 0 and buf.last_step["rounds"] == 3.0
    assert buf.last_step["drop_fraction"] == pytest.approx(3 / 7)

    resumed = DynamicSamplingBuffer(target_groups=3, max_rounds=4)
    resumed.load_state_dict(state)
    assert len(resumed) == 1 and resumed.rounds == 1
    resumed.add(["h0", "h1"], [[1, 0], [0, 1]])
    assert resumed.take() == ["g1", "h0", "h1"]

    with pytest.raises(ValueError, match="target_groups"):
        DynamicSamplingBuffer(target_groups=5, max_rounds=4).load_state_dict(state)


def test_dynamic_sampling_buffer_gives_up_after_max_rounds():
    buf = DynamicSamplingBuffer(target_groups=4, max_rounds=2, keep_overflow=True)
    buf.begin_step()
    buf.add(["a", "b"], [[1, 1], [1, 0]])
    assert not buf.ready
    buf.add(["c"], [[0, 0]])
    assert buf.ready
    assert buf.take() == ["b"]
    assert buf.totals["short_steps"] == 1 and buf.totals["dropped_groups"] == 2


def test_compute_advantages_applies_configured_shaping():
    from rhymerl.config import AlgorithmConfig

    cfg = AlgorithmConfig(name="dapo", overlong_buffer=4, overlong_penalty=1.0, scale_by_std=False)
    adv, shaped = compute_advantages([1.0, 1.0, 0.0, 0.0], [0, 0, 1, 1], [8, 15, 4, 16], cfg, max_tokens=16)
    np.testing.assert_allclose(shaped, [1.0, 0.25, 0.0, -1.0])
    np.testing.assert_allclose(adv, [0.375, -0.375, 0.5, -0.5])
    buf = DynamicSamplingBuffer.from_config(AlgorithmConfig(max_refill_rounds=2), target_groups=8)
    assert buf.max_rounds == 3 and buf.target_groups == 8
