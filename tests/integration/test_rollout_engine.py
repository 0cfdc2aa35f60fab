"""Rollout engine on real vLLM (CPU): HistoSpec is lossless, weights update in place, bad history is harmless.

One `none` and one `histospec` engine serve the whole module. The model is the tiny
Llama with head size 32 (vLLM's CPU attention has no 16) and its lm_head scaled x8,
so that sampling at temperature 1 is peaked enough for history drafts to be accepted
(a random model's near-uniform distribution accepts almost nothing and would make
the distribution test vacuous).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import shutil

import pytest

from rhymerl.histospec.proposer import Drafting, DraftProposer
from rhymerl.histospec.step_costs import CPU_PRIOR, StepCosts

pytestmark = [pytest.mark.cpu, pytest.mark.integration, pytest.mark.slow]

PROMPTS = [[5, 17, 33, 40, 99, 100], [7, 8, 9, 10, 11], [200, 201, 3, 4, 5, 6, 7], [42, 43, 44]]
SHARPEN = 8.0
KV_BYTES = 256 << 20


def _write_scaled(src, dst, scale, perturb=0.0, seed=0):
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    sd["lm_head.weight"] = sd["lm_head.weight"] * scale
    if perturb:
        g = torch.Generator().manual_seed(seed)
        sd = {k: v + perturb * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.dtype.is_floating_point else v
              for k, v in sd.items()}
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return sd


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rhymerl.config import ModelConfig
    from rhymerl.models.tiny import TinyShape
    from rhymerl.models import resolve_model

    base = resolve_model(ModelConfig(path="builtin:tiny"), TinyShape(num_attention_heads=2, num_key_value_heads=1))
    out = tmp_path_factory.mktemp("sharp")
    _write_scaled(base, out, SHARPEN)
    return out


def _engine(model_dir, method, history=None):
    from rhymerl.config import HistoSpecConfig, RolloutConfig
    from rhymerl.rollout import RolloutEngine

    cfg = RolloutConfig(speculative=method, max_num_seqs=64, max_model_len=256, num_speculative_tokens=8)
    return RolloutEngine(cfg, HistoSpecConfig(), model_dir, seed=0, history=history, cpu_kv_cache_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def none_engine(model_dir):
    e = _engine(model_dir, "none")
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def hs_engine(model_dir):
    e = _engine(model_dir, "histospec")
    yield e
    e.shutdown()


def _greedy(n_tokens=32):
    from rhymerl.rollout import SamplingSpec

    return SamplingSpec(temperature=0.0, max_tokens=n_tokens)


def test_greedy_histospec_equals_no_speculation(none_engine, hs_engine):
    from rhymerl.histospec import HistoryStore
    from rhymerl.config import HistoSpecConfig

    hs_engine.set_history(HistoryStore(HistoSpecConfig(), vocab_size=hs_engine.vocab_size))
    want = [r.token_ids for r in none_engine.generate(PROMPTS, 2, _greedy())]
    ref_lp = none_engine.generate(PROMPTS[:1], 1, _greedy())[0].responses[0].logprobs
    # Epoch 0: no history. Epoch 1: every prompt has the epoch-0 responses as history.
    first = hs_engine.generate(PROMPTS, 2, _greedy(), epoch=0)
    assert [r.token_ids for r in first] == want
    second = hs_engine.generate(PROMPTS, 2, _greedy(), epoch=1)
    m = hs_engine.metrics()
    assert [r.token_ids for r in second] == want
    assert m["draft_accepted"] > 0.5 * m["generated_tokens"], m
    assert m["tokens_per_forward"] > 2.0, m
    # The goodput rule reports its bypassed steps and sources; with the default step_cost=prior
    # it prices steps from the prior model and times none.
    assert m["step_cost/observed_steps"] == 0 and 0.0 <= m["steps_without_drafts_fraction"] < 1.0, m
    assert m["history_served_fraction"] == 1.0 and m["source/history/drafts"] > 0, m
    # How the plan's acceptance forecasts compare with the outcomes (replays draft near-certain tokens).
    assert m["acceptance_vs_forecast"] > 0.5, m
    # Greedy replays of their own history draft well: every request's chain is searched; the
    # prior step cost prices a search at the CPU prior's cost.
    assert m["searches"] > 0 and m["searches_skipped_fraction"] == 0.0, m
    assert m["search_us_per_request"] == pytest.approx(CPU_PRIOR.search_us), m
    # Accepted drafts still report the policy's log-probabilities.
    lp = second[0].responses[0].logprobs
    assert len(lp) == len(want[0][0])
    assert max(abs(a - b) for a, b in zip(lp, ref_lp)) < 1e-3
    assert all(r.finish_reason in ("length", "stop") for res in second for r in res.responses)


def test_measured_step_costs_fit_the_engine_and_still_draft(none_engine, hs_engine):
    """step_cost=measured: the engine's timed decode steps feed the fit, and with a history
    that predicts every token the fitted costs still let it draft (the cold first drafted
    steps, which once locked drafting out, are not fitted)."""
    from rhymerl.histospec import HistoryStore
    from rhymerl.config import HistoSpecConfig

    want = [r.token_ids for r in none_engine.generate(PROMPTS, 2, _greedy())]
    saved = hs_engine.histospec_cfg
    hs_engine.histospec_cfg = dataclasses.replace(saved, step_cost="measured")
    try:
        hs_engine.set_history(HistoryStore(HistoSpecConfig(), vocab_size=hs_engine.vocab_size))
        assert [r.token_ids for r in hs_engine.generate(PROMPTS, 2, _greedy(), epoch=0)] == want
        assert [r.token_ids for r in hs_engine.generate(PROMPTS, 2, _greedy(), epoch=1)] == want
        m = hs_engine.metrics()
    finally:
        hs_engine.histospec_cfg = saved
        hs_engine.set_history(HistoryStore(HistoSpecConfig(), vocab_size=hs_engine.vocab_size))
    assert m["step_cost/observed_steps"] > 0 and m["step_cost/per_token_ms"] > 0, m
    assert m["step_cost/drafted_steps_fitted"] > 0 and m["step_cost/exploring"] in (0, 1), m
    assert m["draft_accepted"] > 0.5 * m["generated_tokens"], m


def _chi2_sf(x: float, dof: int) -> float:
    """Survival function of the chi-square distribution (regularised upper incomplete gamma)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    if z < a + 1:  # series for the lower gamma
        term = total = 1.0 / a
        k = a
        while abs(term) > 1e-12 * abs(total):
            k += 1
            term *= z / k
            total += term
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - math.lgamma(a)))
    # continued fraction for the upper gamma (Lentz)
    b, c, d = z + 1 - a, 1e300, 1.0 / (z + 1 - a)
    h = d
    for i in range(1, 500):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1) < 1e-12:
            break
    return math.exp(-z + a * math.log(z) - math.lgamma(a)) * h


