"""Preemption notices that do not depend on Slurm's signal timing: the batch shell's notice
file (a USR1 to the shell at any moment, even before it is ready) and the trainer's own
time-limit watch."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from rhymerl.config import ParallelConfig, SlurmConfig
from rhymerl.launch import slurm as sl
from rhymerl.launch.preemption import PreemptionHandler
from rhymerl.launch.time_limit import TimeLimitWatch, parse_time_left

pytestmark = pytest.mark.cpu


def test_notice_file_is_a_usr1(tmp_path):
    notice = tmp_path / "preempt-notice.restart-0"
    h = PreemptionHandler(signals=(), verbose=False, notice_file=str(notice))
    assert not h.requested and not h.requeue_requested
    notice.touch()
    assert h.requested and h.requeue_requested and h.signal_name == "SIGUSR1"
    # Seen once: clearing the request does not bring it back from the same file.
    h.clear()
    assert not h.requested


def test_no_notice_file_configured(tmp_path, monkeypatch):
    monkeypatch.delenv("RHYMERL_PREEMPT_NOTICE", raising=False)
    h = PreemptionHandler(signals=(), verbose=False)
    assert not h.requested


def _prologue(tmp_path: Path) -> str:
    """The rendered script up to its start banner: what runs before the tasks exist."""
    text = sl.render_script(SlurmConfig(log_dir=str(tmp_path / "logs"), signal_batch=True), ParallelConfig(),
                            job_name="t", config_path=Path("configs/tiny-cpu.yaml"), overrides=[],
                            workdir=tmp_path, python="python3")
    lines = text.splitlines()
    end = next(i for i, x in enumerate(lines) if x.startswith('echo "[rhymerl-slurm] job $SLURM_JOB_ID restart'))
    return "\n".join(lines[:end + 1])


def _run_shell(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_NAME": "t", "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2",
           "SLURM_JOB_NODELIST": "n0"}
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30, cwd=tmp_path)


@pytest.mark.parametrize("when", ["before the log folder exists", "after the start banner"])
def test_batch_shell_survives_usr1_and_leaves_the_notice(tmp_path, when):
    prologue = _prologue(tmp_path)
    lines = prologue.splitlines()
    trap_at = next(i for i, x in enumerate(lines) if x.startswith("trap "))
    if when == "before the log folder exists":
        # The signal lands right after the trap is set: nothing to write the notice into yet.
        lines.insert(trap_at + 1, "kill -USR1 $$")
    else:
        lines.append("kill -USR1 $$")
    res = _run_shell("\n".join(lines + ["echo still-running"]), tmp_path)
    assert res.returncode == 0 and "still-running" in res.stdout, res
    assert "batch shell got USR1; notice to the tasks" in res.stdout
    assert (tmp_path / "logs" / "t-7" / "preempt-notice.restart-2").is_file()


def test_batch_shell_trap_comes_before_any_command(tmp_path):
    lines = _prologue(tmp_path).splitlines()
    first_command = next(i for i, x in enumerate(lines)
                         if x and not x.startswith("#") and "=" not in x.split()[0] and not x.startswith("set "))
    assert lines[first_command].startswith("trap "), lines[first_command]


def test_stale_notice_of_an_earlier_start_is_removed(tmp_path):
    folder = tmp_path / "logs" / "t-7"
    folder.mkdir(parents=True)
    (folder / "preempt-notice.restart-2").touch()
    res = _run_shell(_prologue(tmp_path), tmp_path)
    assert res.returncode == 0, res
    assert not (folder / "preempt-notice.restart-2").exists()


@pytest.mark.parametrize("text, seconds", [("1:42", 102), ("01:00:05", 3605), ("2-00:00:01", 172801),
                                           ("0:00", 0), ("UNLIMITED", None), ("NOT_SET", None),
                                           ("INVALID", None), ("", None)])
def test_parse_time_left(text, seconds):
    assert parse_time_left(text + "\n") == seconds


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_watch_stops_when_one_more_step_would_leave_less_than_the_lead():
    clock, asked = _Clock(), []

    def query():
        asked.append(clock.t)
        return 300.0 - (clock.t - 1000.0)  # a 300 s limit from t=1000

    w = TimeLimitWatch(lead_s=100, query=query, clock=clock)
    clock.t += 150  # 150 s left
    assert w.should_stop(next_step_s=40) is None  # 110 left after the step
    assert len(asked) == 1  # no squeue while far from the limit
    clock.t += 20  # 130 s left
    reason = w.should_stop(next_step_s=40)
    assert reason and "130 s left" in reason and "signal_lead_s=100" in reason
    assert len(asked) == 2  # asked again before acting


def test_watch_honours_a_raised_limit():
    clock = _Clock()
    limit = [300.0]
    w = TimeLimitWatch(lead_s=100, query=lambda: limit[0] - (clock.t - 1000.0), clock=clock)
    clock.t += 250
    limit[0] = 3600.0  # an admin raised the time limit
    assert w.should_stop(next_step_s=10) is None
    assert w.seconds_left == pytest.approx(3350.0)


def test_watch_without_a_limit_never_stops():
    w = TimeLimitWatch(lead_s=100, query=lambda: None)
    assert w.seconds_left is None and w.should_stop(next_step_s=1e9) is None


def test_handler_signal_and_notice_are_one_request(tmp_path):
    notice = tmp_path / "n"
    h = PreemptionHandler(signals=(signal.SIGUSR1,), verbose=False, notice_file=str(notice))
    try:
        signal.raise_signal(signal.SIGUSR1)
        notice.touch()
        assert h.requested and h.requeue_requested and h.signal_name == "SIGUSR1"
    finally:
        h.restore()
