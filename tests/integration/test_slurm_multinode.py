"""The rendered multi-node sbatch script on the two-node test cluster of .ci/slurm2-up.sh.

Each node is a slurmd in its own network namespace (rmn0 = 10.213.0.1, rmn1 = 10.213.0.2,
joined only by a veth pair), so the two ranks of the tiny config (2 nodes x 1 task, DP=2)
rendezvous at the batch host's NodeAddr and all-reduce across that link. The job is
preempted with USR1 sent to the batch shell (`scancel --batch --signal=USR1`, which the
script's trap turns into a notice file that rank 0 reads), checkpoints, requeues itself, and the
restarted job resumes on both nodes and finishes with every step logged exactly once.
Client commands run on the cluster's login node (netns rhymerl-mn0) through its `login` wrapper.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest

from rhymerl.launch.slurm import render_script
from rhymerl.outputs.checkpoint import verify_checkpoint
from rhymerl.config import load_config
from slurm_helpers import REPO, TERMINAL, SlurmJob, job_info, wait_job, wait_until

pytestmark = [pytest.mark.cpu, pytest.mark.integration, pytest.mark.slurm, pytest.mark.slow]

CLUSTER_DIR = Path(os.environ.get("RHYMERL_SLURM2_DIR", "/tmp/rhymerl-slurm2"))
LOGIN = CLUSTER_DIR / "login"
CLIENT = (str(LOGIN),)
NODES = {"rmn0": "10.213.0.1", "rmn1": "10.213.0.2"}
CONFIG = REPO / "configs" / "tiny-cpu.yaml"
# 8 prompts, 4 per step: 2 steps per epoch, 8 steps in all; a periodic checkpoint every EVERY
# steps; USR1 once SIGNAL_AFTER steps are logged, after a periodic checkpoint exists (its
# writer process must survive the job-wide signal for the preemption save to complete).
STEPS, EVERY, SIGNAL_AFTER = 8, 2, 3


def _slurm(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(REPO))
    return subprocess.run([*CLIENT, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _unavailable_reason() -> Optional[str]:
    if not LOGIN.is_file():
        return f"two-node test cluster not started ({LOGIN} missing); run .ci/slurm2-up.sh as root"
    try:
        res = _slurm("sinfo", "-h", "-N", "-o", "%N=%T", timeout=10)
    except subprocess.TimeoutExpired:
        return "sinfo on the two-node test cluster timed out; is .ci/slurm2-up.sh's slurmctld running?"
    states = dict(x.split("=", 1) for x in res.stdout.split())
    usable = [n for n in NODES if states.get(n, "").rstrip("*~#") in ("idle", "mixed", "allocated", "completing")]
    if res.returncode != 0 or len(usable) < 2:
        return f"two-node test cluster not usable (sinfo: {res.stderr.strip()[:200] or states}); run .ci/slurm2-up.sh"
    return None


@pytest.fixture(scope="module")
def two_node_cluster() -> None:
    reason = _unavailable_reason()
    if reason:
        pytest.skip(reason)


def test_two_node_tiny_job_preempted_with_usr1_requeues_and_resumes(two_node_cluster, tmp_path):
    name = "tiny-2node"
    run_dir, log_root = tmp_path / "run", tmp_path / "slurm-logs"
    ov = ["model.path=builtin:tiny", "slurm.nodes=2", "slurm.tasks_per_node=1", "slurm.time=00:10:00",
          "slurm.signal_lead_s=60", f"run.name={name}", f"run.output_dir={run_dir}", f"slurm.log_dir={log_root}",
          "data.size=8", "data.prompts_per_step=4", f"run.epochs={STEPS // 2}", f"checkpoint.every_steps={EVERY}",
          "rollout.max_tokens=16", "reward.workers=1", "tracking.wandb=offline"]
    cfg = load_config(CONFIG, ov)
    text = render_script(cfg.slurm, cfg.parallel, job_name=name, config_path=CONFIG, overrides=ov, workdir=REPO)
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --requeue" in text
    log_root.mkdir(parents=True)
    script = log_root / f"{name}.sbatch"
    script.write_text(text)
    res = _slurm("sbatch", "--parsable", str(script))
    assert res.returncode == 0, f"sbatch failed: {res.stderr}"
    job_id = res.stdout.strip().split(";")[0]
    job = SlurmJob(job_id=job_id, info={}, batch_log=log_root / f"{name}-{job_id}.out",
                   job_log_dir=log_root / f"{name}-{job_id}")
    metrics = run_dir / "metrics.jsonl"

    def steps_done() -> bool:
        job.info = job_info(job_id, CLIENT)
        if job.state in TERMINAL:
            pytest.fail(f"job ended ({job.state}) before it was preempted\n{job.log_text}")
        return metrics.is_file() and len(metrics.read_text().splitlines()) >= SIGNAL_AFTER

    t0 = time.monotonic()
    wait_until(steps_done, 150, f"{SIGNAL_AFTER} training step(s)")
    assert job.info["NumNodes"] == "2" and job.info["NodeList"] == "rmn[0-1]", job.info
    # The batch shell's trap leaves a notice file; rank 0 reads it, the step-end all-reduce
    # tells the rank on the other node.
    res = _slurm("scancel", "--batch", "--signal=USR1", job_id, timeout=10)
    assert res.returncode == 0, res.stderr
    wait_job(job, timeout_s=150, min_restarts=1, client=CLIENT)
    elapsed = time.monotonic() - t0
    log = job.log_text
    assert job.state == "COMPLETED" and job.restarts == 1, log
    batch = job.batch_text
    assert f"job {job_id} restart 0 on rmn[0-1]" in batch and f"job {job_id} restart 1 on rmn[0-1]" in batch, log
    # MASTER_ADDR is rmn0's NodeAddr, an address that exists only inside the namespaces.
    assert batch.count(f"MASTER_ADDR={NODES['rmn0']} ") == 2, log
    assert "batch shell got USR1; notice to the tasks" in batch, log
    # The requeue ends the first allocation's batch script; the second one runs to its end.
    assert f"JOB {job_id} ON rmn0 CANCELLED AT" in batch and "DUE TO JOB REQUEUE" in batch, log
    assert batch.count("srun finished with exit code 0") == 1, log
    # One log per rank, each continued (append mode) by the restarted job.
    assert sorted(job.rank_logs) == [0, 1], log
    assert "received SIGUSR1 through the batch shell" in job.rank_logs[0], log
    for rank, text_r in job.rank_logs.items():
        assert "Traceback" not in text_r, f"rank {rank}\n{log}"
    assert "job requeued" in job.rank_logs[0] and "resumed from" in job.rank_logs[0], log
    assert "finished in" in job.rank_logs[0], log
    # Every step exactly once across the two allocations, in order.
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(STEPS)), steps
    preempted_at = int(re.search(r"preempted after step (\d+)", job.rank_logs[0]).group(1))
    assert SIGNAL_AFTER <= preempted_at < STEPS, log
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert ckpts[-1] == f"step-{STEPS:06d}" and verify_checkpoint(run_dir / "checkpoints" / ckpts[-1]) is None
    print(f"two-node job {job_id}: preempted after step {preempted_at}, resumed, {STEPS} steps, "
          f"{elapsed:.0f} s from the first step to completion")