def _two_sample_p(xs: list[int], ys: list[int], min_count: int = 10) -> float:
    cx, cy = collections.Counter(xs), collections.Counter(ys)
    cats = [t for t in set(cx) | set(cy) if cx[t] + cy[t] >= min_count]
    rows = [(cx[t], cy[t]) for t in cats]
    rest = (len(xs) - sum(r[0] for r in rows), len(ys) - sum(r[1] for r in rows))
    if sum(rest) > 0:
        rows.append(rest)
    nx, ny = len(xs), len(ys)
    stat = 0.0
    for a, b in rows:
        tot = a + b
        ea, eb = tot * nx / (nx + ny), tot * ny / (nx + ny)
        stat += (a - ea) ** 2 / ea + (b - eb) ** 2 / eb
    return _chi2_sf(stat, len(rows) - 1)


def test_chi2_helper_is_calibrated():
    # Known quantiles: chi2(1) at 3.841 -> 0.05; chi2(10) at 23.209 -> 0.01.
    assert abs(_chi2_sf(3.841, 1) - 0.05) < 1e-3
    assert abs(_chi2_sf(23.209, 10) - 0.01) < 1e-3
    assert _two_sample_p([1] * 100 + [2] * 100, [1] * 190 + [2] * 10) < 1e-6


N_SAMPLES = 400
MID = 8


