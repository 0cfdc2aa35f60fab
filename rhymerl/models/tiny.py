"""A tiny random Llama/Qwen2 model, generated deterministically from a seed."""

from __future__ import annotations

from pathlib import Path

from rhymerl.config import TinyModelConfig
from rhymerl.models.tokenizer import save_tokenizer


def write_tiny_model(folder: Path, tiny: TinyModelConfig, dtype: str = "float32") -> None:
    import torch
    import transformers

    vocab = save_tokenizer(folder)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    common = dict(
        vocab_size=vocab,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=tiny.tie_word_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        # A wider init than HF's default makes the random model's next-token
        # distributions peaked rather than near uniform, so greedy runs are diverse
        # and sampled runs have structure worth drafting.
        initializer_range=0.2,
        torch_dtype=dtype,
    )
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
