"""DAPO dynamic sampling end to end on the tiny model, with the DeepSpeed backend and a KL reference.

Real vLLM rollouts, real DeepSpeed training with a frozen reference (``algo.kl_coef > 0``), real
reward workers running a user reward (``reward.function``, ``dapo_rewards.length_parity``)
(constant for some prompts), so that some groups are dropped and dynamic sampling has to refill.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from documented_metrics import undocumented

pytestmark = [pytest.mark.cpu, pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_dapo_refills_train_with_deepspeed_and_a_kl_reference(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "rhymerl", "train", str(REPO / "configs/tiny-cpu.yaml"), f"run.output_dir={out}",
           "model.path=builtin:tiny", "parallel.backend=deepspeed", "algo.kl_coef=0.05", "algo.name=dapo",
           "algo.dynamic_sampling=true", "algo.max_refill_rounds=2", "reward.function=dapo_rewards:length_parity",
           "reward.workers=1", "data.size=4", "data.prompts_per_step=2", "rollout.max_tokens=16", "run.max_steps=2",
           "tracking.wandb=disabled", "checkpoint.every_steps=0", "algo.micro_batch_tokens=4096"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-6000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        rounds = r["dapo/rounds"]
        assert 1 <= rounds <= 3
        # Every round's responses are counted (refills included), and what was kept is whole groups.
        assert r["rollout/responses"] == rounds * 2 * 4, r
        assert r["histospec/generated_tokens"] == r["rollout/generated_tokens"], r
        assert r["dapo/kept_groups"] + r["dapo/dropped_groups"] <= rounds * 2, r
        # One round is enough only when it dropped nothing.
        assert rounds > 1 or r["dapo/dropped_groups"] == 0, r
        assert math.isfinite(r["train/loss"]) and r["train/kl_ref"] >= 0.0, r
    # The reference is the initial policy: no divergence before the first update, some after it.
    assert rows[0]["train/kl_ref"] == pytest.approx(0.0, abs=1e-6) and rows[1]["train/kl_ref"] > 0.0, rows
    # The data's 4 prompts (answers 6, 8, 6, 16) are all drawn in the two steps: 8 and 16 are dropped.
    assert sum(r["dapo/dropped_groups"] for r in rows) >= 2 and any(r["dapo/rounds"] > 1 for r in rows), rows
    assert not undocumented({k for r in rows for k in r}), "logged but missing in docs/operations.md"
