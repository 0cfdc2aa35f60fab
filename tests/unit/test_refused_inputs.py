"""Inputs that cannot make a sound run are refused before anything starts or is queued, by every
entry point (`train`, `train --print-config`, `slurm render|submit`), with one line naming the
key; warnings about unused keys concern only keys the user set; every refused start keeps the
error logs of the attempts before it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rhymerl.cli import main as cli
from rhymerl.config import ConfigError, load_config
from rhymerl.launch.train import run_from_config

pytestmark = pytest.mark.cpu
REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny-cpu.yaml")
TINY = ["model.path=builtin:tiny", "run.max_steps=1", "data.size=2", "data.prompts_per_step=2",
        "rollout.max_tokens=8", "reward.workers=0", "tracking.wandb=disabled"]

ENTRIES = {
    "print-config": lambda ov: cli(["train", CONFIG, *ov, "--print-config"]),
    "print-config --no-check": lambda ov: cli(["train", CONFIG, *ov, "--print-config", "--no-check"]),
    "slurm render": lambda ov: cli(["slurm", "render", CONFIG, *ov]),
    "slurm submit --dry-run": lambda ov: cli(["slurm", "submit", CONFIG, *ov, "--dry-run"]),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_one_response_per_prompt_is_refused_everywhere(entry, capsys):
    assert ENTRIES[entry](["rollout.n=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rhymerl: config error: rollout.n: is 1, but algo.name='grpo'"), err
    with pytest.raises(ConfigError, match="rollout.n: is 1, but algo.name='dapo'"):
        load_config(CONFIG, ["rollout.n=1", "algo.name=dapo"])


def test_train_refuses_one_response_per_prompt_before_anything_starts(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run_from_config([CONFIG, *TINY, "rollout.n=1", f"run.output_dir={run_dir}"]) == 2
    assert "rollout.n: is 1" in capsys.readouterr().err
    assert not run_dir.exists()


# Responses longer than the model's positions: builtin:tiny has 1024, SmolLM2 8192.
TOO_LONG = {"builtin:tiny": ["model.path=builtin:tiny", "rollout.max_tokens=600", "rollout.max_model_len=2048"],
            "builtin:smollm2": ["rollout.max_tokens=8000", "rollout.max_model_len=9000"]}


@pytest.mark.parametrize("model", list(TOO_LONG))
@pytest.mark.parametrize("entry", ["print-config", "slurm render"])
def test_lengths_beyond_a_builtin_models_positions_are_refused(model, entry, capsys):
    assert ENTRIES[entry](TOO_LONG[model]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rhymerl: config error: rollout.max_tokens: data.max_prompt_tokens "
                                               "(512) + rollout.max_tokens"), err
    assert "exceed the model's" in err[0] and "positions" in err[0]


def test_lengths_beyond_a_model_folders_positions_are_refused(tiny_model_dir, capsys):
    ov = [f"model.path={tiny_model_dir}", "rollout.max_tokens=1000", "rollout.max_model_len=2048",
          "data.max_prompt_tokens=100"]
    assert cli(["train", CONFIG, *ov, "--print-config"]) == 2
    assert "rollout.max_tokens: data.max_prompt_tokens (100) + rollout.max_tokens (1000) = 1100 tokens exceed the " \
           "model's 1024 positions" in capsys.readouterr().err


def test_train_refuses_lengths_beyond_the_positions_before_anything_starts(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run_from_config([CONFIG, *TINY, "rollout.max_tokens=600", "rollout.max_model_len=2048",
                            f"run.output_dir={run_dir}"]) == 2
    assert "exceed the model's 1024 positions" in capsys.readouterr().err
    assert sorted(p.name for p in run_dir.iterdir()) == [".owner.lock", "error.log"]


def _unused_warnings(caplog, path, overrides) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rhymerl.config"):
        load_config(path, overrides)
    return [r.getMessage() for r in caplog.records if "set but unused" in r.getMessage()]


def test_only_keys_the_user_set_are_reported_unused(tmp_path, caplog):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    jsonl = ["data.source=jsonl", f"data.path={data}"]
    # The shipped file sets data.tasks/task_args/size for its own source; switching the source
    # leaves them unused by the user's choice: nothing to warn about.
    assert _unused_warnings(caplog, CONFIG, jsonl) == []
    # A key the user sets on the command line for a path not taken is reported.
    assert _unused_warnings(caplog, CONFIG, [*jsonl, "data.size=3"]) == [
        "config: data.size: set but unused because data.source is 'jsonl'"]
    # So is a key the user's own file sets against its own choice.
    own = tmp_path / "mine.yaml"
    own.write_text(f"data:\n  source: jsonl\n  path: {data}\n  tasks: [chain_sum]\n")
    assert _unused_warnings(caplog, own, []) == ["config: data.tasks: set but unused because data.source is 'jsonl'"]


def test_every_refused_start_keeps_the_earlier_error_logs(tmp_path, capsys):
    run_dir = tmp_path / "run"
    for missing in ("first-missing-model", "second-missing-model"):
        assert run_from_config([CONFIG, *TINY, f"model.path={tmp_path / missing}", f"run.output_dir={run_dir}"]) != 0
    text = (run_dir / "error.log").read_text()
    assert text.count("==== ") == 2 and text.count("Traceback") == 2, text
    assert text.index("first-missing-model") < text.index("second-missing-model"), text
    assert "traceback in" in capsys.readouterr().err
