"""A rank killed outright (SIGKILL, as the OOM killer does): every surviving rank stops within
seconds with one line naming the dead rank and its host, and no traceback on its console (that
goes to its error log). First over a bare gloo world, then the real trainer under two ranks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rhymerl.training.local_launch import free_port
from slurm_helpers import wait_until

pytestmark = [pytest.mark.cpu, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]
HOST = socket.gethostname()


def _start(cmd: list[str], world: int, log_dir: Path) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'integration'}", "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        env.pop("SLURM_JOB_ID", None)
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log_dir / f"out-{rank}", "w"),
                                      stderr=open(log_dir / f"err-{rank}", "w")))
    return procs


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)


@pytest.mark.parametrize("victim", [1, 0])
def test_every_survivor_names_the_killed_rank(tmp_path, victim):
    procs = _start([sys.executable, str(REPO / "tests" / "integration" / "peer_watch_worker.py"), str(tmp_path)], 3,
                   tmp_path)
    try:
        wait_until(lambda: all((tmp_path / f"out-{r}").read_text().startswith("ready") for r in range(3)), 120,
                   "three ranks all-gathering")
        t0 = time.monotonic()
        procs[victim].send_signal(signal.SIGKILL)
        survivors = [r for r in range(3) if r != victim]
        wait_until(lambda: all(procs[r].poll() is not None for r in survivors), 60, "the survivors to stop")
        took = time.monotonic() - t0
    finally:
        _stop(procs)
    print(f"survivors of rank {victim} stopped {took:.1f} s after its SIGKILL")
    for r in survivors:
        err = (tmp_path / f"err-{r}").read_text()
        line = err.strip().splitlines()[-1]
        assert procs[r].returncode == 8, err
        note = ", which held the rendezvous store" if victim == 0 else ""
        assert f"lost rank error: rank {victim} on host {HOST} (pid {procs[victim].pid}{note}) died during step" \
            in line, err
        assert "Traceback" not in err, err
        log = tmp_path / (f"error-rank{r}.log" if r else "error.log")
        assert "Connection" in log.read_text() and "Traceback" in log.read_text()
    assert took < 30, took


def test_trainer_rank_killed_mid_run_is_named_by_rank0(tmp_path):
    run_dir = tmp_path / "run"
    overrides = ["model.path=builtin:tiny", "parallel.tensor_parallel=2", f"run.output_dir={run_dir}",
                 "run.max_steps=50", "data.size=8", "data.prompts_per_step=2", "rollout.max_tokens=8",
                 "reward.workers=1", "tracking.wandb=disabled", "checkpoint.every_steps=0"]
    procs = _start([sys.executable, "-m", "rhymerl.launch.rank_main", str(REPO / "configs" / "tiny-cpu.yaml"),
                    *overrides], 2, tmp_path)
    metrics, err0 = run_dir / "metrics.jsonl", tmp_path / "err-0"
    try:
        wait_until(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1, 300, "the first step")
        t0 = time.monotonic()
        procs[1].send_signal(signal.SIGKILL)
        wait_until(lambda: "lost rank error" in err0.read_text(), 60, "rank 0 to name the lost rank")
        named = time.monotonic() - t0
        procs[0].wait(60)
    finally:
        _stop(procs)
    print(f"rank 0 named the killed rank {named:.1f} s after its SIGKILL")
    err = err0.read_text()
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    line = next(x for x in err.splitlines() if "lost rank error" in x)
    assert procs[0].returncode == 8, err
    assert line.startswith(f"rhymerl: lost rank error: rank 1 on host {HOST} (pid {procs[1].pid}) died during "
                           "step "), line
    assert int(line.split("died during step ")[1].split(";")[0]) in (steps[-1], steps[-1] + 1)
    assert "Traceback" not in err, err
    assert "Connection" in (run_dir / "error.log").read_text()
    assert named < 30, named
