"""Helper processes ignore the job's signals (as Slurm sends them to every process of a job)
and die with their parent, however it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu]

REPO = Path(__file__).resolve().parents[2]

# A parent holding a reward pool (fork-server workers) and megatron's kind of results
# queue (a spawned Manager); it survives the job's signals through its own handler.
PARENT = textwrap.dedent("""
    import os, signal, sys, time
    from rhymerl.launch.preemption import PreemptionHandler
    from rhymerl.launch.child_signals import start_shielded_manager
    from rhymerl.config import RewardConfig
    from rhymerl.rewards import RewardItem, RewardPool

    handler = PreemptionHandler(verbose=False)
    mgr = start_shielded_manager()
    queue = mgr.Queue()
    pool = RewardPool(RewardConfig(workers=1, timeout_s=30), preload=())
    pool.wait_ready()
    print("PIDS", mgr._process.pid, *pool.worker_pids, flush=True)
    while True:
        line = sys.stdin.readline()
        if not line:
            break
        queue.put(line)
        [res] = pool.score([RewardItem(response_text="42", answer="42", kind="exact")])
        print("OK", queue.get().strip(), res.score, handler.signal_name, flush=True)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_helpers_survive_job_signals_and_die_with_the_parent():
    proc = subprocess.Popen([sys.executable, "-c", PARENT], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        first = proc.stdout.readline().split()
        assert first[:1] == ["PIDS"], first
        helpers = [int(p) for p in first[1:]]
        # As Slurm does: every process of the job, helpers included.
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            os.killpg(proc.pid, sig)
            time.sleep(0.3)
            proc.stdin.write(f"after-{sig.name}\n")
            proc.stdin.flush()
            assert proc.stdout.readline().split() == ["OK", f"after-{sig.name}", "1.0", "SIGUSR1"]
        assert all(_alive(p) for p in helpers)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in helpers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in helpers if _alive(p)], "helpers outlived their parent's SIGKILL"
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
