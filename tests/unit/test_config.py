import subprocess
import sys
from pathlib import Path

import pytest

from rhymerl.config import ConfigError, ModelShape, RunConfig, load_config, to_yaml, validate

pytestmark = pytest.mark.cpu
REPO = Path(__file__).resolve().parents[2]


def test_defaults_load_and_round_trip(tmp_path):
    cfg = load_config(None)
    assert isinstance(cfg, RunConfig)
    f = tmp_path / "c.yaml"
    f.write_text(to_yaml(cfg))
    assert load_config(f) == cfg


def test_override_types_and_paths():
    cfg = load_config(None, ["algo.lr=3e-6", "rollout.n=8", "data.tasks=[chain_sum]", "histospec.epochs_kept=2"])
    assert cfg.algo.lr == 3e-6 and cfg.rollout.n == 8 and cfg.data.tasks == ["chain_sum"]
    assert cfg.histospec.epochs_kept == 2


@pytest.mark.parametrize("override,needle", [
    ("algo.lr=abc", "algo.lr"),
    ("nonexistent.key=1", "nonexistent"),
    ("rollout.nope=1", "rollout.nope"),
    ("rollout.speculative=eagle", "allowed values"),
    ("rollout.n=2.5", "rollout.n"),
    ("histospec.tree=true", "histospec.tree"),
    ("histospec.epochs_kept=maybe", "histospec.epochs_kept"),
    ("histospec.global_token_budget=-1", "histospec.global_token_budget"),
    ("histospec.min_goodput_gain=-1", "histospec.min_goodput_gain"),
    ("histospec.step_cost=roofline", "allowed values"),
    ("algo.name=grpo", None),
])
def test_bad_overrides_name_the_key(override, needle):
    if needle is None:
        load_config(None, [override])
        return
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)


