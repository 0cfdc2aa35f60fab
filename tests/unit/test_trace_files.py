"""Trace files: a run's ``step`` survives a read and a write; a malformed one is named."""

from __future__ import annotations

import json

import pytest

from rhymerl.outputs.traces import TraceError, TraceRecord, read_trace, write_trace

pytestmark = pytest.mark.cpu


def test_step_round_trips_and_stays_optional(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, [TraceRecord("p", 1, 0, [5, 6], step=3), TraceRecord("p", 1, 1, [7])])
    recs = read_trace(path)
    assert [r.step for r in recs] == [3, None]
    assert "step" not in json.loads(path.read_text().splitlines()[1])


def test_a_step_that_is_not_an_integer_is_named(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt_id": "p", "epoch": 1, "sample_idx": 0, "token_ids": [1], "step": "2"}) + "\n")
    with pytest.raises(TraceError, match=r"t.jsonl:1: step must be an integer"):
        read_trace(path)
