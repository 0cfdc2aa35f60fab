"""A tiny random Llama/Qwen2 model, generated deterministically from a seed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from rhymerl.models.tokenizer import save_tokenizer


@dataclass(frozen=True)
class TinyShape:
    """Shape of ``builtin:tiny``, the tests' deterministic random model (others pass one to ``resolve_model``)."""

    architecture: Literal["llama", "qwen2"] = "llama"
    seed: int = 0
    hidden_size: int = 128  # head size 32: the smallest vLLM's CPU attention kernels support
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    # As long as rollout.max_model_len's default, so default prompt and response lengths fit.
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False


def write_tiny_model(folder: Path, tiny: TinyShape, dtype: str = "float32") -> None:
    import transformers

    vocab = save_tokenizer(folder)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    # initializer_range: wider than HF's, so next-token distributions are peaked, with structure worth drafting.
    common = dict(
        vocab_size=vocab, hidden_size=tiny.hidden_size, intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers, num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads, max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=tiny.tie_word_embeddings, rms_norm_eps=1e-6, rope_theta=10000.0,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None, initializer_range=0.2,
        torch_dtype=dtype)
    if tiny.architecture == "llama":
        config = transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen2Config(**common, use_sliding_window=False)
        cls = transformers.Qwen2ForCausalLM
    gen = torch.Generator().manual_seed(tiny.seed)
    model = cls(config)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(config.initializer_range * torch.randn(p.shape, generator=gen))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(folder), safe_serialization=True)
    model.generation_config.save_pretrained(str(folder))