def test_unknown_yaml_key_names_its_path(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  temprature: 0.5\n")
    with pytest.raises(ConfigError, match=r"rollout\.temprature"):
        load_config(f)


def test_impossible_combinations():
    with pytest.raises(ConfigError, match="parallel.world_size"):
        load_config(None, ["parallel.world_size=6", "parallel.tensor_parallel=4"])
    with pytest.raises(ConfigError, match="algo.dynamic_sampling"):
        load_config(None, ["algo.dynamic_sampling=true"])
    cfg = load_config(None, ["parallel.tensor_parallel=3"])
    shape = ModelShape(num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=4, vocab_size=10,
                       hidden_size=64, intermediate_size=128)
    with pytest.raises(ConfigError, match="allowed values"):
        validate(cfg, shape, world_size=3)
    cfg = load_config(None, ["parallel.pipeline_parallel=3"])
    with pytest.raises(ConfigError, match="pipeline_parallel"):
        validate(cfg, shape, world_size=3)
    assert validate(load_config(None, ["parallel.tensor_parallel=2"]), shape, world_size=4) == 2


# Published shapes of the models the cluster configs point at (their config.json values).
KNOWN_SHAPES = {
    "Qwen2.5-7B": ModelShape(num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28,
                             vocab_size=152064, hidden_size=3584, intermediate_size=18944),
    "Qwen2.5-32B": ModelShape(num_attention_heads=40, num_key_value_heads=8, num_hidden_layers=64,
                              vocab_size=152064, hidden_size=5120, intermediate_size=27648),
}


@pytest.mark.parametrize("cfg_file", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_shipped_configs_validate(cfg_file):
    cfg = load_config(REPO / "configs" / cfg_file)
    shape = KNOWN_SHAPES.get(Path(cfg.model.path).name)
    if not cfg.model.path.startswith("builtin:"):
        assert shape is not None, f"add the published shape of {cfg.model.path} to KNOWN_SHAPES"
    validate(cfg, shape, world_size=cfg.parallel.world_size or None)


def test_cli_print_config_and_bad_override():
    ok = subprocess.run([sys.executable, "-m", "rhymerl", "train", str(REPO / "configs/tiny-cpu.yaml"), "--print-config"],
                        capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    assert "histospec:" in ok.stdout and "max_tokens" in ok.stdout
    for bad, key in (("algo.lr=abc", "algo.lr"), ("nonexistent.key=1", "nonexistent")):
        r = subprocess.run([sys.executable, "-m", "rhymerl", "train", str(REPO / "configs/tiny-cpu.yaml"), bad, "--print-config"],
                           capture_output=True, text=True, cwd=REPO)
        assert r.returncode != 0 and key in r.stderr


@pytest.mark.parametrize("cmd", [["--help"], ["train", "--help"], ["export", "--help"], ["slurm", "--help"]])
def test_cli_help(cmd):
    r = subprocess.run([sys.executable, "-m", "rhymerl", *cmd], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "usage" in r.stdout


def test_path_fields_expand_environment_variables(monkeypatch):
    monkeypatch.setenv("USER", "ada")
    monkeypatch.setenv("RUNS", "/scratch/x")
    cfg = load_config(REPO / "configs" / "qwen2.5-7b-dapo-math-8xh100.yaml", ["checkpoint.dir=${RUNS}/ckpt"])
    assert cfg.run.output_dir == "/scratch/ada/rhymerl/qwen2.5-7b-dapo"
    assert cfg.checkpoint.dir == "/scratch/x/ckpt"
    # Only path fields: a system prompt keeps its dollar signs.
    assert load_config(None, ["data.system_prompt=costs $5"]).data.system_prompt == "costs $5"
    monkeypatch.delenv("RUNS")
    with pytest.raises(ConfigError, match=r"checkpoint.dir: environment variable \$RUNS .* is not set"):
        load_config(None, ["checkpoint.dir=$RUNS/ckpt"])


def test_response_length_that_does_not_fit_the_context_is_refused():
    with pytest.raises(ConfigError, match="rollout.max_tokens: 200 leaves no room.*max_model_len=128"):
        load_config(None, ["rollout.max_tokens=200", "rollout.max_model_len=128"])
    with pytest.raises(ConfigError, match=r"rollout.max_model_len: 600 < data.max_prompt_tokens \(512\)"):
        load_config(None, ["rollout.max_tokens=100", "rollout.max_model_len=600"])
    load_config(None, ["rollout.max_tokens=100", "rollout.max_model_len=612"])


def test_keys_the_chosen_path_does_not_use_are_reported(caplog):
    with caplog.at_level("WARNING", logger="rhymerl.config"):
        load_config(None, ["data.path=prompts.jsonl", "parallel.zero_stage=3", "histospec.epochs_kept=4",
                           "rollout.speculative=ngram", "algo.max_refill_rounds=5",
                           "algo.kl_coef=0.001", "algo.skip_zero_advantage_rows=true"])
    text = caplog.text
    for key, why in (("data.path", "data.source is 'reasoning_gym'"), ("parallel.zero_stage", "'megatron'"),
                     ("histospec.epochs_kept", "rollout.speculative is 'ngram'"),
                     ("algo.max_refill_rounds", "dynamic_sampling is false"),
                     ("algo.skip_zero_advantage_rows", "algo.kl_coef is 0.001")):
        assert f"{key}: set but unused because" in text and why in text, (key, text)
    # Keys left at their defaults, or used, are not reported.
    assert "histospec.global_token_budget" not in text and "rollout.n" not in text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rhymerl.config"):
        load_config(None, ["parallel.backend=deepspeed", "parallel.recompute_norms=true", "parallel.attention=unfused"])
        load_config(None, ["parallel.recompute_activations=true", "parallel.recompute_norms=true",
                           "parallel.recompute_over_budget=false"])
    text = caplog.text
    for key, why in (("parallel.recompute_norms", "parallel.backend is 'deepspeed'"),
                     ("parallel.attention", "parallel.backend is 'deepspeed'"),
                     ("parallel.recompute_norms", "parallel.recompute_activations is true"),
                     ("parallel.recompute_over_budget", "parallel.recompute_activations is true")):
        assert f"{key}: set but unused because {why}" in text, (key, text)
    caplog.clear()
    with caplog.at_level("WARNING", logger="rhymerl.config"):
        load_config(REPO / "configs" / "tiny-cpu.yaml")
    assert "unused" not in caplog.text, caplog.text