def test_temperature_one_distribution_matches(none_engine, hs_engine):
    """First-token and mid-sequence token frequencies at T=1: HistoSpec vs no speculation."""
    from rhymerl.config import HistoSpecConfig
    from rhymerl.histospec import HistoryStore
    from rhymerl.rollout import SamplingSpec
    from rhymerl.rollout import vllm_patches

    assert "cpu_rejection_expand" in vllm_patches.applied()
    sp = SamplingSpec(temperature=1.0, max_tokens=MID + 4, ignore_eos=True)
    prompt = PROMPTS[:1]
    base = none_engine.generate(prompt, N_SAMPLES, sp)[0].token_ids
    # Drafts priced at nothing, so every chain is drafted whole: the cost-aware rule rightly
    # drafts little for 400 concurrent requests of a random-weights model, and this test
    # needs many drafts verified.
    saved = hs_engine.step_costs
    hs_engine.step_costs = StepCosts(fixed_ms=1e3, per_request_ms=0.0, per_token_ms=1e-6)
    try:
        hs_engine.set_history(HistoryStore(HistoSpecConfig(), vocab_size=hs_engine.vocab_size))
        hs_engine.generate(prompt, N_SAMPLES // 2, sp, epoch=0)  # fills the history with sampled responses
        spec = hs_engine.generate(prompt, N_SAMPLES, sp, epoch=1)[0].token_ids
        m = hs_engine.metrics()
    finally:
        hs_engine.step_costs = saved
        hs_engine.set_history(HistoryStore(HistoSpecConfig(), vocab_size=hs_engine.vocab_size))
    # The test means something only if drafts were verified at and before MID.
    assert m["draft_proposed"] > N_SAMPLES and m["draft_accepted"] > 0.3 * m["draft_proposed"], m
    assert all(len(t) == MID + 4 for t in spec)
    p_first = _two_sample_p([t[0] for t in base], [t[0] for t in spec])
    p_mid = _two_sample_p([t[MID] for t in base], [t[MID] for t in spec])
    p_pair = _two_sample_p([tuple(t[MID - 1:MID + 1]) for t in base], [tuple(t[MID - 1:MID + 1]) for t in spec], min_count=8)
    assert p_first > 1e-3 and p_mid > 1e-3 and p_pair > 1e-3, (p_first, p_mid, p_pair)


def test_empty_unknown_and_foreign_history_give_zero_drafts(hs_engine, caplog):
    from rhymerl.config import HistoSpecConfig
    from rhymerl.histospec import HistoryStore, prompt_key

    caplog.set_level(logging.WARNING, logger="rhymerl.rollout.engine")
    cfg = HistoSpecConfig()
    other = HistoryStore(cfg, vocab_size=hs_engine.vocab_size)
    other.add_group(prompt_key([1, 2, 3]), 0, [[5, 6, 7, 8, 9, 10, 11, 12] * 3])  # knows another prompt only
    foreign = HistoryStore(cfg, vocab_size=50_000)  # written with another tokenizer (the model's is 384)
    foreign.add_group(prompt_key(PROMPTS[1]), 0, [[40_000, 41_000, 5, 6] * 4])
    cases = [(HistoryStore(cfg, vocab_size=hs_engine.vocab_size), "history store is empty"),
             (other, "have no history yet"), (foreign, "differs from the model")]
    for store, needle in cases:
        caplog.clear()
        hs_engine.set_history(store)
        # The first call's responses enter the store, so the second call takes a new prompt.
        for prompt in (PROMPTS[1], PROMPTS[2]):
            res = hs_engine.generate([prompt], 1, _greedy(16), epoch=1)
            m = hs_engine.metrics()
            # No history drafts (a request may still draft from its own output so far).
            assert m.get("source/history/drafts", 0) == 0, needle
            if store is foreign:
                assert m["draft_proposed"] == 0  # another tokenizer's store: HistoSpec is off
            assert len(res[0].responses[0].token_ids) == 16
        msgs = [r.getMessage() for r in caplog.records if r.name == "rhymerl.rollout.engine"]
        assert sum(needle in s for s in msgs) == 1, (needle, msgs)
    assert foreign.lengths(prompt_key(PROMPTS[1])) == [[16]]  # nothing was added to the foreign store


def test_steps_without_drafts_skip_the_rejection_sampler(none_engine, model_dir):
    """Speculation on, nobody drafting: every step samples as without speculation (no zero-draft tax)."""
    from rhymerl.config import HistoSpecConfig, RolloutConfig
    from rhymerl.rollout import RolloutEngine
    from rhymerl.rollout.engine import _runner_of

    # History is the only draft source here (no own-output/sibling or shared-index drafts), so
    # epoch 0 has nothing to draft from and epoch 1 drafts from epoch 0.
    # Prior step costs: whether epoch 1 drafts must not hang on this machine's timings.
    hs_cfg = HistoSpecConfig(step_cost="prior")
    cfg = RolloutConfig(speculative="histospec", max_num_seqs=64, max_model_len=256, num_speculative_tokens=8)
    hs_engine = RolloutEngine(cfg, hs_cfg, model_dir, seed=0, cpu_kv_cache_bytes=KV_BYTES)
    hs_engine._DraftProposer = functools.partial(DraftProposer, drafting=Drafting(sources=("history",)))
    hs_engine.set_history(hs_engine.history)
    runner = hs_engine.llm.collective_rpc(_runner_of)[0]
    calls = collections.Counter()
    for name in ("sampler", "rejection_sampler"):
        module = getattr(runner, name)
        forward = module.forward

        def counted(*a, _name=name, _forward=forward, **k):
            calls[_name] += 1
            return _forward(*a, **k)

        module.forward = counted
    try:
        got = hs_engine.generate(PROMPTS, 1, _greedy(12), epoch=0)
        assert hs_engine.metrics()["draft_proposed"] == 0
        assert calls["rejection_sampler"] == 0 and calls["sampler"] >= 12, calls
        assert [r.token_ids for r in got] == [r.token_ids for r in none_engine.generate(PROMPTS, 1, _greedy(12))]
        hs_engine.generate(PROMPTS, 1, _greedy(12), epoch=1)  # history now drafts: rejection sampling
        assert hs_engine.metrics()["draft_proposed"] > 0 and calls["rejection_sampler"] > 0, calls
    finally:
        for name in ("sampler", "rejection_sampler"):
            del getattr(runner, name).forward
        hs_engine.shutdown()


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_baselines_equal_no_speculation(model_dir, none_engine, method):
    import importlib.util

    from rhymerl.rollout import RolloutError

    if method == "suffix" and importlib.util.find_spec("arctic_inference") is None:
        with pytest.raises(RolloutError, match="arctic-inference"):
            _engine(model_dir, "suffix")
        return
    want = [r.token_ids for r in none_engine.generate(PROMPTS, 2, _greedy())]
    e = _engine(model_dir, method)
    try:
        e.generate(PROMPTS, 2, _greedy(), epoch=0)
        got = [r.token_ids for r in e.generate(PROMPTS, 2, _greedy(), epoch=1)]
        m = e.metrics()
    finally:
        e.shutdown()
    assert got == want
    assert m["drafter_calls"] > 0, m
    if method == "suffix":  # its cache holds the epoch-0 responses, so it drafts on epoch 1
        assert m["draft_accepted"] > 0, m


def _kv_bytes(engine) -> int:
    from rhymerl.rollout.engine import _kv_cache_tensors, _runner_of

    return sum(engine.llm.collective_rpc(
        lambda w: sum(t.untyped_storage().nbytes() for t in _kv_cache_tensors(_runner_of(w)))))


def _param_bytes(engine) -> int:
    from rhymerl.rollout.engine import _runner_of

    def count(w):
        seen = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in _runner_of(w).model.parameters() if p.is_floating_point()}
        return sum(seen.values())
    return sum(engine.llm.collective_rpc(count))


