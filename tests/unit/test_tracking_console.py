"""Tracker without W&B: console lines, phase timing, rank gating, step ordering."""

from __future__ import annotations

import io
import re

import pytest

from rhymerl.config import TrackingConfig
from rhymerl.outputs.tracking import Tracker, new_run_id

pytestmark = pytest.mark.cpu


def _tracker(tmp_path, console="plain", rank=0, **kw):
    out = io.StringIO()
    tr = Tracker(TrackingConfig(wandb="disabled", console=console, **kw), tmp_path, "t", {}, rank=rank,
                 max_steps=10, console_stream=out)
    return tr, out


def test_plain_line_has_metrics_and_phase_times(tmp_path):
    tr, out = _tracker(tmp_path)
    with tr.phase("rollout", 3):
        pass
    with tr.phase("train", 3):
        pass
    tr.log(3, {"reward/mean": 0.25, "train/loss": 1.5, "note": "text"})
    line = out.getvalue().strip()
    assert line.startswith("step 3/10 | ")
    assert "reward=0.25" in line and "loss=1.5" in line and "note" not in line
    # Each phase is shown with its seconds (how many is the bench's business, not this test's).
    assert re.search(r"rollout \d+\.\d\ds", line) and re.search(r"train \d+\.\d\ds", line), line


def test_phase_times_reset_each_step(tmp_path):
    tr, out = _tracker(tmp_path)
    with tr.phase("rollout", 1):
        pass
    tr.log(1, {})
    tr.log(2, {})
    assert "rollout" not in out.getvalue().splitlines()[1]


def test_rich_console_prints_without_terminal(tmp_path):
    tr, out = _tracker(tmp_path, console="rich")
    with tr.phase("rollout", 1):
        pass
    tr.log(1, {"reward/mean": 0.5})
    assert "step 1/10" in out.getvalue() and "reward=0.5" in out.getvalue()


def test_other_ranks_and_none_print_nothing(tmp_path):
    for kw in ({"rank": 1}, {"console": "none"}):
        tr, out = _tracker(tmp_path, **kw)
        tr.log(1, {"x": 1.0})
        tr.finish()
        assert out.getvalue() == ""
    assert not (tmp_path / "wandb").exists()


def test_disabled_wandb_has_no_run_id_unless_resumed(tmp_path):
    tr, _ = _tracker(tmp_path)
    assert tr.run_id is None and not tr.active
    tr2 = Tracker(TrackingConfig(wandb="disabled"), tmp_path, "t", {}, resume_run_id="keepme12")
    assert tr2.run_id == "keepme12"


def test_logging_an_older_step_warns(tmp_path):
    tr, _ = _tracker(tmp_path, console="none")
    tr.log(5, {"x": 1}, commit=True)
    with pytest.warns(RuntimeWarning, match="step 4 logged after step 5"):
        tr.log(4, {"x": 1})


def test_one_step_accepts_log_calls_in_any_order(recwarn, tmp_path):
    tr, _ = _tracker(tmp_path, console="none")
    tr.log(1, {"x": 1})
    tr.log_lengths(1, [3, 4])
    tr.log_lengths(2, [5])
    tr.log(2, {"x": 2})
    with tr.phase("rollout", 3):  # the next step's first phase commits step 2
        pass
    tr.finish()
    assert not [w for w in recwarn if "tracking" in str(w.message)]


def test_run_ids_look_like_wandb_ids():
    ids = {new_run_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"[a-z0-9]{8}", i) for i in ids)
