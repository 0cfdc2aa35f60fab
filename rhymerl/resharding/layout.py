"""Megatron-core <-> HF name and layout maps for Llama/Qwen2 decoders."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


class LayoutError(ValueError):
    """An HF config or parallel layout the Megatron backend cannot represent."""


@dataclass(frozen=True)
class ModelLayout:
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied: bool
    qkv_bias: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, config: dict, where: str = "config.json") -> "ModelLayout":
        archs = config.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise LayoutError(f"{where}: architecture {archs} is not supported by the Megatron backend; "
                              f"supported: {', '.join(sorted(ARCHITECTURES))}")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise LayoutError(f"{where}: rope_type {rope_type!r} is not supported (only default RoPE)")
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        if config.get("hidden_act", "silu") != "silu":
            raise LayoutError(f"{where}: hidden_act {config.get('hidden_act')!r} is not supported (only silu)")
        if config.get("mlp_bias", False):
            raise LayoutError(f"{where}: mlp_bias=true is not supported")
        if config.get("use_sliding_window", False):
            raise LayoutError(f"{where}: sliding-window attention is not supported")
        heads = config["num_attention_heads"]
        return cls(
            arch=arch, num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"], num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            ffn_hidden_size=config["intermediate_size"], vocab_size=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)))

    def check_parallel(self, tp: int, pp: int) -> None:
        for what, n, size, key in (("attention heads", self.num_heads, tp, "tensor_parallel"),
                                   ("key/value heads", self.num_kv_heads, tp, "tensor_parallel"),
                                   ("intermediate size", self.ffn_hidden_size, tp, "tensor_parallel"),
                                   ("vocabulary", self.vocab_size, tp, "tensor_parallel"),
                                   ("layers", self.num_layers, pp, "pipeline_parallel")):
            if n % size:
                raise LayoutError(f"parallel.{key}={size} does not divide the model's {n} {what}")

    def layers_per_stage(self, pp: int) -> int:
        return self.num_layers // pp


@dataclass(frozen=True)
class ParamSpec:
    """One Megatron parameter: its global name, where it lives and which HF tensors it holds."""

    name: str                 # global Megatron name (global layer index)
    hf_names: tuple[str, ...]
    kind: str                 # "copy" | "qkv" | "fc1"
    tp_dim: Optional[int]     # None = replicated across TP
    stage: int                # owning pipeline stage
    layer: Optional[int]      # global layer index, None outside the decoder layers

    def local_name(self, layout: ModelLayout, pp: int) -> str:
        if self.layer is None:
            return self.name
        local = self.layer - self.stage * layout.layers_per_stage(pp)
        return self.name.replace(f"decoder.layers.{self.layer}.", f"decoder.layers.{local}.", 1)

    def hf_shapes(self, layout: ModelLayout) -> list[tuple[int, ...]]:
        return [hf_shape(layout, n) for n in self.hf_names]


def hf_shape(layout: ModelLayout, name: str) -> tuple[int, ...]:
    h, hd = layout.hidden_size, layout.head_dim
    leaf = name.rsplit(".", 2)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (layout.vocab_size, h)
    if name.endswith("norm.weight"):
        return (h,)
    mod, kind = leaf[-2], leaf[-1]
    rows = {"q_proj": layout.num_heads * hd, "k_proj": layout.num_kv_heads * hd, "v_proj": layout.num_kv_heads * hd,
            "gate_proj": layout.ffn_hidden_size, "up_proj": layout.ffn_hidden_size}
    if mod in rows:
        return (rows[mod],) if kind == "bias" else (rows[mod], h)
    if mod == "o_proj":
        return (h, layout.num_heads * hd)
    if mod == "down_proj":
        return (h, layout.ffn_hidden_size)
    raise LayoutError(f"unknown HF tensor {name}")


def param_specs(layout: ModelLayout, pp: int = 1) -> list[ParamSpec]:
    """Every Megatron parameter in HF order (embedding, layers, final norm, head)."""
    lps = layout.layers_per_stage(pp)
    specs = [ParamSpec("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "copy", 0, 0, None)]
    for i in range(layout.num_layers):
        s, m, d = i // lps, f"model.layers.{i}.", f"decoder.layers.{i}."
        att = m + "self_attn."
        specs.append(ParamSpec(d + "input_layernorm.weight", (m + "input_layernorm.weight",), "copy", None, s, i))
        specs.append(ParamSpec(d + "self_attention.linear_qkv.weight",
                               (att + "q_proj.weight", att + "k_proj.weight", att + "v_proj.weight"), "qkv", 0, s, i))
        if layout.qkv_bias:
            specs.append(ParamSpec(d + "self_attention.linear_qkv.bias",
                                   (att + "q_proj.bias", att + "k_proj.bias", att + "v_proj.bias"), "qkv", 0, s, i))
        specs.append(ParamSpec(d + "self_attention.linear_proj.weight", (att + "o_proj.weight",), "copy", 1, s, i))
        specs.append(ParamSpec(d + "pre_mlp_layernorm.weight", (m + "post_attention_layernorm.weight",), "copy", None, s, i))
        specs.append(ParamSpec(d + "mlp.linear_fc1.weight", (m + "mlp.gate_proj.weight", m + "mlp.up_proj.weight"), "fc1", 0, s, i))
        specs.append(ParamSpec(d + "mlp.linear_fc2.weight", (m + "mlp.down_proj.weight",), "copy", 1, s, i))
    specs.append(ParamSpec("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None, pp - 1, None))
    if not layout.tied:
        specs.append(ParamSpec("output_layer.weight", ("lm_head.weight",), "copy", 0, pp - 1, None))
    return specs


def hf_names(layout: ModelLayout) -> list[str]:
    return [n for s in param_specs(layout) for n in s.hf_names]


def _fuse_qkv(layout: ModelLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    ng, hd = layout.num_kv_heads, layout.head_dim
    tail = q.shape[1:]
    q = q.reshape(ng, (layout.num_heads // ng) * hd, *tail)
    k = k.reshape(ng, hd, *tail)
    v = v.reshape(ng, hd, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _split_qkv(layout: ModelLayout, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, hd = layout.num_kv_heads, layout.head_dim
    qpg = (layout.num_heads // ng) * hd
    tail = fused.shape[1:]
    g = fused.reshape(ng, qpg + 2 * hd, *tail)
    q, k, v = torch.split(g, [qpg, hd, hd], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(), v.reshape(-1, *tail).contiguous())


def shard_from_hf(spec: ParamSpec, layout: ModelLayout, get: Callable[[str], torch.Tensor],
                  tp: int = 1, tp_rank: int = 0) -> torch.Tensor:
    """The TP rank's shard of one Megatron parameter, from HF tensors (``get(hf_name)``)."""
    if spec.kind == "qkv":
        full = _fuse_qkv(layout, *(get(n) for n in spec.hf_names))
        return full.chunk(tp, dim=0)[tp_rank].contiguous()
    if spec.kind == "fc1":
        gate, up = (get(n) for n in spec.hf_names)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    t = get(spec.hf_names[0])
    if spec.tp_dim is None or tp == 1:
        return t.contiguous()
    return t.chunk(tp, dim=spec.tp_dim)[tp_rank].contiguous()


