"""W&B agrees with metrics.jsonl, step for step, when its service dies with the job's SIGTERM
and when a resumed run repeats steps W&B already holds: the real wandb client offline, read
back with wandb's own reader."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rhymerl.config import TrackingConfig
from rhymerl.outputs.tracking import Tracker
from rhymerl.outputs.wandb_store import logged_steps
from wandb_helpers import history_by_step, offline_runs, run_record

pytestmark = [pytest.mark.cpu, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]


def _rows(steps) -> list[dict]:
    return [{"step": s, "reward/mean": s / 10, "train/loss": 1.0 / (s + 1)} for s in steps]


def _history(run_dir: Path) -> list[tuple[int, float]]:
    """(step, reward/mean) of every history row of every process of the run, in file order."""
    return [(s, row["reward/mean"]) for run in offline_runs(run_dir) for s, row in sorted(history_by_step(run).items())]


KILLED_SERVICE = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from rhymerl.config import TrackingConfig
    from rhymerl.outputs.tracking import Tracker

    rows = [{"step": s, "reward/mean": s / 10, "train/loss": 1.0 / (s + 1)} for s in range(5)]
    tr = Tracker(TrackingConfig(console="none"), Path(sys.argv[1]), "killed-service", {})
    for row in rows[:3]:
        tr.log(row["step"], {k: v for k, v in row.items() if k != "step"}); tr.flush()
    time.sleep(2)
    # What scancel / scontrol requeue do to every process of the job: wandb-core gets SIGTERM.
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if "(wandb-core)" in stat and int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                os.kill(int(d.name), signal.SIGTERM)
    time.sleep(1)
    for row in rows[3:]:
        tr.log(row["step"], {k: v for k, v in row.items() if k != "step"}); tr.flush()
    print("repaired", tr.repair(rows), flush=True)
""")


def test_steps_lost_with_a_killed_service_are_logged_before_exit(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", KILLED_SERVICE, str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert "repaired [3, 4]" in res.stdout, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert _history(tmp_path) == [(s, s / 10) for s in range(5)]
    assert len({run_record(r)["run_id"] for r in offline_runs(tmp_path)}) == 1


def _tracker(run_dir: Path, run_id=None) -> Tracker:
    return Tracker(TrackingConfig(console="none"), run_dir, "resumed", {}, resume_run_id=run_id)


def _log(tr: Tracker, steps) -> None:
    for row in _rows(steps):
        tr.log(row["step"], {k: v for k, v in row.items() if k != "step"})
        tr.flush()


def test_a_resume_logs_what_wandb_lacks_and_never_a_step_twice(tmp_path):
    # Segment 1 reached step 5 in W&B but its last checkpoint is at step 4 (a failed save):
    # the resumed run repeats steps 4 and 5, which W&B must not get twice.
    first = _tracker(tmp_path)
    _log(first, range(6))
    first.finish()
    second = _tracker(tmp_path, first.run_id)
    assert second.catch_up(_rows(range(4))) == []
    _log(second, range(4, 8))
    second.finish()
    assert _history(tmp_path) == [(s, s / 10) for s in range(8)]


def test_a_resume_logs_the_steps_an_earlier_segment_lost(tmp_path):
    # Segment 1's W&B has steps 0-2, its metrics.jsonl 0-4 (steps 3 and 4 died with wandb-core).
    first = _tracker(tmp_path)
    _log(first, range(3))
    first.finish()
    assert logged_steps(tmp_path / "wandb", first.run_id) == {0, 1, 2}
    second = _tracker(tmp_path, first.run_id)
    assert second.catch_up(_rows(range(5))) == [3, 4]
    _log(second, range(5, 7))
    second.finish()
    assert _history(tmp_path) == [(s, s / 10) for s in range(7)]
