"""Tracker against the real wandb client in offline mode, read back with wandb's own reader."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from rhymerl.config import TrackingConfig
from rhymerl.outputs.tracking import Tracker

from wandb_helpers import history_by_step, offline_runs, run_record

pytestmark = [pytest.mark.cpu, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]


def _tracker(run_dir: Path, **kw) -> Tracker:
    cfg_kw = {k: kw.pop(k) for k in list(kw) if k in TrackingConfig.__dataclass_fields__}
    return Tracker(TrackingConfig(**cfg_kw), run_dir, "test-run", {"algo": {"lr": 1e-5}}, **kw)


def test_metrics_histograms_and_tables_land_at_their_steps(tmp_path):
    tr = _tracker(tmp_path, log_samples_every=2, console="none")
    for step in range(1, 6):
        with tr.phase("rollout", step):
            time.sleep(0.002)
        # The trainer's order: metrics first, then the step's histogram and table.
        tr.log(step, {"reward/mean": step / 10, "train/loss": 1.0 / step})
        tr.log_lengths(step, [step, 2 * step, 10 * step])
        tr.log_samples(step, [{"prompt": f"q{step}", "response": "a" * step, "reward": 1.0}])
        if step % 2:
            tr.flush()
    tr.finish()
    [run] = offline_runs(tmp_path)
    assert run.name.endswith(tr.run_id)
    hist = history_by_step(run)
    assert sorted(hist) == [1, 2, 3, 4, 5]
    for step, row in hist.items():
        assert row["reward/mean"] == pytest.approx(step / 10)
        assert row["rollout/response_length_max"] == 10 * step
        assert row["rollout/response_length_hist._type"] == "histogram"
        assert sum(row["rollout/response_length_hist.values"]) == 3
        assert row["time/rollout_s"] > 0
        assert ("samples._type" in row) == (step % 2 == 0)
    assert hist[4]["samples.nrows"] == 1
    assert run_record(run)["config"]["update"]["algo"] == {"lr": 1e-5}
    assert list((run / "files" / "media" / "table").glob("samples_*.table.json"))


def test_resumed_tracker_keeps_run_id_and_step_axis(tmp_path):
    first = _tracker(tmp_path, console="none")
    for step in (1, 2, 3):
        first.log(step, {"x": step})
    run_id = first.run_id
    first.finish()
    second = _tracker(tmp_path, console="none", resume_run_id=run_id)
    assert second.run_id == run_id
    for step in (4, 5):
        second.log(step, {"x": step})
    second.finish()
    runs = offline_runs(tmp_path)
    assert len(runs) == 2, runs  # offline: one folder per process, merged by `wandb sync`
    assert {run_record(r)["run_id"] for r in runs} == {run_id}
    steps = [sorted(history_by_step(r)) for r in runs]
    assert steps == [[1, 2, 3], [4, 5]]


def test_sigkilled_process_keeps_its_logged_steps(tmp_path):
    # The 1 s transaction-log flush is what keeps data when Slurm kills a job outright.
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from rhymerl.config import TrackingConfig
        from rhymerl.outputs.tracking import Tracker
        tr = Tracker(TrackingConfig(console="none"), Path({str(tmp_path)!r}), "killed", {{}})
        for step in range(1, 4):
            tr.log(step, {{"x": step}})
            tr.log_lengths(step, [step])
            tr.flush()
        print("logged", flush=True)
        time.sleep(60)
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "logged"
        time.sleep(2.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    [run] = offline_runs(tmp_path)
    hist = history_by_step(run)
    assert sorted(hist) == [1, 2, 3] and [hist[s]["rollout/response_length_max"] for s in (1, 2, 3)] == [1, 2, 3]


def test_invalid_mode_at_init_warns_and_training_continues(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"(?s)W&B init failed.*training continues without W&B"):
        tr = _tracker(tmp_path, wandb="no-such-mode", console="none")
    assert not tr.active
    tr.log_lengths(1, [1, 2])
    assert not tr.log_samples(5, [{"a": 1}])
    tr.log(1, {"x": 1})
    tr.finish()


def test_raising_wandb_call_warns_once(tmp_path):
    tr = _tracker(tmp_path, console="none")
    tr.log(1, {"x": 1}, commit=True)
    tr._run.finish()  # wandb itself now raises UsageError on every log call
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in (2, 3, 4):
            tr.log(step, {"x": step}, commit=True)
    msgs = [str(w.message) for w in seen if "W&B" in str(w.message)]
    assert len(msgs) == 1 and "W&B log failed" in msgs[0]
    assert tr.failures == 3
    tr.finish()


def test_only_rank0_writes(tmp_path):
    tr = _tracker(tmp_path, rank=1, resume_run_id="abc12345", console="plain")
    tr.log(1, {"x": 1})
    tr.finish()
    assert tr.run_id == "abc12345"
    assert not (tmp_path / "wandb").exists()
