import json

import numpy as np
import pytest

from benchmarks import histospec as bench
from benchmarks.baselines import NgramDrafter, SuffixDecodingDrafter, suffix_speculate
from rhymerl.histospec.index import SuffixAutomaton
from benchmarks.synthetic import synthetic_trace
from rhymerl.outputs.traces import by_epoch, read_trace, write_trace

pytestmark = pytest.mark.cpu


def vllm_ngram_reference(ctx, min_n, max_n, k):
    """Brute force of vLLM's rule: longest n, earliest earlier occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if len(ctx) <= n:
            continue
        pat = ctx[-n:]
        for i in range(len(ctx) - n):
            if ctx[i:i + n] == pat:
                return ctx[i + n:i + n + k]
    return []


def test_ngram_matches_vllm_rule():
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 3, size=60).tolist()
    d = NgramDrafter(2, 4, k=5)
    d.begin(ctx[:10])
    for end in range(10, 60):
        got = d.propose([] if end == 10 else [ctx[end - 1]], 5)
        assert got == vllm_ngram_reference(ctx[:end], 2, 4, 5)


def test_suffix_speculate_budget_follows_match_length():
    sam = SuffixAutomaton()
    sam.add(list(range(100)))
    toks, score, L = suffix_speculate(sam, [97, 3, 4, 5], k=16, factor=1.0, offset=0.0, min_prob=0.1, max_depth=24)
    assert (toks, L) == ([6, 7, 8], 3) and score == 3.0  # max_spec_factor * match_len tokens
    d = SuffixDecodingDrafter(k=16)
    d.add_response([1, 2, 3, 4, 5, 6, 7, 8])
    d.begin("r", [50, 51])
    assert d.propose("r", [1, 2, 3], 16) == [4, 5, 6]
    d.end("r", [9, 9])
    assert d.global_index.num_seqs == 2


def test_synthetic_similarity_is_controllable():
    def copied(sim):
        ep = by_epoch(synthetic_trace(num_prompts=4, n=4, epochs=2, similarity=sim, mean_len=120, seed=1))
        hits = tot = 0
        for pid, recs in ep[1].items():
            grams = {tuple(r.token_ids[i:i + 4]) for r in ep[0][pid] for i in range(len(r.token_ids) - 3)}
            for r in recs:
                t = r.token_ids
                hits += sum(tuple(t[i:i + 4]) in grams for i in range(len(t) - 3))
                tot += len(t) - 3
        return hits / tot
    lo, hi = copied(0.5), copied(0.95)
    assert lo < hi and hi > 0.8


def test_bench_json_contract_and_ordering(capsys, tmp_path):
    rc = bench.main(["--json", "--prompts", "6", "--n", "4", "--mean-len", "96", "--ablations", "none",
                     "--no-forward-timing"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    m = out["methods"]
    assert set(m) == {"none", "ngram", "suffix", "histospec_chain"}
    for v in m.values():
        for key in ("tokens_per_forward", "mean_accepted_len", "draft_us_per_token"):
            assert isinstance(v[key], (int, float))
    assert m["none"]["tokens_per_forward"] == 1.0
    assert m["histospec_chain"]["tokens_per_forward"] > 1.5
    assert m["histospec_chain"]["tokens_per_forward"] > m["ngram"]["tokens_per_forward"] >= 1.0
    # The first epoch alone (no history at all) is reported apart, against the same methods.
    first = out["first_epoch"]
    assert set(first) == {"none", "ngram", "suffix", "histospec_chain"} and first["none"]["modelled_wall_speedup"] == 1.0
    assert first["histospec_chain"]["tokens_per_forward"] > 1.0  # siblings and the rollout's responses draft
    # Predicted against realised acceptance of the verified positions, per tenth of the prediction.
    cal = out["calibration"]
    assert cal["buckets"] and sum(r["tokens"] for r in cal["buckets"]) > 0
    assert all(abs(r["gap"] - (r["realised"] - r["predicted"])) < 1e-3 for r in cal["buckets"])
    assert 0.0 <= cal["worst_gap"] <= 1.0 and cal["min_tokens"] > 0
    read = [r for r in cal["buckets"] if r["tokens"] >= cal["min_tokens"]]
    assert cal["over_target"] == sum(abs(r["gap"]) > cal["target_gap"] for r in read)
    assert 0.0 <= cal["over_target_by_chance"] <= len(read)


def test_quick_ablations_scale_the_rule_against_the_same_clock(capsys):
    rc = bench.main(["--json", "--prompts", "3", "--n", "2", "--mean-len", "40", "--no-forward-timing"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["ablations"]["rule_scaling"]
    assert {"draft_price_x0.5", "draft_price_x1", "draft_price_x2", "acceptance_prior_0.5"} <= set(rows)
    rs = out["rule_scaling"]
    assert rs["best"] in rows and rs["defaults_over_best"] == pytest.approx(
        out["methods"]["histospec_chain"]["modelled_wall_speedup"] / rs["best_speedup"], abs=1e-3)
    assert set(out["ablations"]["sources"]) >= {"only_history", "without_global", "all"}


def test_bench_reads_trace_files(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, synthetic_trace(num_prompts=3, n=2, epochs=2, mean_len=40, seed=3))
    assert len(read_trace(path)) == 12
    assert bench.main(["--json", "--trace", str(path), "--ablations", "none", "--no-forward-timing"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == {"trace": str(path)} and out["methods"]["histospec_chain"]["generated_tokens"] > 0


def test_real_smollm2_trace_ordering():
    """On a real GRPO trace of the embedded default (SmolLM2-135M, 4 epochs of chain sums,
    written by `rhymerl train` as traces.jsonl) the drafting methods rank as designed, with
    drafts priced as the 7B GPU config's engine prices them on H100s."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-m", "benchmarks", "histospec", "--json", "--no-forward-timing",
                          "--ablations", "none", "--costs", "qwen2.5-7b-h100",
                          "--trace", str(repo / "benchmarks/traces/smollm2-chain-sum-grpo.jsonl")],
                         capture_output=True, text=True, cwd=repo, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    m = {k: v["tokens_per_forward"] for k, v in json.loads(res.stdout)["methods"].items()}
    assert m["histospec_chain"] >= m["suffix"] >= m["ngram"] >= m["none"] == 1.0, m
    assert m["histospec_chain"] > 1.5, m


