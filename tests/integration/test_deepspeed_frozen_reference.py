"""The DeepSpeed backend's frozen KL reference (``train=False``): no optimizer state, no ZeRO
engine, no gradients; its log-probs are the model's."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cpu, pytest.mark.integration]


def test_frozen_reference_has_no_optimizer_and_scores_like_the_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rhymerl.config import AlgorithmConfig, ParallelConfig
    from rhymerl.training.deepspeed_backend import DeepSpeedBackend, token_logprobs
    from rhymerl.distributed.process_groups import ProcessGroups

    # One rank, no process group: a frozen model needs none (DeepSpeed's engine would).
    groups = ProcessGroups(world_size=1, rank=0, tp=None, pp=None, dp=None, mp=None, embd=None, pos_embd=None,
                           tp_size=1, pp_size=1, dp_size=1, tp_rank=0, pp_rank=0, dp_rank=0,
                           device=torch.device("cpu"), dist_backend="gloo")
    ref = DeepSpeedBackend(ParallelConfig(backend="deepspeed", zero_stage=3), AlgorithmConfig(), tiny_model_dir,
                           groups, train=False)
    assert ref.optimizer is None and not isinstance(ref.engine, __import__("deepspeed").DeepSpeedEngine)
    assert not any(p.requires_grad for p in ref.module.parameters())
    ids = torch.randint(3, 200, (2, 12))
    mask = torch.ones(2, 12)
    mask[:, :4] = 0
    got = ref.compute_logprobs(ids, mask)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        want = token_logprobs(model(input_ids=ids).logits, ids) * mask
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    names = [n for b in ref.export_hf_weights(1 << 20) for n, _ in b]
    assert names == [n for n, _ in model.named_parameters()]
    with pytest.raises(RuntimeError, match="train=False"):
        ref.save_checkpoint(tiny_model_dir / "never")
