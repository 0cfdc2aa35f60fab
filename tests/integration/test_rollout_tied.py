"""In-place weight updates of a model with tied embeddings (SmolLM2, Qwen2-0.5B style).

vLLM 0.32's layerwise reload loads no tensor for a tied lm_head (no checkpoint name maps
to it) and puts its old packed CPU kernel back, so without RolloutEngine's re-tie and
repack the engine keeps sampling from the initial output layer while the weights move on.
"""

from __future__ import annotations

import pytest
import torch

from rhymerl.config import HistoSpecConfig, ModelConfig, RolloutConfig
from rhymerl.models.tiny import TinyShape
from rhymerl.models import resolve_model

pytestmark = [pytest.mark.cpu, pytest.mark.integration]

PROMPT = [1, 17, 42, 99, 7, 250, 3, 11]


def _hf_logprobs(folder, state, tokens):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(folder))
    m.load_state_dict(state, strict=False)
    m.tie_weights()
    with torch.no_grad():
        logits = m(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0], logits.argmax(-1)


def test_tied_embeddings_follow_in_place_updates(capfd):
    from safetensors.torch import load_file

    from rhymerl.rollout import RolloutEngine, SamplingSpec

    folder = resolve_model(ModelConfig(path="builtin:tiny"), TinyShape(tie_word_embeddings=True, seed=3))
    state = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in state
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in state.items()}
    eng = RolloutEngine(RolloutConfig(speculative="none", max_model_len=256), HistoSpecConfig(), folder, seed=0)
    try:
        greedy = SamplingSpec(temperature=0, max_tokens=12)
        # vLLM's own reload alone: the tied head's packed CPU kernel stays at the old weights.
        eng.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(new.items()))})
        eng.llm.reset_prefix_cache()
        r = eng.generate([PROMPT], 1, greedy, record_history=False)[0].responses[0]
        ref_lp, _ = _hf_logprobs(folder, new, r.token_ids)
        assert (ref_lp - torch.tensor(r.logprobs)).abs().max().item() > 0.05, \
            "vLLM refreshed the tied head by itself: the re-tie in load_weights may be unnecessary now"
        capfd.readouterr()
        eng.load_weights(list(new.items()))
        # The tied head and the rotary cache get no tensor by design: no "Failed to load weights" for them.
        assert {"ParallelLMHead", "RotaryEmbedding"} <= set(eng.quiet_reload_layers)
        assert "Failed to load weights" not in "".join(capfd.readouterr())
        r = eng.generate([PROMPT], 1, greedy, record_history=False)[0].responses[0]
        ref_lp, ref_argmax = _hf_logprobs(folder, new, r.token_ids)
        assert ref_argmax.tolist() == r.token_ids
        assert (ref_lp - torch.tensor(r.logprobs)).abs().max().item() < 1e-3
    finally:
        eng.shutdown()
