"""Lossless acceptance: emitted tokens are distributed exactly as plain sampling.

The "target model" is an explicit table of logits indexed by (position, previous
token); chi-square tests compare the joint distribution of the first two emitted
tokens under speculative verification with the exact product distribution.
"""

import math

import numpy as np
import pytest

from rhymerl.histospec.acceptance import _sample, accepted_prefix, target_probs, verify_chain

pytestmark = pytest.mark.cpu

V = 6
K = 2
LOGITS = np.random.default_rng(123).normal(0.0, 1.5, size=(8, V + 1, V))


_CACHE: dict = {}


def p_next(prefix, temperature, top_p):
    key = (len(prefix), prefix[-1] if prefix else V, temperature, top_p)
    if key not in _CACHE:
        _CACHE[key] = target_probs(LOGITS[key[0], key[1]], temperature, top_p)
    return _CACHE[key]


def exact_joint(temperature, top_p):
    p0 = p_next([], temperature, top_p)
    return {(a, b): p0[a] * p_next([a], temperature, top_p)[b] for a in range(V) for b in range(V)}


def chain_drafter(prefix):
    # Deterministic drafts that are sometimes likely and sometimes unlikely tokens.
    s = sum(prefix) + 7 * len(prefix)
    return [(s + 3 * i) % V for i in range(3)]


def spec_sample_chain(rng, temperature, top_p, verify=verify_chain):
    gen = []
    while len(gen) < K:
        draft = chain_drafter(gen)
        rows = np.stack([p_next(gen + draft[:i], temperature, top_p) for i in range(len(draft) + 1)])
        _, out = verify(draft, rows, rng, greedy=temperature == 0)
        gen += out
    return tuple(gen[:K])


def chi2_consistent(samples, exact, alpha_z=3.09):
    """Chi-square goodness of fit at alpha ~1e-3 (Wilson-Hilferty critical value)."""
    n = len(samples)
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    if any(exact.get(s, 0.0) == 0.0 for s in counts):
        return False  # a token the target can never emit
    big = [c for c, p in exact.items() if p * n >= 5]
    small_p = sum(p for c, p in exact.items() if p * n < 5)
    stat = sum((counts.get(c, 0) - exact[c] * n) ** 2 / (exact[c] * n) for c in big)
    df = len(big) - 1
    if small_p * n >= 5:
        obs = n - sum(counts.get(c, 0) for c in big)
        stat += (obs - small_p * n) ** 2 / (small_p * n)
        df += 1
    crit = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit


N = 3000
SETTINGS = [(0.5, 1.0), (1.0, 1.0), (1.5, 1.0), (1.0, 0.8)]


@pytest.mark.parametrize("temperature,top_p", SETTINGS)
def test_chain_emits_target_distribution(temperature, top_p):
    rng = np.random.default_rng(1)
    samples = [spec_sample_chain(rng, temperature, top_p) for _ in range(N)]
    assert chi2_consistent(samples, exact_joint(temperature, top_p))


def wrong_verify_chain(draft, probs, rng, greedy=False):
    """Deliberately wrong: on rejection resample from p *without* removing the draft token."""
    out = []
    for i, x in enumerate(draft):
        if rng.random() < probs[i][x]:
            out.append(x)
            continue
        return i, out + [_sample(probs[i], rng)]
    return len(draft), out + [_sample(probs[len(draft)], rng)]


def test_wrong_chain_rule_is_caught():
    rng = np.random.default_rng(3)
    samples = [spec_sample_chain(rng, 1.0, 1.0, verify=wrong_verify_chain) for _ in range(N)]
    assert not chi2_consistent(samples, exact_joint(1.0, 1.0))


def test_greedy_chain_emits_argmax_sequence():
    rng = np.random.default_rng(0)
    expect = []
    for _ in range(K):
        expect.append(int(np.argmax(LOGITS[len(expect), expect[-1] if expect else V])))
    assert spec_sample_chain(rng, 0.0, 1.0) == tuple(expect)


def test_chain_accepts_draft_of_certain_target():
    rows = np.zeros((4, V))
    for i, t in enumerate([2, 3, 4, 5]):
        rows[i, t] = 1.0
    n, out = verify_chain([2, 3, 4], rows, np.random.default_rng(0))
    assert n == 3 and out == [2, 3, 4, 5]
    n, out = verify_chain([2, 1, 4], rows, np.random.default_rng(0))
    assert n == 1 and out == [2, 3]


def test_target_probs_top_p_top_k():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = target_probs(logits, 1.0, top_p=0.7)
    assert np.allclose(p, [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    p = target_probs(logits, 1.0, top_k=1)
    assert np.allclose(p, [1, 0, 0, 0])
    assert np.allclose(target_probs(logits, 0.0), [1, 0, 0, 0])
    assert np.isclose(target_probs(logits, 2.0).sum(), 1.0)


def test_replay_helpers():
    assert accepted_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert accepted_prefix([], [1]) == 0
