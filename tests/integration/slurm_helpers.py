"""Reusable helpers for tests against the local Slurm started by .ci/slurm-up.sh.

`slurm_cluster` (fixture) skips with the reason when no cluster answers; `submit_and_wait`
submits a script and waits for the job to finish (following requeues), returning its logs.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import pytest

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONF = Path(os.environ.get("RHYMERL_SLURM_DIR", "/tmp/rhymerl-slurm")) / "slurm.conf"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _ensure_conf() -> None:
    if "SLURM_CONF" not in os.environ and DEFAULT_CONF.is_file():
        os.environ["SLURM_CONF"] = str(DEFAULT_CONF)


def slurm_unavailable_reason() -> Optional[str]:
    _ensure_conf()
    try:
        res = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=5)
    except FileNotFoundError:
        return "sinfo not installed; run .ci/slurm-up.sh to install and start a local Slurm"
    except subprocess.TimeoutExpired:
        return "sinfo timed out; is slurmctld running? (.ci/slurm-up.sh)"
    if res.returncode != 0:
        return f"sinfo failed ({res.stderr.strip()[:200]}); start the local cluster with .ci/slurm-up.sh"
    states = res.stdout.split()
    if not any(s.rstrip("*~#") in ("idle", "mixed", "allocated", "completing") for s in states):
        return f"no usable Slurm node (sinfo states: {states or 'none'}); run .ci/slurm-up.sh"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> str:
    reason = slurm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    return os.environ.get("SLURM_CONF", "")


def job_info(job_id: str, client: Sequence[str] = ()) -> dict[str, str]:
    """``client``: a command prefix that runs Slurm clients elsewhere (a login node's wrapper)."""
    out = subprocess.run([*client, "scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                         timeout=10).stdout
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", out))


@dataclass
class SlurmJob:
    job_id: str
    info: dict[str, str]
    batch_log: Path
    job_log_dir: Path
    elapsed_s: float = 0.0
    rank_logs: dict[int, str] = field(default_factory=dict)

    @property
    def state(self) -> str:
        return self.info.get("JobState", "?")

    @property
    def restarts(self) -> int:
        return int(self.info.get("Restarts", "0"))

    @property
    def batch_text(self) -> str:
        return self.batch_log.read_text() if self.batch_log.is_file() else ""

    def refresh_logs(self) -> None:
        self.rank_logs = {int(p.stem.split("-")[1]): p.read_text() for p in sorted(self.job_log_dir.glob("rank-*.log"))}

    @property
    def log_text(self) -> str:
        self.refresh_logs()
        parts = [f"==> batch log {self.batch_log}\n{self.batch_text}"]
        parts += [f"==> rank {r}\n{t}" for r, t in sorted(self.rank_logs.items())]
        return "\n".join(parts)


def submit(script: Path, env: Optional[Mapping[str, str]] = None) -> str:
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONPATH", str(REPO))
    full_env.update(env or {})
    res = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=30,
                         env=full_env)
    assert res.returncode == 0, f"sbatch failed: {res.stderr}"
    return res.stdout.strip().split(";")[0]


def wait_until(pred: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.25) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def wait_job(job: SlurmJob, timeout_s: float, min_restarts: int = 0, client: Sequence[str] = ()) -> SlurmJob:
    """Wait until the job is terminal (and has restarted ``min_restarts`` times); cancel on timeout."""
    t0 = time.monotonic()

    def done() -> bool:
        job.info = job_info(job.job_id, client)
        return job.state in TERMINAL and (job.restarts >= min_restarts or job.state != "COMPLETED")

    try:
        wait_until(done, timeout_s, f"job {job.job_id}")
    except TimeoutError:
        subprocess.run([*client, "scancel", job.job_id], timeout=10)
        pytest.fail(f"job {job.job_id} did not finish within {timeout_s} s (state {job.state}, "
                    f"restarts {job.restarts})\n{job.log_text}")
    job.elapsed_s += time.monotonic() - t0
    job.refresh_logs()
    return job


def start_job(script_text: str, log_root: Path, job_name: str, env: Optional[Mapping[str, str]] = None) -> SlurmJob:
    log_root.mkdir(parents=True, exist_ok=True)
    script = log_root / f"{job_name}.sbatch"
    script.write_text(script_text)
    job_id = submit(script, env)
    return SlurmJob(job_id=job_id, info={}, batch_log=log_root / f"{job_name}-{job_id}.out",
                    job_log_dir=log_root / f"{job_name}-{job_id}")


def submit_and_wait(script_text: str, log_root: Path, job_name: str, timeout_s: float = 60,
                    env: Optional[Mapping[str, str]] = None) -> SlurmJob:
    """Submit the rendered script (its --output must be log_root/%x-%j.out) and wait for the end."""
    t0 = time.monotonic()
    job = wait_job(start_job(script_text, log_root, job_name, env), timeout_s)
    job.elapsed_s = time.monotonic() - t0
    return job



def follow_jobs(ran: Mapping[str, object], tick: Callable[[object], bool], timeout_s: float = 600) -> None:
    """Poll the jobs of ``ran`` (name -> object with a ``job``) until each is done: ``tick(r)``
    runs with fresh job info and says whether ``r`` is done (it may act on the job meanwhile).
    Jobs still running at the deadline, or when an error escapes, are cancelled; the deadline
    fails the test naming each one's state."""
    deadline = time.monotonic() + timeout_s
    pending = dict(ran)
    try:
        while pending and time.monotonic() < deadline:
            for name, r in list(pending.items()):
                r.job.info = job_info(r.job.job_id)
                if tick(r):
                    r.job.refresh_logs()
                    del pending[name]
            time.sleep(0.5)
    finally:
        for r in pending.values():
            subprocess.run(["scancel", r.job.job_id], timeout=10)
    if pending:
        pytest.fail(f"jobs did not finish within {timeout_s:.0f} s: "
                    + "; ".join(f"{n} {r.job.state} restarts={r.job.restarts}\n{r.job.log_text}"
                                for n, r in pending.items()))
