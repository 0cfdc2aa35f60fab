"""HistoPipe's live driver on 2 ranks: requests queue (2 batch slots per engine for 16
requests), the replicated scheduler admits them as slots free, and the same step is rolled
out under least-loaded, random and HistoPipe dispatch, each bubble measured in one run."""

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_live_dispatch(tmp_path):
    """Two one-rank instances dispatched live: every request comes back once, whatever moved,
    each instance's engine steps and busy seconds are reported, and HistoSpec's figures are
    the instances' summed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", "-m", "rhymerl.launch.rank_main", str(REPO / "configs" / "tiny-cpu.yaml"),
           f"run.output_dir={tmp_path}", "run.max_steps=1", "model.path=builtin:tiny", "data.size=4",
           "data.prompts_per_step=4", "rollout.max_tokens=16", "rollout.max_num_seqs=2", "tracking.wandb=disabled",
           "checkpoint.every_steps=0", "histopipe.slice_s=0.01"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-6000:]
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert "histopipe live step 0: makespan" in res.stderr
    assert 0.0 <= row["histopipe/bubble_fraction"] < 1.0 and row["rollout/instances"] == 2
    assert row["rollout/engine_steps/0"] > 0 and row["rollout/engine_steps/1"] > 0
    assert row["rollout/instance_s/0"] > 0 and row["rollout/instance_s/1"] > 0
    assert not undocumented(row), "logged but missing in docs/operations.md"
    assert row["histospec/generated_tokens"] == row["rollout/generated_tokens"] == row["response/len_mean"] * 16
    # Every request of the step came back once, whatever moved: 4 prompts x n=4.
    traces = [json.loads(x) for x in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert sorted((t["prompt_id"], t["sample_idx"]) for t in traces) == sorted({(t["prompt_id"], s) for t in traces
                                                                                for s in range(4)})
    assert len(traces) == 16 and all(t["token_ids"] for t in traces)
