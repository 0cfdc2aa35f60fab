"""The rendered sbatch script of a run config, submitted to the local Slurm (.ci/slurm-up.sh),
running the real trainer on 2 tasks (TP=2): completion, then USR1 preemption -> checkpoint
-> requeue -> resume to completion."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from launch.slurm import render_script
from rhymerl.checkpoint import verify_checkpoint
from rhymerl.config import load_config
from slurm_helpers import REPO, TERMINAL, job_info, slurm_cluster, start_job, wait_job, wait_until  # noqa: F401

pytestmark = [pytest.mark.cpu, pytest.mark.integration, pytest.mark.slurm, pytest.mark.slow]

CONFIG = REPO / "configs" / "tiny-cpu.yaml"


def _render(tmp_path: Path, name: str, overrides: list[str]) -> tuple[str, Path, Path]:
    run_dir = tmp_path / "run"
    log_root = tmp_path / "slurm-logs"
    ov = ["model.path=builtin:tiny", "parallel.tensor_parallel=2", "slurm.tasks_per_node=2", f"run.name={name}",
          f"run.output_dir={run_dir}", f"slurm.log_dir={log_root}", "data.size=8", "data.prompts_per_step=4",
          "rollout.max_tokens=16", "reward.workers=1", "tracking.wandb=offline", *overrides]
    cfg = load_config(CONFIG, ov)
    text = render_script(cfg.slurm, cfg.parallel, job_name=name, config_path=CONFIG, overrides=ov, workdir=REPO)
    return text, log_root, run_dir


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_config_two_tasks_completes_with_checkpoint(slurm_cluster, tmp_path):
    text, log_root, run_dir = _render(tmp_path, "tiny-2task", ["run.epochs=2", "checkpoint.every_steps=2",
                                                               "slurm.time=00:10:00"])
    job = wait_job(start_job(text, log_root, "tiny-2task"), timeout_s=240)
    assert job.state == "COMPLETED", job.log_text
    assert "srun finished with exit code 0" in job.batch_text
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert verify_checkpoint(run_dir / "checkpoints" / "step-000004") is None
    assert "finished in" in job.rank_logs[0], job.log_text


def test_usr1_preempts_requeues_and_resumes_trainer(slurm_cluster, tmp_path):
    text, log_root, run_dir = _render(tmp_path, "tiny-preempt", ["run.epochs=6", "checkpoint.every_steps=0",
                                                                 "slurm.time=00:15:00", "slurm.signal_lead_s=60"])
    assert "#SBATCH --signal=USR1@60" in text and "#SBATCH --requeue" in text
    job = start_job(text, log_root, "tiny-preempt")

    def two_steps_done() -> bool:
        job.info = job_info(job.job_id)
        if job.state in TERMINAL:
            pytest.fail(f"job ended ({job.state}) before it was preempted\n{job.log_text}")
        m = run_dir / "metrics.jsonl"
        return m.is_file() and len(m.read_text().splitlines()) >= 2

    wait_until(two_steps_done, 240, "two training steps")
    subprocess.run(["scancel", "--signal=USR1", job.job_id], check=True, timeout=10)
    job = wait_job(job, timeout_s=300, min_restarts=1)
    log = job.log_text
    assert job.state == "COMPLETED" and job.restarts == 1, log
    assert "received SIGUSR1" in log and "job requeued" in log and "resumed from" in log, log
    rows = _metrics(run_dir)
    # Every step exactly once across the two allocations, in order.
    assert [r["step"] for r in rows] == list(range(12)), [r["step"] for r in rows]
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert ckpts and ckpts[-1] == "step-000012" and verify_checkpoint(run_dir / "checkpoints" / ckpts[-1]) is None
