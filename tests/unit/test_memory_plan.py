"""The start-up memory fit check (rhymerl.distributed.memory_plan) on the shipped cluster configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from rhymerl.config import load_config
from rhymerl.distributed.memory_plan import GB, MemoryPlanError, check, check_run, estimate, model_params
from rhymerl.resharding.layout import ModelLayout

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[2]
# Published config.json values of the models the shipped configs name.
QWEN25_7B = dict(architectures=["Qwen2ForCausalLM"], hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)
QWEN25_32B = dict(architectures=["Qwen2ForCausalLM"], hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
                  num_key_value_heads=8, intermediate_size=27648, vocab_size=152064, tie_word_embeddings=False)
QWEN25_05B = dict(architectures=["Qwen2ForCausalLM"], hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)
SHIPPED = [("qwen2.5-7b-dapo-math-8xh100.yaml", QWEN25_7B), ("qwen2.5-32b-grpo-math-4x8xh100.yaml", QWEN25_32B)]


def _plan(name: str, shape: dict, *overrides: str):
    cfg = load_config(REPO / "configs" / name, list(overrides))
    return estimate(cfg, ModelLayout.from_hf_config(shape), cfg.parallel.world_size, cfg.memory.device_gb * GB)


def test_parameter_counts_match_the_published_sizes():
    # Qwen2.5 model cards: 7.61B, 32.5B (32.76B with the untied head counted), 0.49B.
    assert model_params(ModelLayout.from_hf_config(QWEN25_7B)) == pytest.approx(7.62e9, rel=0.01)
    assert model_params(ModelLayout.from_hf_config(QWEN25_32B)) == pytest.approx(32.76e9, rel=0.01)
    assert model_params(ModelLayout.from_hf_config(QWEN25_05B)) == pytest.approx(0.494e9, rel=0.01)


@pytest.mark.parametrize("name,shape", SHIPPED)
def test_shipped_cluster_configs_fit_every_phase(name, shape):
    plan = _plan(name, shape)
    check(plan)
    assert [p.name for p in plan.phases] == ["engine build", "rollout", "training", "wake"]
    # The design fits with room to spare, not because the check is loose: every phase keeps
    # at least 10 GB of an 85 GB device free beyond the 4 GB reserve.
    assert all(p.headroom > 10 * GB for p in plan.phases), plan.table()


def _vllm_start(free_bytes: float, total_bytes: float, utilization: float) -> str:
    """vLLM's own start-up rule (its worker's ``request_memory``): "" when it starts, its error else."""
    from vllm.config import CacheConfig
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    snap = MemorySnapshot(free_memory=int(free_bytes), total_memory=int(total_bytes), device="cuda:0",
                          auto_measure=False)
    try:
        request_memory(snap, CacheConfig(gpu_memory_utilization=utilization))
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("name,shape", SHIPPED)
def test_engine_build_passes_vllms_free_memory_rule_only_with_training_state_offloaded(name, shape):
    plan = _plan(name, shape)
    cfg = load_config(REPO / "configs" / name)
    build = plan.phase("engine build")
    util = cfg.rollout.gpu_memory_utilization
    assert _vllm_start(plan.device_bytes - build.total, plan.device_bytes, util) == ""
    # Built next to the gradients, the optimizer state and the reference (nothing offloaded
    # first), the engine is refused by vLLM, and the plan's own rule says the same.
    t = plan.training
    resident = build.total + t["grads"] + t["optimizer"] + t.get("reference", 0)
    assert "less than desired GPU memory utilization" in _vllm_start(plan.device_bytes - resident,
                                                                     plan.device_bytes, util)
    assert resident > build.limit


def test_a_phase_that_does_not_fit_is_refused_naming_it_and_the_shortfall():
    with pytest.raises(MemoryPlanError) as e:
        check(_plan("qwen2.5-7b-dapo-math-8xh100.yaml", QWEN25_7B, "rollout.gpu_memory_utilization=0.92"))
    msg = str(e.value)
    assert "engine build needs 11.6 GB where 6.8 GB may be used (4.8 GB short; vLLM: free >= " \
           "gpu_memory_utilization 0.92 x 85.0)" in msg, msg
    assert "rollout needs" in msg and "rollout.gpu_memory_utilization" in msg


def test_a_sleeping_engine_keeps_its_graphs_and_nccl_buffers_while_training():
    eager = _plan("qwen2.5-32b-grpo-math-4x8xh100.yaml", QWEN25_32B, "rollout.enforce_eager=true")
    graphs = _plan("qwen2.5-32b-grpo-math-4x8xh100.yaml", QWEN25_32B)
    assert eager.training["engine NCCL"] > 0 and eager.training["engine graphs"] == 0
    assert graphs.training["engine graphs"] > 0
    assert graphs.training_total - eager.training_total == pytest.approx(graphs.training["engine graphs"])
    one_gpu_engine = _plan("qwen2.5-7b-dapo-math-8xh100.yaml", QWEN25_7B)
    assert one_gpu_engine.training["engine NCCL"] == 0


def test_print_config_shows_the_phase_table_for_both_cluster_configs(tmp_path):
    import json
    import subprocess
    import sys

    for (name, shape) in SHIPPED:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(shape))
        res = subprocess.run([sys.executable, "-m", "rhymerl", "train", str(REPO / "configs" / name),
                              f"model.path={folder}", "--print-config", "--no-check"],
                             capture_output=True, text=True, cwd=REPO, timeout=120)
        assert res.returncode == 0, res.stderr
        table = [line for line in res.stdout.splitlines() if line.startswith("#   ")]
        assert [line.split()[1] for line in table[1:5]] == ["engine", "rollout", "training", "wake"], res.stdout
        assert "vLLM: free >= gpu_memory_utilization 0.6 x 85.0" in res.stdout
        # What it prints is still a config that loads.
        (tmp_path / "printed.yaml").write_text(res.stdout)
        assert load_config(tmp_path / "printed.yaml").model.path == str(folder)


@pytest.mark.parametrize("overrides,keys", [
    # 32k-token micro-batches without recomputation: hundreds of GB of activations.
    (["parallel.recompute_activations=false", "algo.micro_batch_tokens=32768"],
     ["parallel.recompute_activations", "algo.micro_batch_tokens", "parallel.tensor_parallel"]),
    # The engine asks for 95% of a device that also holds the trainer's weights.
    (["rollout.gpu_memory_utilization=0.95"], ["engine build", "rollout.gpu_memory_utilization"]),
    # An engine that never sleeps sits next to the optimizer state during training.
    (["rollout.sleep_level=0"], ["rollout.sleep_level"]),
    # A KV cache too small for one sequence.
    (["rollout.gpu_memory_utilization=0.12", "rollout.max_model_len=131072", "algo.micro_batch_tokens=1024",
      "parallel.recompute_activations=true"], ["KV cache", "rollout.max_model_len"]),
])
def test_impossible_plans_are_refused_naming_the_keys(overrides, keys):
    with pytest.raises(MemoryPlanError) as e:
        check(_plan("qwen2.5-7b-dapo-math-8xh100.yaml", QWEN25_7B, *overrides))
    for key in keys:
        assert key in str(e.value), str(e.value)


def test_cpu_host_without_a_device_size_is_not_held_to_a_budget(tmp_path):
    import json

    import torch

    (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B))
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml")
    assert check_run(cfg, tmp_path, 1, torch.device("cpu")) is None
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", ["memory.device_gb=1"])
    with pytest.raises(MemoryPlanError, match="memory plan does not fit"):
        check_run(cfg, tmp_path, 1, torch.device("cpu"))


def test_cpu_kv_cache_is_sized_from_the_step():
    from rhymerl.config import RolloutConfig
    from rhymerl.distributed.memory_plan import cpu_kv_cache_bytes, kv_bytes_per_token

    layout = ModelLayout.from_hf_config(QWEN25_05B)
    per_token = kv_bytes_per_token(layout, 4, 1)  # 24 layers x 2 KV heads x 64 x (K, V) x fp32
    assert per_token == 24 * 2 * 64 * 2 * 4
    r = RolloutConfig(max_tokens=32, num_speculative_tokens=8, max_num_seqs=64, max_model_len=1024)
    # 32 sequences of at most 100 + 32 + 8 (+ one block) tokens: far below the old fixed 1 GiB.
    step = cpu_kv_cache_bytes(layout, r, "float32", 32, 100)
    assert step == int(32 * (100 + 32 + 8 + 16) * per_token * 1.5)
    # Never below one max_model_len sequence (vLLM refuses to start), never above max_num_seqs.
    assert cpu_kv_cache_bytes(layout, r, "float32", 1, 10) == max(int(1024 * per_token * 1.5), 32 << 20)
    assert cpu_kv_cache_bytes(layout, r, "float32", 10_000, 100) == cpu_kv_cache_bytes(layout, r, "float32", 64, 100)
    r.tensor_parallel = 2
    assert cpu_kv_cache_bytes(layout, r, "float32", 32, 100) == pytest.approx(step / 2, rel=1e-6)


def test_over_budget_recomputation_bounds_the_activations_by_the_budget():
    common = ("parallel.recompute_activations=false", "algo.micro_batch_tokens=4096", "rollout.max_model_len=16384")
    kept = _plan("qwen2.5-7b-dapo-math-8xh100.yaml", QWEN25_7B, *common, "parallel.recompute_over_budget=false")
    bounded = _plan("qwen2.5-7b-dapo-math-8xh100.yaml", QWEN25_7B, *common)
    # Without it the longest row keeps 4x the budget's activations; with it the budget's
    # micro-batch is the largest (the long row keeps only each layer's input).
    assert bounded.training["activations"] == pytest.approx(kept.training["activations"] / 4, rel=0.05)
    assert bounded.training_total < kept.training_total
