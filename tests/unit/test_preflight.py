"""What a config names is checked before the job is queued (`slurm submit`, `--print-config`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import rhymerl.launch.slurm as sl
from rhymerl.config import ConfigError, load_config
from rhymerl.launch.preflight import preflight

pytestmark = pytest.mark.cpu
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("overrides, key", [
    (["data.tasks=[no_such_task]"], "data.tasks: .*no_such_task"),
    (["data.tasks=[chain_sum]", "data.task_args={chain_sum: {no_such_arg: 1}}"], "data.tasks: .*chain_sum"),
    (["model.path=/no/such/model"], "model.path: /no/such/model is not a folder"),
    (["model.path=builtin:nope"], "model.path: unknown built-in"),
    (["data.source=jsonl", "data.path=/no/such.jsonl"], "data.path: /no/such.jsonl does not exist"),
    (["rollout.max_tokens=200", "rollout.max_model_len=128"], "rollout.max_tokens: 200 leaves no room"),
])
def test_preflight_refuses_what_would_fail_at_start(overrides, key):
    with pytest.raises(ConfigError, match=key):
        preflight(load_config(REPO / "configs/tiny-cpu.yaml", overrides))


def test_preflight_checks_rows_and_model_shape(tmp_path, tiny_model_dir):
    bad = tmp_path / "d.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ConfigError, match=rf"{bad}:2"):
        preflight(load_config(REPO / "configs/tiny-cpu.yaml", ["data.source=jsonl", f"data.path={bad}"]))
    heads = json.loads((tiny_model_dir / "config.json").read_text())["num_attention_heads"]
    cfg = load_config(REPO / "configs/tiny-cpu.yaml", [f"model.path={tiny_model_dir}",
                                                       f"parallel.tensor_parallel={heads + 1}"])
    with pytest.raises(ConfigError, match="parallel.tensor_parallel"):
        preflight(cfg, world_size=heads + 1)
    preflight(load_config(REPO / "configs/tiny-cpu.yaml", [f"model.path={tiny_model_dir}"]), world_size=1)


def test_slurm_submit_refuses_before_sbatch(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"run": {"name": "pf"}, "data": {"tasks": ["no_such_task"]},
                                   "slurm": {"log_dir": str(tmp_path / "logs")}}))
    calls = []
    monkeypatch.setattr(sl, "sbatch", lambda script, *rest: calls.append(script) or "1")
    assert sl.main(["submit", str(cfg)]) == 2
    assert "data.tasks" in capsys.readouterr().err and not calls
    assert not (tmp_path / "logs").exists()
    assert sl.main(["submit", str(cfg), "--no-check"]) == 0 and len(calls) == 1


def test_print_config_checks_tasks():
    res = subprocess.run([sys.executable, "-m", "rhymerl", "train", str(REPO / "configs/tiny-cpu.yaml"),
                          "data.tasks=[no_such_task]", "--print-config"], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert res.returncode == 2 and "data.tasks" in res.stderr, res.stderr
