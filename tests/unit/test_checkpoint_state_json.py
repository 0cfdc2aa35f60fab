"""Checkpoint state is JSON that round-trips exactly; pickled (format 1) checkpoints are refused."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from rhymerl.outputs import state_json
from rhymerl.outputs.checkpoint import CheckpointError, CheckpointManager, capture_rng_state, restore_rng_state
from rhymerl.config import CheckpointConfig, HistoPipeConfig

pytestmark = pytest.mark.cpu


def test_rng_state_round_trips_through_json():
    state = state_json.loads(state_json.dumps(capture_rng_state()))
    first = (random.random(), np.random.rand(), torch.rand(3).tolist())
    restore_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(3).tolist()) == first


def test_tagged_values_round_trip():
    value = {"t": (1, 2.5, "x"), 3: [None, True], (1, 2): b"\x00\xff", "nan": float("inf"),
             "arr": np.arange(6, dtype=np.int16).reshape(2, 3), "np": np.float32(1.5),
             "bf": torch.tensor([1.0, -2.0], dtype=torch.bfloat16), "empty": torch.empty(0)}
    back = state_json.loads(state_json.dumps(value))
    assert back["t"] == (1, 2.5, "x") and back[3] == [None, True] and back[(1, 2)] == b"\x00\xff"
    assert back["nan"] == float("inf") and back["np"] == 1.5
    assert back["arr"].dtype == np.int16 and (back["arr"] == value["arr"]).all()
    assert back["bf"].dtype == torch.bfloat16 and torch.equal(back["bf"], value["bf"])
    assert back["empty"].shape == (0,)


def test_trainer_component_states_are_storable():
    from rhymerl.histopipe import LengthPredictor

    p = LengthPredictor(HistoPipeConfig(), 64)
    for i in range(5):
        p.observe(f"k{i % 2}", [10 + i, 20, 30])
    back = state_json.loads(state_json.dumps(p.state_dict()))
    q = LengthPredictor(HistoPipeConfig(), 64)
    q.load_state_dict(back)
    assert q.state_dict() == p.state_dict()


def test_unstorable_object_is_refused_naming_it(tmp_path):
    mgr = CheckpointManager(CheckpointConfig(), tmp_path)
    with pytest.raises(CheckpointError, match=r"state\['trainer'\]\.bad: a builtins.object cannot be stored"):
        mgr.save(1, {"trainer": {"bad": object()}})


def test_pickled_checkpoint_is_refused_clearly(tmp_path):
    mgr = CheckpointManager(CheckpointConfig(), tmp_path)
    path = mgr.save(1, {"trainer": {"step": 1}})
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format"] = 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="older RhymeRL that pickled its state"):
        CheckpointManager(CheckpointConfig(resume=str(path)), tmp_path).find_resume()
