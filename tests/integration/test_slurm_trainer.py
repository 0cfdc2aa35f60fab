"""The real trainer under the local Slurm (.ci/slurm-up.sh), with periodic checkpoints on, for
every way a stop reaches it: preemption by `scancel --signal=USR1` (to the tasks, 2 tasks TP=2),
by `scancel --batch --signal=USR1` (to the batch shell, whose trap leaves a notice file for
rank 0) once a periodic checkpoint exists and as soon as the job runs (the shell and the tasks
still starting), by a real time limit with `--signal=B:USR1@lead` and with `--signal=USR1@lead`
(Slurm may send it before the tasks exist: the trainer's own time-limit watch then stops for
the requeue); and a plain `scancel`, which cancels.

The jobs run side by side (one shared fixture); each test checks one of them.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rhymerl.launch.slurm import render_script
from rhymerl.outputs.checkpoint import verify_checkpoint
from rhymerl.config import load_config
from slurm_helpers import (REPO, TERMINAL, SlurmJob, follow_jobs, job_info, slurm_cluster,  # noqa: F401
                           start_job)
from wandb_helpers import history_by_step, offline_runs, run_record, wandb_disagreements

pytestmark = [pytest.mark.cpu, pytest.mark.integration, pytest.mark.slurm, pytest.mark.slow]

CONFIG = REPO / "configs" / "tiny-cpu.yaml"


@dataclass
class Case:
    tasks: int
    steps: int
    # Shell command sent (with the job id appended) once the first periodic checkpoint exists.
    trigger: tuple[str, ...] = ()
    slurm: dict = field(default_factory=dict)
    # When the trigger is sent: once the first periodic checkpoint exists, or as soon as the
    # batch shell has printed its start banner (it still prepares the rendezvous and starts the
    # tasks). Not at RUNNING: slurmctld says RUNNING before slurmstepd has started the batch
    # shell, and a signal sent then reaches no process and is lost.
    trigger_when: str = "checkpoint"


CASES = {
    "usr1-tasks": Case(tasks=2, steps=6, trigger=("scancel", "--signal=USR1")),
    # Steps take about a second here: enough steps remain after the trigger for the notice to
    # land before the last one.
    "usr1-batch": Case(tasks=1, steps=8, trigger=("scancel", "--batch", "--signal=USR1")),
    "usr1-batch-early": Case(tasks=1, steps=2, trigger=("scancel", "--batch", "--signal=USR1"),
                             trigger_when="started"),
    # A real time limit: Slurm sends its warning once <= lead + 30 s are left, at a check about
    # every 30 s: here at any time from the job's start, the tasks possibly not yet running.
    # The time-limit watch stops the first segment after its first step anyway (startup alone
    # leaves < lead); the second segment runs the last step. Three minutes a segment: with six
    # jobs on two busy cores a segment's startup alone has taken 90 s.
    "limit-batch": Case(tasks=1, steps=2, slurm={"time": "00:03:00", "signal_lead_s": 170, "signal_batch": True}),
    "limit-tasks": Case(tasks=1, steps=2, slurm={"time": "00:03:00", "signal_lead_s": 170}),
    "cancel": Case(tasks=1, steps=8, trigger=("scancel",)),
}


@dataclass
class Ran:
    job: SlurmJob
    run_dir: Path
    case: Case
    triggered_at_step: int = -1


def _submit(tmp: Path, name: str, case: Case) -> Ran:
    run_dir, log_root = tmp / name / "run", tmp / name / "slurm-logs"
    slurm = {"time": "00:10:00", "signal_lead_s": 60, **case.slurm}
    ov = ["model.path=builtin:tiny", f"parallel.tensor_parallel={case.tasks}", f"slurm.tasks_per_node={case.tasks}",
          f"run.name={name}", f"run.output_dir={run_dir}", f"slurm.log_dir={log_root}", f"run.max_steps={case.steps}",
          "run.epochs=100", "data.size=8", "data.prompts_per_step=4", "rollout.max_tokens=16", "reward.workers=1",
          "tracking.wandb=offline", "checkpoint.every_steps=1", "checkpoint.keep_last=2",
          *(f"slurm.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in slurm.items())]
    cfg = load_config(CONFIG, ov)
    text = render_script(cfg.slurm, cfg.parallel, job_name=name, config_path=CONFIG, overrides=ov, workdir=REPO)
    lead = f"--signal={'B:' if slurm.get('signal_batch') else ''}USR1@{slurm['signal_lead_s']}"
    assert f"#SBATCH {lead}" in text and "#SBATCH --requeue" in text
    return Ran(start_job(text, log_root, name, env={"PYTHONUNBUFFERED": "1"}), run_dir, case)


def _batch_started(r: Ran) -> bool:
    return f"job {r.job.job_id} restart 0 on" in r.job.batch_text


def _first_checkpoint(run_dir: Path) -> int:
    """Step of the newest complete checkpoint, -1 if none."""
    steps = [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step-*")
             if verify_checkpoint(p, hashes=False) is None]
    return max(steps, default=-1)


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory) -> dict[str, Ran]:
    tmp = tmp_path_factory.mktemp("slurm-trainer")
    ran = {name: _submit(tmp, name, case) for name, case in CASES.items()}

    def tick(r: Ran) -> bool:
        if r.job.state in TERMINAL:
            return True
        if (r.case.trigger and r.triggered_at_step < 0 and r.job.state == "RUNNING"
                and (_batch_started(r) if r.case.trigger_when == "started" else _first_checkpoint(r.run_dir) >= 1)):
            r.triggered_at_step = max(_first_checkpoint(r.run_dir), 0)
            subprocess.run([*r.case.trigger, r.job.job_id], check=True, timeout=10)
        return False

    follow_jobs(ran, tick)
    return ran


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_requeued_and_completed(r: Ran, reasons: tuple[str, ...] = ("received SIGUSR1",)) -> None:
    log = r.job.log_text
    assert r.job.state == "COMPLETED" and r.job.restarts >= 1, log
    assert any(x in log for x in reasons) and "job requeued" in log and "resumed from" in log, log
    assert "Traceback" not in log and "CheckpointError" not in log, log
    # Every step exactly once across the segments, in order; W&B got each of them, in one run.
    n = r.case.steps
    assert _steps(r.run_dir) == list(range(n)), log
    runs = offline_runs(r.run_dir)
    assert len(runs) == r.job.restarts + 1, runs
    logged = sorted(s for run in runs for s in history_by_step(run))
    assert logged == list(range(n)), logged
    assert len({run_record(run)["run_id"] for run in runs}) == 1
    assert wandb_disagreements(r.run_dir) == [], log
    final = r.run_dir / "checkpoints" / f"step-{n:06d}"
    assert verify_checkpoint(final) is None
    assert "finished in" in r.job.rank_logs[0], log


def test_scancel_usr1_to_tasks_preempts_two_rank_job(jobs):
    r = jobs["usr1-tasks"]
    _check_requeued_and_completed(r)
    # The preemption save came after a periodic one (the helper processes existed already).
    assert r.triggered_at_step >= 1
    assert re.search(r"preempted after step \d+: checkpoint saved, job requeued", r.job.rank_logs[0])


BATCH_NOTICE = "batch shell got USR1; notice to the tasks"
TIME_WATCH = ("received SIGUSR1", "will checkpoint and requeue now")


def test_scancel_batch_usr1_reaches_the_trainer_and_preempts(jobs):
    r = jobs["usr1-batch"]
    _check_requeued_and_completed(r)
    assert BATCH_NOTICE in r.job.batch_text
    assert "received SIGUSR1 through the batch shell" in r.job.rank_logs[0], r.job.log_text


def test_batch_usr1_while_the_job_starts_preempts(jobs):
    # The shell gets the signal while it prepares the rendezvous or srun starts the tasks: it
    # must survive it, and the trainer must still act on it.
    r = jobs["usr1-batch-early"]
    _check_requeued_and_completed(r)
    assert BATCH_NOTICE in r.job.batch_text
    assert "preempted after step 1: checkpoint saved, job requeued" in r.job.rank_logs[0], r.job.log_text


def test_time_limit_batch_signal_preempts(jobs):
    r = jobs["limit-batch"]
    _check_requeued_and_completed(r, TIME_WATCH)
    assert "time-limit watch: " in r.job.rank_logs[0], r.job.log_text


def test_time_limit_task_signal_preempts(jobs):
    r = jobs["limit-tasks"]
    _check_requeued_and_completed(r, TIME_WATCH)
    # Rank 0 read the job's time left from squeue at the start of each segment.
    assert r.job.rank_logs[0].count("time-limit watch: ") >= 2, r.job.log_text


def test_scancel_cancels_in_one_call_with_a_checkpoint(jobs):
    r = jobs["cancel"]
    log = r.job.log_text
    assert r.triggered_at_step >= 1, log
    time.sleep(3)  # a requeue would show up as a restart by now
    r.job.info = job_info(r.job.job_id)
    assert r.job.state == "CANCELLED" and r.job.restarts == 0, log
    assert "received SIGTERM: will checkpoint and stop without requeueing" in log, log
    assert "requeue" not in r.job.rank_logs[0].replace("without requeueing", "").replace("not requeued", ""), log
    m = re.search(r"stopped after step (\d+) on SIGTERM: checkpoint saved, job not requeued", r.job.rank_logs[0])
    assert m, log
    assert verify_checkpoint(r.run_dir / "checkpoints" / f"step-{int(m.group(1)):06d}") is None
