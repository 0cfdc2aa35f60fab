"""HistoSpec's GPU step-cost prior: the shipped GPU configs state the roofline's, not the CPU defaults."""

from __future__ import annotations

import json

import pytest

from rhymerl.config import HistoSpecConfig, load_config
from rhymerl.histospec.goodput import StepCostModel, plan_step
from benchmarks.roofline import gpu_step_cost_prior, main
from rhymerl.resharding.layout import ModelLayout
from test_memory_plan import QWEN25_7B, REPO, SHIPPED

pytestmark = pytest.mark.cpu

KEYS = ("step_cost_fixed_ms", "step_cost_per_request_ms", "step_cost_per_token_ms")


@pytest.mark.parametrize("name,shape", SHIPPED)
def test_shipped_gpu_configs_price_drafts_at_the_roofline(name, shape):
    cfg = load_config(REPO / "configs" / name)
    r = cfg.rollout
    want = gpu_step_cost_prior(ModelLayout.from_hf_config(shape), cfg.model.dtype, r.tensor_parallel,
                               r.max_tokens // 2, r.max_num_seqs)
    got = {k: getattr(cfg.histospec, k) for k in KEYS}
    assert got == pytest.approx({k: want[k] for k in KEYS}, rel=1e-3)
    # The CPU defaults' ramp (a draft token cheaper below 4 requests) is a CPU engine's shape.
    assert cfg.histospec.step_cost_draft_ramp_requests == want["step_cost_draft_ramp_requests"] == 1
    # Likewise the CPU defaults' drafting-row cost: a GPU config states its own (none), or it
    # would inherit 0.36 ms, about nine times what the roofline charges a draft token there.
    assert cfg.histospec.step_cost_per_drafting_request_ms == want["step_cost_per_drafting_request_ms"] == 0.0
    cpu = HistoSpecConfig()

    def token_share(h, requests: int) -> float:
        """A scored token's cost as a share of one row's share of the step."""
        row = h["step_cost_fixed_ms"] / requests + h["step_cost_per_request_ms"] + h["step_cost_per_token_ms"]
        return h["step_cost_per_token_ms"] / row

    # In the long tail (4 requests left) a draft token costs about 2% of a row on the GPU and
    # 12% on the CPU, whose prior would under-draft exactly where drafting pays most.
    assert token_share(got, 4) < 0.5 * token_share({k: getattr(cpu, k) for k in KEYS}, 4)


def _planned_draft_tokens(h: HistoSpecConfig, requests: int) -> int:
    cost = StepCostModel(h.step_cost_fixed_ms * 1e-3, h.step_cost_per_request_ms * 1e-3, h.step_cost_per_token_ms * 1e-3)
    return plan_step([[0.8] * 16] * requests, cost).draft_tokens


def test_in_the_tail_the_gpu_prior_drafts_what_the_cpu_prior_would_not():
    gpu = load_config(REPO / "configs" / SHIPPED[0][0]).histospec
    cpu = HistoSpecConfig()
    # A few long requests left (the tail), history that is right 80% of the time per token.
    assert _planned_draft_tokens(gpu, 4) > _planned_draft_tokens(cpu, 4)


def test_cli_prints_config_keys(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    assert main([str(tmp_path), "--tp", "1", "--context", "4096"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("histospec:") and all(f"  {k}: " in out for k in KEYS)
    assert "  step_cost_draft_ramp_requests: 1" in out
    assert main([str(tmp_path / "missing"), "--context", "4096"]) == 2
    with pytest.raises(ValueError, match="context_tokens"):
        gpu_step_cost_prior(ModelLayout.from_hf_config(QWEN25_7B), "bfloat16", 1, 0, 256)
