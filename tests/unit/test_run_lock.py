"""Who may take a run folder: the decision alone (pure), then the real lock between processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rhymerl.outputs.run_lock import (GRACE_S, OWNER_NAME, STALE_S, Owner, RunFolderBusy, RunFolderLock, read_owner,
                                      verdict)

pytestmark = pytest.mark.cpu
REPO = Path(__file__).resolve().parents[2]
NOW = 1_000_000.0


def _owner(host="a", pid=10, job="", beat_age=1.0) -> Owner:
    return Owner(host=host, pid=pid, pid_start=5, job_id=job, restart=0, started=NOW - 100, heartbeat=NOW - beat_age)


ME = _owner(pid=99)


@pytest.mark.parametrize("locked,owner,alive,expected", [
    (True, None, True, "take"),                                   # nobody ever owned it
    (True, _owner(), False, "take"),                              # killed on this host: reusable at once
    (True, _owner(), True, "refuse"),                             # a live owner here (the lock was not honoured)
    (True, _owner(host="b", beat_age=2), True, "refuse"),         # another host, beating: node-local locks
    (True, _owner(host="b", beat_age=STALE_S + 1), True, "take"),  # another host, silent: gone
    (False, _owner(), True, "refuse"),                            # another run holds it
    (False, None, True, "wait"),                                  # locked, owner file not yet written
])
def test_verdict_outside_slurm(locked, owner, alive, expected):
    assert verdict(locked, owner, ME, NOW, alive=lambda pid, start: alive) == expected


def test_verdict_a_requeued_segment_waits_for_its_predecessor():
    me = _owner(pid=99, job="77")
    assert verdict(False, _owner(job="77"), me, NOW, alive=lambda *_: True) == "wait"
    assert verdict(True, _owner(host="b", job="77", beat_age=2), me, NOW, alive=lambda *_: True) == "wait"
    assert verdict(False, _owner(job="78"), me, NOW, alive=lambda *_: True) == "refuse"


HOLDER = textwrap.dedent("""
    import sys, time
    from rhymerl.outputs.run_lock import RunFolderLock
    lock = RunFolderLock([sys.argv[1]]).acquire()
    print("locked", flush=True)
    time.sleep(120)
""")


def _hold(folder: Path, **env) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def test_second_owner_is_refused_naming_the_first_and_a_killed_owner_frees_it(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    holder = _hold(tmp_path, SLURM_JOB_ID="4242")
    try:
        t0 = time.monotonic()
        with pytest.raises(RunFolderBusy) as e:
            RunFolderLock([tmp_path]).acquire()
        assert time.monotonic() - t0 < 5
        assert f"Slurm job 4242 (restart 0), host {os.uname().nodename}, pid {holder.pid}" in str(e.value)
    finally:
        _kill(holder)
    # SIGKILL leaves the owner file behind; the lock went with the process.
    assert read_owner(tmp_path).pid == holder.pid
    t0 = time.monotonic()
    with RunFolderLock([tmp_path]).acquire() as lock:
        assert time.monotonic() - t0 < GRACE_S
        assert read_owner(tmp_path).pid == os.getpid() == lock.me.pid
    assert not (tmp_path / OWNER_NAME).exists()


def test_requeued_segment_waits_for_the_old_one_to_let_go(tmp_path, monkeypatch):
    holder = _hold(tmp_path, SLURM_JOB_ID="77", SLURM_RESTART_COUNT="0")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    got: dict = {}

    def take() -> None:
        got["lock"] = RunFolderLock([tmp_path]).acquire()
        got["at"] = time.monotonic()

    waiter = threading.Thread(target=take)
    waiter.start()
    try:
        time.sleep(1.0)
        assert "lock" not in got and waiter.is_alive()
        ended = time.monotonic()
        holder.terminate()  # the old segment ends
        waiter.join(30)
        assert "lock" in got and got["at"] - ended < 5
        assert read_owner(tmp_path).restart == 1
    finally:
        _kill(holder)
        if "lock" in got:
            got["lock"].release()
