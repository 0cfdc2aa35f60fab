from pathlib import Path

import pytest

import benchmarks
from rhymerl.histopipe import calibration
from benchmarks.simulate import spec_profile
from benchmarks.simulate.spec_profile import SpecProfile
from rhymerl.histospec.step_costs import roofline_costs

pytestmark = pytest.mark.cpu


def test_replay_measures_speed_by_position_and_the_proposers_cpu_time():
    trace = Path(benchmarks.__file__).with_name("traces") / "smollm2-chain-sum-grpo.jsonl"
    p = spec_profile.measure(trace)
    assert p.edges[0] == 0 and len(p.tokens_per_forward) == len(p.edges)
    # Chain-sum answers repeat across epochs: drafts are accepted, so a forward emits more than
    # one token. At the CPU prior's prices this replay drafts only its surest tokens; the test
    # below replays the same trace at a GPU's prices.
    assert p.tokens_per_forward[0] > 1.02 and p.draft_tokens_per_forward[0] > 0
    assert p.proposer_s_per_request > 0 and "per request per step" in p.source
    again = SpecProfile.from_dict(p.to_dict())
    assert again == p


def test_profile_files_without_a_proposer_cost_load_as_unmeasured():
    d = SpecProfile([0, 64], [2.0, 1.5], [3.0, 2.0], "test").to_dict()
    del d["proposer_s_per_request"]
    assert SpecProfile.from_dict(d).proposer_s_per_request == 0.0
    with pytest.raises(ValueError, match="proposer_s_per_request"):
        SpecProfile.from_dict({**d, "proposer_s_per_request": -1.0})
    # The shipped calibration's profile was measured with the proposer's cost.
    _, _, cal = calibration.load(None)
    assert SpecProfile.from_dict(cal["speculation"]).proposer_s_per_request > 0


def test_profile_for_an_engine_prices_drafts_at_its_costs_and_regenerates_the_file(tmp_path, capsys):
    import json
    import shutil

    trace = Path(benchmarks.__file__).with_name("traces") / "smollm2-chain-sum-grpo.jsonl"
    cost, _, _ = calibration.load(None)
    prior = roofline_costs(cost, 4096)
    assert prior.fixed_ms == pytest.approx(1e3 * cost.a, abs=1e-3)
    assert prior.per_request_ms == pytest.approx(1e3 * cost.c * 4096, abs=1e-4)
    gpu = spec_profile.measure_for_engine(trace, cost, 4096, repeats=2)
    cpu = spec_profile.measure(trace)
    # A GPU's draft token is cheap beside a row: the planner drafts more, and more tokens land.
    assert sum(gpu.draft_tokens_per_forward) > sum(cpu.draft_tokens_per_forward)
    assert gpu.tokens_per_forward[0] > cpu.tokens_per_forward[0]
    assert "median of 2 replays" in gpu.source and "4096-token context" in gpu.source
    # The CLI writes the speculation section into a calibration file, keeping its cost.
    cal = tmp_path / "cal.json"
    shutil.copy(calibration.DEFAULT, cal)
    assert spec_profile.main([str(trace), "--calibration", str(cal), "--repeats", "1", "--context", "4096",
                              "--write"]) == 0
    printed = json.loads(capsys.readouterr().out)
    cost2, _, whole = calibration.load(cal)
    assert cost2 == cost and whole["speculation"] == printed
    assert printed["tokens_per_forward"] == gpu.tokens_per_forward
    assert spec_profile.main([str(tmp_path / "missing.jsonl"), "--calibration", str(cal)]) == 2
