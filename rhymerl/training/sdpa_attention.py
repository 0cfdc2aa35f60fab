"""megatron-core's core attention through torch's fused ``scaled_dot_product_attention`` (no score matrices)."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SdpaDotProductAttention(DotProductAttention):
    """Causal (or unmasked) self-attention over megatron's [s, b, heads, head_dim] layout."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, attention_type, *args, **kwargs)
        unsupported = []
        if config.softmax_type != "vanilla":
            unsupported.append(f"softmax_type={config.softmax_type!r}")
        if config.window_size is not None:
            unsupported.append("window_size")
        if config.apply_query_key_layer_scaling:
            unsupported.append("apply_query_key_layer_scaling")
        if (kwargs.get("attention_dropout") or config.attention_dropout) > 0:
            # megatron draws attention dropout from its CUDA RNG tracker; RL training runs without it.
            unsupported.append("attention_dropout > 0")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            unsupported.append(f"attn_mask_type={attn_mask_type}")
        if unsupported:
            raise ValueError(f"parallel.attention=sdpa does not support {', '.join(unsupported)}; "
                             "set parallel.attention=unfused")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("parallel.attention=sdpa: packed sequences and attention biases are not supported")
        if attention_mask is not None:
            # megatron's masks are True where attention is *not* allowed; SDPA's the opposite.
            raise ValueError("parallel.attention=sdpa: explicit attention masks are not supported "
                             "(the trainer's rows are right-padded and causal)")
        sq, b = query.shape[0], query.shape[1]
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        if causal and key.shape[0] != sq:
            # SDPA aligns a causal mask top-left, megatron bottom-right; the trainer never has sq != sk.
            raise ValueError(f"parallel.attention=sdpa: causal attention needs as many keys as queries "
                             f"(got {sq} queries, {key.shape[0]} keys)")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, heads, d] -> [b, heads, s, d]
        grouped = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        context = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.softmax_scale,
                                                                   enable_gqa=grouped)
        # [b, heads, s, d] -> [s, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