def test_each_replayed_epoch_carries_the_acceptance_at_its_weight():
    """Replayed as the trainer drafts: each epoch is a rollout, into which the learnt
    acceptance carries at Drafting.acceptance_carry's weight (0: the prior again)."""
    from rhymerl.config import HistoSpecConfig
    from rhymerl.histospec.proposer import Drafting
    from rhymerl.histospec.step_costs import CPU_PRIOR
    epochs = by_epoch(synthetic_trace(num_prompts=3, n=2, epochs=3, mean_len=40, seed=3))
    rates, tpf = {}, {}
    for carry in (0.0, 1.0):
        m = bench.HistoSpecMethod(HistoSpecConfig(), "hs", CPU_PRIOR, Drafting(acceptance_carry=carry))
        seen = rates[carry] = []
        replay_epoch = m.observe

        def observe(epoch, groups, m=m, seen=seen, replay_epoch=replay_epoch):
            replay_epoch(epoch, groups)
            seen.append(m.prop.acceptance.source_rate("history"))

        m.observe = observe
        tpf[carry] = bench.simulate(m, epochs, 8)["tokens_per_forward"]
    prior = m.prop.acceptance.prior
    assert len(rates[0.0]) == 3 and all(r == prior for r in rates[0.0])
    assert rates[1.0][0] == prior and all(r != prior for r in rates[1.0][1:])
    assert tpf[0.0] != tpf[1.0]


def test_modelled_step_time_charges_every_scored_token(capsys):
    step = bench.StepTime(0.05, 0.004, 0.002)
    assert step(3, 3) == pytest.approx(0.05 + 0.006 * 3)
    assert step(1, 8) - step(1, 6) == pytest.approx(2 * 0.002)
    assert bench.main(["--json", "--step-per-token-ms", "0", "--no-forward-timing"]) == 2
    assert "--step-per-token-ms must be > 0" in capsys.readouterr().err
    assert bench.main(["--json", "--step-fixed-ms", "-1", "--no-forward-timing"]) == 2
    assert "--step-fixed-ms must be >= 0" in capsys.readouterr().err


def _epochs(responses_by_epoch):
    from rhymerl.outputs.traces import TraceRecord

    recs = [TraceRecord(pid, ep, i, list(toks), prompt_token_ids=[900, 901])
            for ep, groups in enumerate(responses_by_epoch) for pid, resps in groups.items()
            for i, toks in enumerate(resps)]
    return by_epoch(recs)


def test_hindsight_ceiling_drafts_what_the_text_allows_and_nothing_unseen():
    same = {"p": [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]}
    # A repeated response: the first step has one token of context (the start marker), too
    # little; from then on every step takes a whole max_len draft plus its bonus token.
    r = bench.simulate(bench.HindsightMethod(2), _epochs([same, same]), max_len=4)
    assert (r["generated_tokens"], r["forwards"], r["acceptance_rate"]) == (11, 3, 1.0)  # 1 + 5 + 5
    # Nothing seen before and no repeats in its own output: no draft can exist.
    fresh = _epochs([{"p": [[50, 51, 52]]}, {"p": [[60, 61, 62, 63, 64, 65]]}])
    assert bench.simulate(bench.HindsightMethod(1), fresh, max_len=4)["forwards"] == 6
    # Its own output so far is visible, its future is not: "7 8 9" recurs once it was written.
    own = _epochs([{"p": [[50]]}, {"p": [[7, 8, 9, 1, 7, 8, 9, 2]]}])
    r = bench.simulate(bench.HindsightMethod(1), own, max_len=4)
    assert r["forwards"] == 6 and r["mean_accepted_len"] == pytest.approx(2 / 6)  # 8 9 drafted after the second 7
    # A sibling's tokens count once written: B is a token behind A and copies what A wrote.
    a, b = [3, 1, 4, 1, 5, 9, 2, 6], [3, 3, 1, 4, 1, 5, 9]
    alone = sum(bench.simulate(bench.HindsightMethod(1), _epochs([{"p": [[50]]}, {"p": [t]}]), max_len=4)["forwards"]
                for t in (a, b))
    assert alone == len(a) + len(b)
    assert bench.simulate(bench.HindsightMethod(1), _epochs([{"p": [[50]]}, {"p": [a, b]}]), max_len=4)["forwards"] < alone
