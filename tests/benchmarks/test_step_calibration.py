"""`bench step --calibrate` on real vLLM (CPU): controlled drafting steps are recorded and fitted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_calibration_measures_drafting_steps_and_prints_the_prior():
    res = subprocess.run([sys.executable, "-m", "benchmarks", "step", "--calibrate", "--sizes", "1,3",
                          "--tokens", "12", "--json"], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    # Every grid point decoded: drafted steps at both sizes, timed and fitted.
    assert out["steps_with_drafts"] >= 8 and out["steps"] > out["steps_with_drafts"]
    assert {b["requests"] for b in out["draft_price_by_requests"]} == {"1-1", "2-3"}
    assert set(out["keys"]) == {"fixed_ms", "per_request_ms", "per_token_ms", "per_drafting_request_ms"}
    assert out["keys"]["fixed_ms"] > 0 and out["keys"]["per_token_ms"] > 0
    assert "prior: StepCosts(fixed_ms=" in res.stderr


def test_calibration_refuses_a_single_batch_size():
    res = subprocess.run([sys.executable, "-m", "benchmarks", "step", "--calibrate", "--sizes", "4"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 2 and "--calibrate needs two --sizes or more" in res.stderr
