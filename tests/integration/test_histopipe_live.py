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

pytestmark = [pytest.mark.cpu, pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_live_dispatch_measures_every_policy(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", "-m", "rhymerl.launch.rank_main", str(REPO / "configs" / "tiny-cpu.yaml"),
           f"run.output_dir={tmp_path}", "run.max_steps=1", "model.path=builtin:tiny", "data.size=4",
           "data.prompts_per_step=4", "rollout.max_tokens=16", "rollout.max_num_seqs=2", "tracking.wandb=disabled",
           "checkpoint.every_steps=0", "histopipe.compare_baselines=true", "histopipe.slice_s=0.01"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-6000:]
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    for name in ("histopipe", "least_loaded", "random"):
        assert 0.0 <= row[f"histopipe/bubble_{name}"] < 1.0
        assert f"policy {name}: makespan" in res.stderr
    assert row["histopipe/bubble_fraction"] == row["histopipe/bubble_histopipe"]
    # Every request of the step came back once, whatever moved: 4 prompts x n=4.
    traces = [json.loads(x) for x in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert sorted((t["prompt_id"], t["sample_idx"]) for t in traces) == sorted({(t["prompt_id"], s) for t in traces
                                                                                for s in range(4)})
    assert len(traces) == 16 and all(t["token_ids"] for t in traces)
