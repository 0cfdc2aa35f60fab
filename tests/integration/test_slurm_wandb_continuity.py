"""The real trainer under the local Slurm (.ci/slurm-up.sh): after `scontrol requeue` (what a
cluster's preemption does), after `scancel`, and after a save that fails (its disk full, then
room made and the job submitted again), W&B's offline history equals metrics.jsonl step for step,
and the log says truly whether the job was requeued. (A time-limit preemption is checked the
same way in test_slurm_trainer.py.)

The jobs run side by side (one shared fixture); each test checks one of them.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from rhymerl.config import load_config
from rhymerl.launch.slurm import render_script
from rhymerl.outputs.checkpoint import verify_checkpoint
from slurm_helpers import (REPO, TERMINAL, SlurmJob, follow_jobs, job_info, slurm_cluster,  # noqa: F401
                           start_job)
from wandb_helpers import wandb_disagreements

pytestmark = [pytest.mark.cpu, pytest.mark.integration, pytest.mark.slurm, pytest.mark.slow]

CONFIG = REPO / "configs" / "tiny-cpu.yaml"
STEPS = 8
# A checkpoint of the tiny model takes about 4.9 MB: two fit, a third does not.
SMALL_FS = "12m"


@dataclass
class Case:
    trigger: tuple[str, ...] = ()
    overrides: list[str] = field(default_factory=list)
    small_fs: bool = False


CASES = {
    "requeue": Case(trigger=("scontrol", "requeue")),
    "cancel": Case(trigger=("scancel",)),
    "full-disk": Case(overrides=["checkpoint.every_steps=2"], small_fs=True),
}


@dataclass
class Ran:
    job: SlurmJob
    run_dir: Path
    case: Case
    text: str
    log_root: Path
    name: str
    mount: Optional[Path] = None
    triggered: bool = False
    first: Optional[SlurmJob] = None  # full-disk: the job whose save failed


def _script(tmp: Path, name: str, case: Case, mount: Optional[Path]) -> tuple[str, Path, Path]:
    run_dir, log_root = tmp / name / "run", tmp / name / "slurm-logs"
    ov = ["model.path=builtin:tiny", f"run.name={name}", f"run.output_dir={run_dir}", f"slurm.log_dir={log_root}",
          f"run.max_steps={STEPS}", "run.epochs=100", "data.size=8", "data.prompts_per_step=4", "rollout.max_tokens=16",
          "reward.workers=1", "tracking.wandb=offline", "checkpoint.every_steps=1", "checkpoint.keep_last=2",
          "slurm.time=00:10:00", *case.overrides, *([f"checkpoint.dir={mount}"] if mount else [])]
    cfg = load_config(CONFIG, ov)
    return render_script(cfg.slurm, cfg.parallel, job_name=name, config_path=CONFIG, overrides=ov, workdir=REPO), \
        run_dir, log_root


def _mount_small(path: Path) -> bool:
    path.mkdir(parents=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_FS}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _checkpoints(r: Ran) -> list[int]:
    root = r.mount or r.run_dir / "checkpoints"
    return [int(p.name[5:]) for p in root.glob("step-*") if verify_checkpoint(p, hashes=False) is None]


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory) -> dict[str, Ran]:
    tmp = tmp_path_factory.mktemp("slurm-wandb")
    ran: dict[str, Ran] = {}
    mounts = []
    try:
        for name, case in CASES.items():
            mount = tmp / name / "ckpt" if case.small_fs else None
            if mount is not None:
                if not _mount_small(mount):
                    continue  # not root: the test of this case skips and says why
                mounts.append(mount)
            text, run_dir, log_root = _script(tmp, name, case, mount)
            job = start_job(text, log_root, name, env={"PYTHONUNBUFFERED": "1"})
            ran[name] = Ran(job, run_dir, case, text, log_root, name, mount)
        _follow(ran)
    finally:
        for m in mounts:
            subprocess.run(["umount", "-l", str(m)], timeout=30)
    return ran


def _follow(ran: dict[str, Ran]) -> None:
    def tick(r: Ran) -> bool:
        if r.job.state in TERMINAL and not (r.case.small_fs and r.first is None):
            return True
        if r.job.state in TERMINAL:
            # The save that did not fit failed the job: make room, then submit it again.
            r.job.refresh_logs()
            r.first = r.job
            subprocess.run(["mount", "-o", "remount,size=64m", str(r.mount)], check=True, timeout=30)
            r.job = start_job(r.text, r.log_root, r.name, env={"PYTHONUNBUFFERED": "1"})
        elif r.case.trigger and not r.triggered and r.job.state == "RUNNING" and max(_checkpoints(r),
                                                                                        default=0) >= 2:
            r.triggered = True
            subprocess.run([*r.case.trigger, r.job.job_id], check=True, timeout=10)
        return False

    follow_jobs(ran, tick)


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _ran(jobs: dict[str, Ran], name: str) -> Ran:
    if name not in jobs:
        pytest.skip(f"case {name} needs a tmpfs mount (root)")
    return jobs[name]


def test_scontrol_requeue_keeps_wandb_whole_and_says_requeued(jobs):
    r = _ran(jobs, "requeue")
    log = r.job.log_text
    assert r.triggered and r.job.state == "COMPLETED" and r.job.restarts >= 1, log
    assert re.search(r"stopped after step \d+ on SIGTERM: checkpoint saved, job requeued by Slurm", log), log
    assert "not requeued" not in log and "resumed from" in log, log
    assert _steps(r.run_dir) == list(range(STEPS)), log
    assert wandb_disagreements(r.run_dir) == [], log
    assert "Traceback" not in log, log


def test_scancel_keeps_wandb_whole_and_says_not_requeued(jobs):
    r = _ran(jobs, "cancel")
    log = r.job.log_text
    assert r.triggered and r.job.state == "CANCELLED" and r.job.restarts == 0, log
    m = re.search(r"stopped after step (\d+) on SIGTERM: checkpoint saved, job not requeued", log)
    assert m, log
    assert _steps(r.run_dir) == list(range(int(m.group(1)))), log
    assert wandb_disagreements(r.run_dir) == [], log
    assert "Traceback" not in log, log


def test_full_disk_is_named_and_the_resumed_run_keeps_wandb_single(jobs):
    r = _ran(jobs, "full-disk")
    first_log = r.first.log_text
    assert r.first.state == "FAILED", first_log
    line = next((x for x in first_log.splitlines() if "checkpoint error" in x), "")
    assert "step-000006 not saved: No space left on device in " + str(r.mount) in line, first_log
    assert "the newest checkpoint, step-000004, is intact" in line and "Traceback" not in first_log, first_log
    log = r.job.log_text
    assert r.job.state == "COMPLETED" and "resumed from" in log and "step-000004" in log, log
    assert _steps(r.run_dir) == list(range(STEPS)), log
    assert wandb_disagreements(r.run_dir) == [], log