def test_engine_decodes_with_the_process_threads(model_dir):
    """vLLM serves with one intra-op thread (its scheduler has a core of its own elsewhere);
    the in-process engine keeps the threads the process had when it was built (training's)."""
    import torch

    from rhymerl.distributed.devices import set_cpu_threads

    before = torch.get_num_threads()
    set_cpu_threads(2)
    e = None
    try:
        e = _engine(model_dir, "none")
        assert e.cpu_threads == 2 and torch.get_num_threads() == 2
        e.generate(PROMPTS[:1], 1, _greedy(4))
        assert e.metrics()["cpu_threads"] == 2
    finally:
        if e is not None:
            e.shutdown()
        set_cpu_threads(before)


def test_sleep_frees_the_kv_cache_on_cpu_and_wake_restores_it(model_dir, none_engine):
    from safetensors.torch import load_file

    before = [r.token_ids for r in none_engine.generate(PROMPTS, 2, _greedy(12))]
    kv = _kv_bytes(none_engine)
    assert kv > 0
    # Level 1 keeps the weights: wake and generate.
    assert none_engine.sleep(1) == kv
    assert _kv_bytes(none_engine) == 0
    assert none_engine.sleep(1) == 0  # already released
    assert none_engine.wake_up(["weights"]) == 0
    assert none_engine.wake_up(["kv_cache"]) == kv
    assert _kv_bytes(none_engine) == kv
    assert [r.token_ids for r in none_engine.generate(PROMPTS, 2, _greedy(12))] == before
    # Level 2 discards the packed weights and frees the parameters' memory too: generating
    # before a reload is refused by name, a reload that misses a tensor is refused, and a full
    # reload (what the trainer does after every update) brings them back.
    params = _param_bytes(none_engine)
    assert params > 0
    assert none_engine.sleep(2) == kv + params
    assert _param_bytes(none_engine) == 0
    none_engine.wake_up(None)
    with pytest.raises(RuntimeError, match="weights were discarded"):
        none_engine.generate(PROMPTS, 1, _greedy(4))
    none_engine.sleep(2)
    none_engine.wake_up(["weights"])
    weights = load_file(str(model_dir / "model.safetensors"))
    with pytest.raises(RuntimeError, match="parameter\\(s\\) unfilled"):
        none_engine.load_weights((k, v) for k, v in weights.items() if k != "model.norm.weight")
    none_engine.load_weights(weights.items())
    assert _param_bytes(none_engine) == params
    none_engine.wake_up(["kv_cache"])
    assert [r.token_ids for r in none_engine.generate(PROMPTS, 2, _greedy(12))] == before


