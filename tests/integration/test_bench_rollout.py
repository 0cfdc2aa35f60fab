"""``bench rollout`` without ``--sweep`` on the real engine: interleaved repeats, each from the same drafter state."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.integration, pytest.mark.slow]


def test_every_repeat_starts_from_the_same_drafter_state(capsys):
    from benchmarks import rollout

    assert rollout.main(["--quick", "--repeats", "2", "--methods", "suffix,histospec", "--json"]) == 0
    # Python-level logging inside the run lands in the captured stdout too: the JSON is the last line.
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["repeats"] == 2
    for method in ("suffix", "histospec"):
        r = out["methods"][method]
        assert len(r["wall_s_repeats"]) == 2 and round(r["wall_s"], 3) == max(r["wall_s_repeats"])  # upper median
        # Same seeds and the same drafter state (HistoSpec's history afresh, suffix's cache emptied
        # and refilled) write the same tokens the same way; a drafter that kept what it learnt in
        # the first repeat would draft, and so sample, differently in the second.
        first, second = r["tokens_per_forward_repeats"]
        assert first == second and first > 1.0
