"""HistoSpec's step-cost prior per device kind: a CPU engine prices drafts at the CPU prior, a
GPU engine at its decode roofline; the shipped GPU configs state none of it."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from benchmarks.roofline import QWEN25_7B, QWEN25_32B, main, preset
from rhymerl.config import load_config
from rhymerl.histospec.device_costs import for_engine, gpu_kind, gpu_prior
from rhymerl.histospec.goodput import StepCostModel, plan_step
from rhymerl.histospec.step_costs import CPU_PRIOR, StepCosts
from rhymerl.resharding.layout import ModelLayout

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[2]
SHIPPED = [("qwen2.5-7b-dapo-math-8xh100.yaml", QWEN25_7B), ("qwen2.5-32b-grpo-math-4x8xh100.yaml", QWEN25_32B)]


@pytest.mark.parametrize("name,shape", SHIPPED)
def test_a_gpu_engine_prices_drafts_at_its_roofline_and_the_configs_state_no_costs(name, shape):
    cfg = load_config(REPO / "configs" / name)
    r = cfg.rollout
    # What the engine picks at start-up on an H100, from its model, split and max tokens.
    got = for_engine(False, shape, cfg.model.dtype, r.tensor_parallel, r.max_tokens, r.max_num_seqs,
                     "NVIDIA H100 80GB HBM3")
    want = gpu_prior(ModelLayout.from_hf_config(shape), cfg.model.dtype, r.tensor_parallel, r.max_tokens // 2,
                     r.max_num_seqs)
    assert (got.fixed_ms, got.per_request_ms, got.per_token_ms) == (want.fixed_ms, want.per_request_ms,
                                                                      want.per_token_ms)
    # A GPU's drafting row costs nothing of its own (the CPU prior's would be ~nine draft tokens).
    assert got.per_drafting_request_ms == 0.0 and "H100" in got.source

    def token_share(c: StepCosts, requests: int) -> float:
        """A scored token's cost as a share of one row's share of the step."""
        return c.per_token_ms / (c.fixed_ms / requests + c.per_request_ms + c.per_token_ms)

    # In the long tail (4 requests left) a draft token costs a few % of a row on the GPU and
    # far more on the CPU, whose prior would under-draft exactly where drafting pays most.
    assert token_share(got, 4) < 0.5 * token_share(CPU_PRIOR, 4)


def test_a_cpu_engine_and_an_unreadable_model_get_the_cpu_prior():
    assert for_engine(True, QWEN25_7B, "bfloat16", 1, 8192, 256) is CPU_PRIOR
    # A shape the roofline cannot read overprices drafts rather than failing the run.
    assert for_engine(False, {"architectures": ["Unknown"]}, "bfloat16", 1, 8192, 256, "NVIDIA H100") is CPU_PRIOR


def test_device_kinds_change_the_price():
    assert gpu_kind("NVIDIA GH200 480GB")[0] == "GH200" and gpu_kind("NVIDIA H200")[0] == "H200"
    assert gpu_kind("Tesla T4")[0] == "H100"  # not listed: priced as the first kind
    h100 = for_engine(False, QWEN25_7B, "bfloat16", 1, 8192, 256, "NVIDIA H100 80GB HBM3")
    h200 = for_engine(False, QWEN25_7B, "bfloat16", 1, 8192, 256, "NVIDIA H200")
    assert h200.fixed_ms < h100.fixed_ms  # more bandwidth: a cheaper weights read


def test_the_presets_are_the_shipped_configs_engines():
    for name, shape in SHIPPED:
        cfg = load_config(REPO / "configs" / name)
        r = cfg.rollout
        label = "qwen2.5-7b-h100" if "7b" in name else "qwen2.5-32b-h100"
        engine = for_engine(False, shape, cfg.model.dtype, r.tensor_parallel, r.max_tokens, r.max_num_seqs, "H100")
        assert (preset(label).fixed_ms, preset(label).per_token_ms) == (engine.fixed_ms, engine.per_token_ms)
    assert preset("cpu") is CPU_PRIOR
    with pytest.raises(ValueError, match="unknown step-cost preset"):
        preset("tpu")


def _planned_draft_tokens(c: StepCosts, requests: int) -> int:
    cost = StepCostModel(c.fixed_ms * 1e-3, c.per_request_ms * 1e-3, c.per_token_ms * 1e-3)
    return plan_step([[0.8] * 16] * requests, cost).draft_tokens


def test_in_the_tail_the_gpu_prior_drafts_what_the_cpu_prior_would_not():
    # A few long requests left (the tail), history that is right 80% of the time per token.
    assert _planned_draft_tokens(preset("qwen2.5-7b-h100"), 4) > _planned_draft_tokens(CPU_PRIOR, 4)


def test_cli_prints_the_prior(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    assert main([str(tmp_path), "--tp", "1", "--context", "4096"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == asdict(preset("qwen2.5-7b-h100"))
    assert main([str(tmp_path / "missing"), "--context", "4096"]) == 2
    with pytest.raises(ValueError, match="context_tokens"):
        gpu_prior(ModelLayout.from_hf_config(QWEN25_7B), "bfloat16", 1, 0, 256)
