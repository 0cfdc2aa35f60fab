from pathlib import Path

import pytest

import rhymerl.bench
from rhymerl.histopipe import calibration, spec_profile
from rhymerl.histopipe.spec_profile import SpecProfile

pytestmark = pytest.mark.cpu


def test_replay_measures_speed_by_position_and_the_proposers_cpu_time():
    trace = Path(rhymerl.bench.__file__).with_name("traces") / "smollm2-chain-sum-grpo.jsonl"
    p = spec_profile.measure(trace)
    assert p.edges[0] == 0 and len(p.tokens_per_forward) == len(p.edges)
    # Chain-sum answers repeat across epochs: drafts are accepted, so a forward emits more than one token.
    assert p.tokens_per_forward[0] > 1.3 and p.draft_tokens_per_forward[0] > 0
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