def test_load_weights_equals_fresh_engine(model_dir, none_engine, tmp_path):
    """Perturbed weights loaded in place == an engine built from the perturbed checkpoint."""
    import torch
    from safetensors.torch import load_file

    before = [r.token_ids for r in none_engine.generate(PROMPTS, 1, _greedy())]
    pert_dir = tmp_path / "perturbed"
    perturbed = _write_scaled(model_dir, pert_dir, 1.0, perturb=0.05, seed=1)
    secs = none_engine.load_weights(perturbed.items())
    after = [r.token_ids for r in none_engine.generate(PROMPTS, 1, _greedy())]
    fresh = _engine(pert_dir, "none")
    try:
        want = [r.token_ids for r in fresh.generate(PROMPTS, 1, _greedy())]
    finally:
        fresh.shutdown()
    assert after == want
    assert after != before  # the perturbation changed the greedy outputs
    original = load_file(str(model_dir / "model.safetensors"))
    none_engine.load_weights((k, v.clone()) for k, v in original.items())
    assert [r.token_ids for r in none_engine.generate(PROMPTS, 1, _greedy())] == before
    assert secs < 5.0
    assert torch.is_tensor(next(iter(perturbed.values())))


def test_learnt_acceptance_carries_once_per_weight_update_not_per_batch(model_dir, hs_engine):
    """HistoSpec's learnt acceptance decays into a new rollout when the weights change, not at
    every batch those weights generate (DAPO's refill rounds are batches of one update)."""
    from safetensors.torch import load_file

    from rhymerl.config import HistoSpecConfig
    from rhymerl.histospec import HistoryStore

    # An earlier test may have left a foreign store (no proposer): start from a usable one.
    hs_engine.set_history(HistoryStore(HistoSpecConfig(), vocab_size=hs_engine.vocab_size))
    core = hs_engine._core
    carries = []
    real = core.carry_acceptance
    core.carry_acceptance = lambda weight=None: carries.append(weight) or real(weight)
    try:
        for _ in range(2):
            hs_engine.generate(PROMPTS[:2], 2, _greedy(8), record_history=False)
        assert carries == []
        hs_engine.load_weights(load_file(str(model_dir / "model.safetensors")).items())
        assert carries == [None]
        hs_engine.generate(PROMPTS[:2], 2, _greedy(8), record_history=False)
        assert carries == [None]
    finally:
        core.carry_acceptance = real