def hf_from_shards(spec: ParamSpec, layout: ModelLayout, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """HF tensors of one Megatron parameter from the shards of all TP ranks (in rank order)."""
    if spec.kind == "qkv":
        return list(zip(spec.hf_names, _split_qkv(layout, torch.cat(shards, dim=0))))
    if spec.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        if len(halves) == 1:
            # Row halves of a contiguous tensor are contiguous: hand out views, no copy.
            return [(spec.hf_names[0], halves[0][0]), (spec.hf_names[1], halves[0][1])]
        gate = torch.cat([h[0] for h in halves], dim=0)
        up = torch.cat([h[1] for h in halves], dim=0)
        return [(spec.hf_names[0], gate), (spec.hf_names[1], up)]
    if spec.tp_dim is None or len(shards) == 1:
        return [(spec.hf_names[0], shards[0].contiguous())]
    return [(spec.hf_names[0], torch.cat(shards, dim=spec.tp_dim))]


def shard_shape(spec: ParamSpec, layout: ModelLayout, tp: int) -> tuple[int, ...]:
    shapes = spec.hf_shapes(layout)
    if spec.kind in ("qkv", "fc1"):
        rows = sum(s[0] for s in shapes)
        return (rows // tp, *shapes[0][1:])
    shape = list(shapes[0])
    if spec.tp_dim is not None:
        shape[spec.tp_dim] //= tp
    return tuple(shape)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_name(local: str, layout: ModelLayout, pp: int, pp_rank: int) -> str:
    """Megatron local parameter name on stage ``pp_rank`` -> global name."""
    m = _LAYER.match(local)
    if not m:
        return local
    g = int(m.group(1)) + pp_rank * layout.layers_per_stage(pp)
    return f"decoder.layers.{g}." + local[m.end():]


def iter_stage_specs(layout: ModelLayout, pp: int, pp_rank: int, embedding_on_last: bool = True) -> Iterator[ParamSpec]:
    """The parameters stage ``pp_rank`` holds (tied and PP > 1: the last stage's ``output_layer.weight`` too)."""
    for spec in param_specs(layout, pp):
        if spec.stage == pp_rank:
            yield spec
    if layout.tied and pp > 1 and pp_rank == pp - 1 and embedding_on_last:
        yield ParamSpec("output_layer.weight", ("model.embed_tokens.weight",), "copy", 0, pp - 1, None)
