"""Rendered sbatch scripts on a real one-node Slurm (.ci/slurm-up.sh): ranks, rendezvous, preemption."""

from __future__ import annotations

import json
import random
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from rhymerl.launch.slurm import master_port_block, render_script
from rhymerl.outputs.checkpoint import verify_checkpoint
from rhymerl.config import load_config
from slurm_helpers import (  # noqa: F401  (slurm_cluster is a fixture)
    REPO, TERMINAL, job_info, slurm_cluster, start_job, submit_and_wait, wait_job, wait_until,
)

pytestmark = [pytest.mark.cpu, pytest.mark.integration, pytest.mark.slurm, pytest.mark.slow]
HERE = Path(__file__).resolve().parent


def _render(tmp_path: Path, name: str, slurm: dict, run: dict, workload: str, overrides=()) -> tuple[str, Path]:
    cfg_path = tmp_path / f"{name}.yaml"
    log_root = tmp_path / "slurm-logs"
    cfg_path.write_text(yaml.safe_dump({"run": {"name": name, **run},
                                        "slurm": {"log_dir": str(log_root), **slurm}}))
    cfg = load_config(cfg_path, list(overrides))
    text = render_script(cfg.slurm, cfg.parallel, job_name=name, config_path=cfg_path, overrides=list(overrides),
                         workdir=REPO, entry=[str(HERE / workload)])
    return text, log_root


def test_two_task_job_gets_ranks_and_rendezvous(slurm_cluster, tmp_path):
    text, log_root = _render(tmp_path, "rr-allreduce", {"tasks_per_node": 2, "time": "00:05:00"}, {},
                             "slurm_workload_allreduce.py", overrides=["algo.lr=3e-6"])
    job = submit_and_wait(text, log_root, "rr-allreduce", timeout_s=60)
    log = job.log_text
    assert job.state == "COMPLETED", log
    results = sorted((json.loads(m) for m in re.findall(r"^RESULT (.*)$", log, re.M)), key=lambda r: r["rank"])
    assert [(r["rank"], r["local_rank"], r["world"]) for r in results] == [(0, 0, 2), (1, 1, 2)], log
    assert {r["allreduce"] for r in results} == {3.0}
    assert {r["lr"] for r in results} == {3e-6}, "overrides must reach every task"
    [master] = {r["master"] for r in results}
    host, port = master.rsplit(":", 1)
    first_host = subprocess.run(["scontrol", "show", "hostnames", job.info["NodeList"]], capture_output=True,
                                text=True).stdout.split()[0]
    assert host == first_host
    assert int(port) in master_port_block(int(job.job_id))
    assert "srun finished with exit code 0" in job.batch_text


def _expected_total(seed: int, world: int, steps: int) -> float:
    total = 0.0
    rngs = [random.Random(seed + r) for r in range(world)]
    for step in range(1, steps + 1):
        total += sum((r + 1) * step + rngs[r].random() for r in range(world))
    return total


def test_usr1_checkpoints_requeues_and_resumes_to_completion(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    steps = 10
    text, log_root = _render(tmp_path, "rr-preempt", {"tasks_per_node": 2, "time": "00:10:00", "signal_lead_s": 30},
                             {"output_dir": str(run_dir), "max_steps": steps, "seed": 77}, "slurm_workload_preempt.py")
    assert "#SBATCH --signal=USR1@30" in text and "#SBATCH --requeue" in text
    t0 = time.monotonic()
    job = start_job(text, log_root, "rr-preempt", env={"RHYMERL_TEST_STEP_S": "0.3"})
    progress = run_dir / "progress"

    def reached_step_3() -> bool:
        job.info = job_info(job.job_id)
        if job.state in TERMINAL:
            pytest.fail(f"job ended ({job.state}) before step 3\n{job.log_text}")
        return progress.is_file() and int(progress.read_text() or 0) >= 3

    wait_until(reached_step_3, 60, "step 3 of the first run")
    subprocess.run(["scancel", "--signal=USR1", job.job_id], check=True, timeout=10)
    job = wait_job(job, timeout_s=90, min_restarts=1)
    elapsed = time.monotonic() - t0
    log = job.log_text
    assert job.state == "COMPLETED" and job.restarts == 1, log
    rank0 = job.rank_logs[0]
    saved = re.search(r"CHECKPOINTED (step-\d+) on SIGUSR1", rank0)
    assert saved, log
    assert "REQUEUE issued=True" in rank0
    assert re.search(rf"RESUMED from {saved.group(1)} at step \d+ total=", rank0), log
    assert f"shard='rank1@{int(saved.group(1)[5:])}'" in job.rank_logs[1]
    assert "restart 0 on" in job.batch_text and "restart 1 on" in job.batch_text
    result = json.loads((run_dir / "result.json").read_text())
    assert result["restart"] == 1 and result["start"] == int(saved.group(1)[5:]) + 1
    # Exact resume: same total (incl. every rank's RNG stream) as an uninterrupted run.
    assert result["total"] == pytest.approx(_expected_total(77, 2, steps), rel=1e-12)
    assert verify_checkpoint(run_dir / "checkpoints" / saved.group(1)) is None
    print(f"preempt/requeue/resume round trip: {elapsed:.1f} s")
