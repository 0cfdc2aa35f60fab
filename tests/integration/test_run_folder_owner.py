"""Two `python -m rhymerl train` commands on one output folder, as a user would type them: the
second is refused at once, naming the first, and writes nothing; a killed run's folder is
reusable at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_helpers import wait_until

pytestmark = [pytest.mark.cpu, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]


def _train(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "rhymerl", "train", str(REPO / "configs" / "tiny-cpu.yaml"),
            "model.path=builtin:tiny", f"run.output_dir={run_dir}", "run.max_steps=2", "data.size=4",
            "data.prompts_per_step=2", "rollout.max_tokens=8", "reward.workers=1", "tracking.wandb=offline"]


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def _owner_pid(run_dir: Path):
    """The pid owner.json names (None while there is none)."""
    try:
        return json.loads((run_dir / "owner.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def _first_run_started(run_dir: Path) -> bool:
    # With an owner file once runs own their folder; by the first files it writes otherwise.
    return _owner_pid(run_dir) is not None or (run_dir / "wandb").exists()


def test_second_run_on_a_folder_is_refused_naming_the_owner(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SLURM_JOB_ID", None)
    first = subprocess.Popen(_train(run_dir), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second = None
    try:
        wait_until(lambda: _first_run_started(run_dir), 300, "the first run to take its folder")
        # Frozen, the first run writes nothing more: whatever changes now, the second run wrote.
        first.send_signal(signal.SIGSTOP)
        before = _snapshot(run_dir)
        t0 = time.monotonic()
        second = subprocess.Popen(_train(run_dir), cwd=REPO, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        out, err = second.communicate(timeout=30)
        took = time.monotonic() - t0
        print(f"second run refused after {took:.2f} s")
        lines = err.strip().splitlines()
        assert second.returncode == 7, err
        assert lines[-1].startswith(f"rhymerl: run folder error: {run_dir.resolve()} is in use by another run "), err
        assert f"pid {first.pid}" in lines[-1] and "Traceback" not in err
        assert took < 5, took
        assert _snapshot(run_dir) == before
    finally:
        if second is not None and second.poll() is None:
            second.kill()
            second.wait(10)
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    # Killed, the first run leaves its owner file; the folder is free at once all the same.
    from rhymerl.outputs.run_lock import GRACE_S, OWNER_NAME, RunFolderLock

    assert _owner_pid(run_dir) == first.pid
    t0 = time.monotonic()
    with RunFolderLock([run_dir]).acquire():
        assert time.monotonic() - t0 < GRACE_S
    assert not (run_dir / OWNER_NAME).exists()
