"""`bench greedy-replay`: its pieces that need no trained run (the run itself is measured in docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import yaml

from benchmarks import greedy_replay
from rhymerl.config import RunConfig, from_dict, load_config, to_yaml

pytestmark = pytest.mark.cpu


def test_a_run_written_with_since_removed_settings_still_loads(tmp_path):
    d = yaml.safe_load(to_yaml(load_config(None, ["histospec.epochs_kept=2"])))
    d["histospec"]["tree"] = False  # settings of an earlier version
    d["histospec"]["step_cost_fixed_ms"] = 38.94
    cfg = from_dict(greedy_replay._known_keys(d, RunConfig))
    assert cfg.histospec.epochs_kept == 2 and not hasattr(cfg.histospec, "tree")


def test_a_run_without_checkpoints_is_refused(tmp_path, capsys):
    assert greedy_replay.main([str(tmp_path)]) == 2
    assert "no checkpoints/latest" in capsys.readouterr().err
    assert greedy_replay.main([str(tmp_path), "--methods", "none,eagle"]) == 2
    assert "unknown methods ['eagle']" in capsys.readouterr().err


def test_table_names_every_method_and_whether_its_tokens_equal_none():
    out = {"checkpoint": "ck", "prompts": 4, "n": 1, "max_tokens": 512, "repeats": 3, "methods": {
        "none": {"wall_s_median": 10.0, "speedup_vs_none": 1.0, "wall_vs_suffix": 1.5, "tokens_per_forward": 1.0,
                 "acceptance_rate": 0.0, "same_tokens_as_none": True},
        "histospec": {"wall_s_median": 6.0, "speedup_vs_none": 1.667, "wall_vs_suffix": 0.9,
                      "tokens_per_forward": 2.5, "acceptance_rate": 0.8, "same_tokens_as_none": True}}}
    text = greedy_replay.table(out)
    assert "median of 3 interleaved repeats" in text and "histospec" in text and "True" in text
