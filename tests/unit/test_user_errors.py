"""User errors end a run with one line, a distinct exit code and the traceback in a log file."""

from __future__ import annotations

from pathlib import Path

import pytest

from rhymerl.launch import user_errors
from rhymerl.outputs.checkpoint import CheckpointError, IncompatibleCheckpoint
from rhymerl.config import ConfigError
from rhymerl.data.records import DatasetError
from rhymerl.models import ModelError
from rhymerl.rewards.pool import RewardErrorRate

pytestmark = pytest.mark.cpu
REPO = Path(__file__).resolve().parents[2]


def test_each_kind_has_its_own_exit_code(tmp_path, capsys):
    codes = {}
    for exc in (ConfigError("algo.lr: bad"), DatasetError("data.path: x.jsonl line 3: missing 'answer'"),
                ModelError("model.path: /m is not a folder"), IncompatibleCheckpoint("cannot resume"),
                RewardErrorRate("8 of 8 rewards failed")):
        try:
            raise exc
        except Exception as e:
            codes[type(exc).__name__] = user_errors.report(e, tmp_path, rank=0)
        line = capsys.readouterr().err
        assert line.count("\n") == 1 and str(exc) in line and "Traceback" not in line
        assert "Traceback" in (tmp_path / "error.log").read_text()
    assert codes == {"ConfigError": 2, "DatasetError": 3, "ModelError": 4, "IncompatibleCheckpoint": 5,
                     "RewardErrorRate": 6}
    assert user_errors.report(KeyError("a bug"), tmp_path) is None
    assert user_errors.classify(CheckpointError("x")) == (5, "checkpoint")


def test_a_run_that_meets_bad_data_exits_with_one_line(tmp_path, monkeypatch, capsys):
    import rhymerl.launch.train as lt

    def run(cfg, rank, world_size, preempt=None):  # what the trainer raises on the second row of a prompt file
        raise DatasetError(f"{tmp_path}/prompts.jsonl:2: missing 'answer'")

    monkeypatch.setattr(lt, "run", run)
    assert lt.run_from_config([str(REPO / "configs/tiny-cpu.yaml"), f"run.output_dir={tmp_path}"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rhymerl: data error: ") and "prompts.jsonl:2: missing 'answer'" in err[-1]
    assert "Traceback" not in "\n".join(err) and "Traceback" in (tmp_path / "error.log").read_text()
    monkeypatch.setattr(lt, "run", lambda *a: {}["a bug"])
    with pytest.raises(KeyError):
        lt.run_from_config([str(REPO / "configs/tiny-cpu.yaml"), f"run.output_dir={tmp_path}"])


def test_a_finished_run_ignores_a_late_preemption_notice(tmp_path, monkeypatch):
    """Slurm may send a requeued job's warning again while the finished process tears down
    (engine, W&B, interpreter finalisation): it must not kill the process with SIGUSR1."""
    import os
    import signal

    import rhymerl.launch.train as lt

    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    monkeypatch.setattr(lt, "run", lambda cfg, rank, world_size, preempt=None: 0)
    try:
        assert lt.run_from_config([str(REPO / "configs/tiny-cpu.yaml"), f"run.output_dir={tmp_path}"]) == 0
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGUSR1)  # ignored: this test process lives on
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
