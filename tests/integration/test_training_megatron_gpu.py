"""The Megatron backend on CUDA/NCCL (no CPU patches): TP=1 logits vs HF and an export round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow]


def test_megatron_tp1_on_cuda_matches_hf(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rhymerl.training.local_launch import run_ranks

    worker = Path(__file__).with_name("training_worker.py")
    run_ranks(worker, ["--out", str(tmp_path), "--model", f"llama={tiny_model_dir}"], 1, timeout_s=300,
              log_dir=tmp_path / "logs")
    fwd = torch.load(tmp_path / "llama" / "forward.pt")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(fwd["input_ids"]).logits
    assert (fwd["logits"].cpu() - logits).abs().max().item() < 1e-3
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    exported = load_file(str(tmp_path / "llama" / "export0.safetensors"))
    assert all(torch.equal(exported[k].cpu(), original[k]) for k in original)
    assert json.loads((tmp_path / "results.json").read_text())["llama"]["grad_norm1"] > 0
