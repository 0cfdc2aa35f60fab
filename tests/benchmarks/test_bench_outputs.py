"""The benchmarks' pure parts: one JSON object on stdout, per-step figures named for what they hold,
the sweep's cells and table, the step-cost fit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.cpu]


def test_quiet_stdout_sends_native_writes_to_stderr():
    """vLLM and Megatron log through file descriptor 1: inside quiet_stdout that lands on stderr."""
    code = (
        "import os, sys, json\n"
        "from benchmarks.rollout import quiet_stdout\n"
        "with quiet_stdout():\n"
        "    os.write(1, b'INFO engine log line\\n')\n"
        "    print('a python print')\n"
        "print(json.dumps({'ok': 1}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.splitlines() == ['{"ok": 1}']
    assert "INFO engine log line" in res.stderr and "a python print" in res.stderr


def test_e2e_step_rows_keep_the_reward_apart_from_the_reward_phase_time():
    from benchmarks.e2e import step_row, summarize

    rows = [step_row(e + 1, {"time/step_s": 2.0 + e, "reward/mean": 0.25 + e, "time/reward_s": 0.5, "time/rollout_s": 1.5,
                         "histospec/tokens_per_forward": 1.0 + e, "response/len_mean": 100.0,
                         "rollout/generated_tokens": 100 * (e + 1)}) for e in (0, 1, 2)]
    res = summarize(rows)
    assert [r["reward_mean"] for r in res["per_step"]] == [0.25, 1.25, 2.25]
    assert res["reward_mean"] == 1.75 and res["phases"]["reward"] == 0.5 and res["phases"]["rollout"] == 1.5
    assert res["steps_measured"] == 2 and res["step_s"] == 3.5 and res["tokens_per_forward"] == 2.5
    assert res["rollout_s_per_token"] == 3.0 / 500  # epochs >= 2: 1.5 s each over 200 + 300 tokens
    json.dumps(res)


def test_sweep_cells_take_whole_groups_in_prompt_order():
    from benchmarks.rollout import Workload, _cell_requests
    from rhymerl.config import HistoSpecConfig, RolloutConfig

    w = Workload(None, [[1], [2], [3]], RolloutConfig(n=4), HistoSpecConfig(), 0, 8)
    assert _cell_requests(w, 1) == [(0, [1])]
    reqs = _cell_requests(w, 8)
    assert [g for g, _ in reqs] == [0] * 4 + [1] * 4 and reqs[4][1] == [2]
    assert [p for _, p in _cell_requests(w, 16)][12:] == [[1]] * 4  # wraps around the prompts


def test_sweep_table_prints_every_cell():
    from benchmarks.rollout import _sweep_table

    cells = [{"temperature": t, "concurrency": c, "ratio": 1.0 + t + c / 100, "tokens_per_forward": 2.0}
             for t in (0.0, 1.0) for c in (1, 64)]
    text = _sweep_table({"workload": "cfg", "n": 4, "max_tokens": 32, "trained_epochs": 1, "cells": cells,
                         "min_ratio": 1.01, "geomean_ratio": 1.5})
    assert "1.010x" in text and "2.640x" in text and "min 1.010x" in text


def test_fit_line_recovers_fixed_and_per_request_cost():
    from benchmarks.step import fit_line

    assert fit_line([(2, 70.0), (32, 250.0)]) == pytest.approx((58.0, 6.0))
    assert fit_line([(8, 100.0)]) == (100.0, 0.0)


def test_phase_timer_follows_a_method_patched_after_wrapping():
    """bench step swaps vLLM patches in and out on a wrapped engine: the timer must call the current one."""
    from benchmarks.step import PhaseTimer

    class Runner:
        def sample(self, x):
            return x + 1

    r, timer = Runner(), PhaseTimer()
    timer.wrap(r, "sample", "sample")
    assert r.sample(1) == 2
    Runner.sample = lambda self, x: x + 10
    assert r.sample(1) == 11 and timer.seconds["sample"] > 0


def test_e2e_ratios_compare_equal_work():
    from benchmarks.e2e import add_ratios

    def variant(step, rollout, per_token):
        return {"step_s": step, "phases": {"rollout": rollout}, "rollout_s_per_token": per_token}

    off = variant(10.0, 6.0, 0.02)
    # The accelerated run wrote shorter responses: its raw ratios flatter it, the equal-work ones do not.
    on = variant(4.0, 1.5, 0.01)
    add_ratios(on, off)
    assert on["step_speedup"] == 2.5 and on["rollout_speedup"] == 4.0
    assert on["rollout_speedup_per_token"] == 2.0
    assert on["step_speedup_at_equal_work"] == 10.0 / (4.0 + 3.0)
    add_ratios(off, off)
    assert off["step_speedup_at_equal_work"] == 1.0 and off["rollout_speedup_per_token"] == 1.0
    idle = variant(1.0, 0.0, 0.0)
    add_ratios(idle, off)
    assert idle["rollout_speedup_per_token"] == 0.0 and idle["step_speedup_at_equal_work"] == 0.0


def test_e2e_method_carries_its_own_overrides():
    from benchmarks import e2e
    from rhymerl.config import RunConfig, from_dict, to_dict, with_overrides

    name, over = e2e.split_method("histospec@histospec.step_cost=measured@rollout.n=2")
    assert name == "histospec" and over == ["histospec.step_cost=measured", "rollout.n=2"]
    assert e2e.split_method("ngram") == ("ngram", [])
    cfg = from_dict(with_overrides(to_dict(RunConfig()), over))
    assert cfg.histospec.step_cost == "measured" and cfg.rollout.n == 2


def test_e2e_rejects_a_bad_method_override_before_running(capsys):
    from benchmarks import e2e

    with pytest.raises(SystemExit) as exc:
        e2e.main(["--methods", "histospec,histospec@histospec.epochs_kept=x"])
    assert exc.value.code == 2
    assert "histospec.epochs_kept: expected an integer" in capsys.readouterr().err


def test_sweep_variant_applies_its_overrides_and_refuses_other_sections():
    from benchmarks.rollout import Workload
    from rhymerl.config import ConfigError, HistoSpecConfig, RolloutConfig

    w = Workload(None, [[1]], RolloutConfig(n=2, max_tokens=64), HistoSpecConfig(), 0, 1)
    rollout, h = w.variant(["histospec.min_goodput_gain=0", "rollout.max_tokens=32"])
    assert (h.min_goodput_gain, rollout.max_tokens, rollout.n) == (0.0, 32, 2)
    assert w.histospec.min_goodput_gain == 0.05  # the workload's own config is untouched
    with pytest.raises(ConfigError, match="histospec.nope"):
        w.variant(["histospec.nope=1"])
    with pytest.raises(ConfigError, match="rollout.\\* and histospec.\\*"):
        w.variant(["algo.lr=1"])


def test_sweep_table_prints_each_variant_against_none():
    from benchmarks.rollout import _sweep_table

    row = {"ratio": 0.9, "tokens_per_forward": 1.5, "ratio_equal_lengths": 1.1}
    alt = {"ratio": 1.25, "tokens_per_forward": 1.75, "ratio_equal_lengths": 1.3}
    cells = [{"temperature": 1.0, "concurrency": 8, **row, "variants": {"histospec": row, "histospec@x=1": alt}}]
    eq = {"min_ratio": 1.1, "geomean_ratio": 1.1}
    text = _sweep_table({"workload": "cfg", "n": 4, "max_tokens": 32, "trained_epochs": 1, "cells": cells,
                         "min_ratio": 0.9, "geomean_ratio": 0.9, "variants": ["histospec", "histospec@x=1"],
                         "none_time_fit": {"c0_s": 0.5, "per_step_s": 0.05, "per_token_s": 0.004,
                                           "relative_rms_error": 0.08}, "equal_lengths": eq,
                         "variant_summary": {"histospec": {"min_ratio": 0.9, "geomean_ratio": 0.9, "equal_lengths": eq},
                                             "histospec@x=1": {"min_ratio": 1.25, "geomean_ratio": 1.25,
                                                               "equal_lengths": {"min_ratio": 1.3, "geomean_ratio": 1.3}}}})
    assert "0.900x (1.50) [1.100x]" in text and "histospec@x=1:" in text and "1.250x (1.75) [1.300x]" in text
    assert "50.0 ms x longest" in text and "8% rms error" in text and "at equal lengths min 1.300x" in text


def test_none_time_fit_recovers_step_and_token_costs_and_prices_a_variant_at_its_own_lengths():
    from benchmarks.rollout import equal_lengths_ratio, fit_none_time

    def none_run(longest, tokens):
        return {"longest_response": longest, "generated_tokens": tokens, "wall_s": 0.5 + 0.05 * longest + 0.004 * tokens}

    runs = [none_run(60, 60), none_run(300, 900), none_run(512, 4000), none_run(200, 1500)]
    c0, per_step, per_token, err = fit_none_time(runs)
    assert (c0, per_step, per_token) == pytest.approx((0.5, 0.05, 0.004), rel=1e-6) and err < 1e-9
    # A variant that wrote a longer tail is compared with none writing that tail: twice as
    # fast as none would be at its lengths, whatever none's own draws were.
    variant = {"longest_response": 512, "generated_tokens": 2000, "wall_s": (0.5 + 0.05 * 512 + 0.004 * 2000) / 2}
    assert equal_lengths_ratio((c0, per_step, per_token, err), variant) == pytest.approx(2.0)
    assert fit_none_time(runs[:2]) is None  # fewer runs than unknowns


def test_none_time_fit_keeps_every_cost_non_negative():
    import numpy as np

    from benchmarks.rollout import fit_none_time, none_time_s

    # Steps whose time grows faster than linearly in tokens, over a narrow range of lengths:
    # unconstrained, the fit's cost per batch is negative and a short batch costs nothing.
    def none_run(longest, tokens):
        return {"longest_response": longest, "generated_tokens": tokens, "wall_s": 0.02 * longest + 2e-5 * tokens ** 1.6}

    runs = [none_run(100, 400), none_run(110, 500), none_run(120, 560), none_run(105, 450), none_run(130, 640)]
    a = np.array([[1.0, r["longest_response"], r["generated_tokens"]] for r in runs])
    y = np.array([r["wall_s"] for r in runs])
    free, *_ = np.linalg.lstsq(a / y[:, None], np.ones_like(y), rcond=None)
    assert free.min() < 0  # the case this guards against
    fit = fit_none_time(runs)
    assert min(fit[:3]) >= 0.0
    assert none_time_s(fit, 30, 60) > 0.0
    # Still a least-squares fit: within a few percent of every step it was fitted on.
    assert all(abs(none_time_s(fit, r["longest_response"], r["generated_tokens"]) / r["wall_s"] - 1) < 0.05 for r in runs)


def test_sweep_median_of_two_repeats_is_their_mean_not_the_better_one():
    from benchmarks.rollout import equal_lengths_ratios

    fit = (0.0, 0.0, 0.01, 0.0)  # none takes 10 ms a token

    def run(ratio):
        return {"longest_response": 100, "generated_tokens": 100, "wall_s": 1.0 / ratio}

    med, each = equal_lengths_ratios(fit, [run(1.1), run(0.9)])
    assert med == pytest.approx(1.0) and each == pytest.approx([0.9, 1.1])
    med3, _ = equal_lengths_ratios(fit, [run(1.3), run(0.8), run(1.0)])
    assert med3 == pytest.approx(1.0)


def test_e2e_equal_lengths_prices_off_at_the_variant_s_own_responses():
    from benchmarks.e2e import add_equal_lengths

    def row(epoch, longest, tokens, rollout, other):
        return {"epoch": epoch, "longest_response": longest, "generated_tokens": tokens, "step_s": rollout + other,
                "phases_s": {"rollout": rollout}}

    cost = lambda longest, tokens: 1.0 + 0.05 * longest + 0.002 * tokens  # noqa: E731
    off = {"per_step": [row(e, lg, tk, cost(lg, tk), 8.0)
                        for e, lg, tk in ((1, 100, 400), (1, 300, 600), (2, 200, 900), (2, 512, 1200))]}
    # The variant drew a longer tail (its per-token speed would flatter off) and ran its
    # rollout at half of what off would take for those responses.
    v = {"per_step": [row(1, 50, 200, 0.5, 7.0), row(2, 400, 800, cost(400, 800) / 2, 9.0)]}
    add_equal_lengths(v, off)
    assert v["rollout_speedup_at_equal_lengths"] == pytest.approx(2.0)
    assert v["step_speedup_at_equal_lengths"] == pytest.approx((9.0 + cost(400, 800)) / (9.0 + cost(400, 800) / 2))
    assert off["rollout_time_fit"]["per_step_s"] == pytest.approx(0.05)
    bare = {"per_step": [{"epoch": 1, "step_s": 2.0, "phases_s": {"rollout": 1.0}}]}
    add_equal_lengths(bare, {"per_step": []})  # nothing to fit: no ratio rather than a made-up one
    assert "rollout_speedup_at_equal_lengths" not in bare


def test_e2e_summarises_each_ratio_across_seeds(capsys):
    from benchmarks import e2e

    def run(on_eq, tpf):
        return {"variants": {"off": {"rollout_speedup_at_equal_lengths": 1.0, "tokens_per_forward": 1.0},
                             "histospec": {"rollout_speedup_at_equal_lengths": on_eq, "tokens_per_forward": tpf}}}

    s = e2e.across_seeds({1234: run(1.79, 1.88), 1: run(1.18, 1.54), 2: run(1.07, None)})
    eq = s["histospec"]["rollout_speedup_at_equal_lengths"]
    assert eq["seeds"] == [1234, 1, 2] and eq["min"] == 1.07 and eq["max"] == 1.79
    assert eq["geomean"] == pytest.approx((1.79 * 1.18 * 1.07) ** (1 / 3))
    assert s["histospec"]["tokens_per_forward"]["seeds"] == [1234, 1]  # a missing ratio is left out
    assert e2e.parse_seeds("1234, 1,2") == [1234, 1, 2]
    for bad in ("", "1,1", "x"):
        with pytest.raises(ValueError):
            e2e.parse_seeds(bad)
    with pytest.raises(SystemExit):
        e2e.main(["--seeds", "1,2", "run.seed=3"])
    assert "--seeds sets run.seed" in capsys.readouterr().err


def test_step_calibration_recovers_the_costs_it_was_given():
    """Steps priced by a known model: the fit returns that model's config keys, and the draft
    price by batch size is each drafted step's excess over the fit without drafts."""
    import random

    from benchmarks.step_calibration import StepRow, fit_step_costs, prior

    rng = random.Random(0)
    fixed, per_request, per_token, per_drow = 0.050, 0.0020, 0.0030, 0.0008
    rows = []
    for requests in (1, 2, 4, 8, 16, 32):
        for drafting, length in ((0, 0), (requests // 2, 1), (requests // 2, 4), (requests, 2)):
            d = drafting * length
            s = fixed + (per_request + per_token) * requests + per_token * d + per_drow * drafting
            rows.append(StepRow(requests, d, drafting, s * (1 + rng.uniform(-1e-4, 1e-4))))
    out = fit_step_costs(rows)
    k = out["keys"]
    assert k["fixed_ms"] == pytest.approx(50.0, rel=1e-2)
    assert k["per_request_ms"] == pytest.approx(2.0, rel=1e-2)
    assert k["per_token_ms"] == pytest.approx(3.0, rel=1e-2)
    assert k["per_drafting_request_ms"] == pytest.approx(0.8, rel=5e-2)
    assert out["relative_rms_error"] < 1e-3 and out["notes"] == []
    # At 32 requests: 16 rows drafting 1 token, 16 drafting 4, 32 drafting 2: 64 drafting rows at
    # 0.8 ms spread over 144 draft tokens at 3 ms.
    top = out["draft_price_by_requests"][-1]
    assert top["requests"] == "32+" and top["ms_per_draft_token"] == pytest.approx(3.0 + 0.8 * 64 / 144, rel=1e-2)
    assert prior(k).startswith("StepCosts(fixed_ms=50")


def test_step_calibration_refuses_steps_that_cannot_identify_the_costs():
    from benchmarks.step_calibration import StepRow, fit_step_costs

    with pytest.raises(ValueError, match="two batch sizes or more"):
        fit_step_costs([StepRow(4, 0, 0, 0.06)] * 10)
    # A draft token dearer than a row: the model cannot say so; the clamp is reported.
    rows = [StepRow(r, d, min(r, d), 0.05 + 0.001 * r + 0.004 * d) for r in (1, 2, 4, 8) for d in (0, 1, 2, 4)]
    assert "per_request clamped to 0" in fit_step_costs(rows)["notes"][0]


def test_sweep_cell_of_one_request_writes_two_groups_one_response_at_a_time():
    from benchmarks.rollout import Workload, _cell_waves
    from rhymerl.config import HistoSpecConfig, RolloutConfig

    w = Workload(None, [[1], [2], [3]], RolloutConfig(n=4), HistoSpecConfig(), 0, 8)
    waves = _cell_waves(w, 1, 8)
    assert [len(x) for x in waves] == [1] * 8
    assert [g for x in waves for g, _ in x] == [0] * 4 + [1] * 4 and waves[4][0][1] == [2]
    assert [len(x) for x in _cell_waves(w, 8, 8)] == [8]
    assert [len(x) for x in _cell_waves(w, 32, 8)] == [32]
    assert [len(x) for x in _cell_waves(w, 3, 8)] == [3, 3, 2]


def test_none_time_fit_charges_the_fixed_cost_once_per_closed_batch():
    from benchmarks.rollout import equal_lengths_ratio, fit_none_time

    def none_run(batches, longest_sum, tokens):
        return {"batches": batches, "longest_response": longest_sum, "sum_of_batch_longest": longest_sum,
                "generated_tokens": tokens, "wall_s": 0.5 * batches + 0.05 * longest_sum + 0.004 * tokens}

    runs = [none_run(1, 300, 900), none_run(8, 480, 480), none_run(1, 512, 4000), none_run(8, 1200, 1200)]
    c0, per_step, per_token, err = fit_none_time(runs)
    assert (c0, per_step, per_token) == pytest.approx((0.5, 0.05, 0.004), rel=1e-6) and err < 1e-9
    # Eight responses one after another whose longest is 200 tokens: none pays 8 batches and
    # the 8 batches' own longest, not 8 x 200.
    variant = {"batches": 8, "longest_response": 200, "sum_of_batch_longest": 800, "generated_tokens": 800}
    variant["wall_s"] = (0.5 * 8 + 0.05 * 800 + 0.004 * 800) / 1.5
    assert equal_lengths_ratio((c0, per_step, per_token, err), variant) == pytest.approx(1.5)


def test_engine_figures_over_several_calls_sum_counts_and_recompute_fractions():
    from benchmarks.rollout import _derived, accumulate

    calls = [{"generated_tokens": 100, "target_forwards": 50, "draft_proposed": 80, "draft_accepted": 50,
              "wall_s": 2.0, "engine_steps": 40, "steps": 40, "steps_without_drafts": 10,
              "steps_without_drafts_fraction": 0.25, "requests": 4, "requests_with_history": 4,
              "history_served_fraction": 1.0, "source/history/accepted": 30, "step_cost/fixed_ms": 38.9,
              "method": "histospec"},
             {"generated_tokens": 60, "target_forwards": 50, "draft_proposed": 20, "draft_accepted": 10,
              "wall_s": 2.0, "engine_steps": 50, "steps": 50, "steps_without_drafts": 50,
              "steps_without_drafts_fraction": 1.0, "requests": 4, "requests_with_history": 0,
              "history_served_fraction": 0.0, "source/history/accepted": 5, "step_cost/fixed_ms": 41.0,
              "method": "histospec"}]
    tot: dict = {}
    for m in calls:
        accumulate(tot, m)
    t = _derived(tot)
    assert t["generated_tokens"] == 160 and t["target_forwards"] == 100 and t["tokens_per_forward"] == 1.6
    assert t["acceptance_rate"] == pytest.approx(0.6) and t["source/history/accepted"] == 35
    assert t["steps_without_drafts_fraction"] == pytest.approx(60 / 90)
    assert t["history_served_fraction"] == pytest.approx(0.5)
    assert t["step_cost/fixed_ms"] == 41.0 and "method" not in t  # a state: the latest call's


def test_rollout_bench_refuses_sweep_options_without_sweep(capsys):
    from benchmarks import rollout

    # Without --sweep there are no cells or variants: options for them would be silently ignored.
    with pytest.raises(SystemExit) as exc:
        rollout.main(["--repeats", "5", "--variants", "histospec", "--sweep-min-requests", "4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--sweep-min-requests, --variants: only with --sweep" in err


def test_repeats_rotate_the_method_order_and_survive_no_methods():
    from benchmarks.rollout import rotated

    names = ["none", "suffix", "histospec"]
    assert [rotated(names, rep) for rep in range(4)] == [
        names, ["suffix", "histospec", "none"], ["histospec", "none", "suffix"], names]
    assert rotated(("a", "b"), 1) == ["b", "a"]
    # Every engine failed to build (each method reported as skipped): no repeat has anything to run.
    assert rotated([], 2) == []
