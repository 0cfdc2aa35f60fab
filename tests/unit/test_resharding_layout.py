"""HF <-> Megatron name/layout maps and the bucketed exporter, without torch.distributed."""

from __future__ import annotations

import json

import pytest
import torch

from rhymerl.resharding.stream import HFExportStats, export_hf_buckets
from rhymerl.resharding.layout import (
    LayoutError,
    ModelLayout,
    global_name,
    hf_from_shards,
    hf_names,
    hf_shape,
    iter_stage_specs,
    param_specs,
    shard_from_hf,
    shard_shape,
)

pytestmark = pytest.mark.cpu


def _config(**over) -> dict:
    c = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 64, "tie_word_embeddings": False}
    c.update(over)
    return c


def _random_hf(layout: ModelLayout, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(hf_shape(layout, n), generator=g) for n in hf_names(layout)}


@pytest.mark.parametrize("heads,kv", [(8, 8), (8, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "LlamaForCausalLM"])
def test_shards_gather_back_to_hf_exactly(heads, kv, tp, arch):
    layout = ModelLayout.from_hf_config(_config(architectures=[arch], num_attention_heads=heads, num_key_value_heads=kv))
    if kv % tp:
        with pytest.raises(LayoutError, match="key/value heads"):
            layout.check_parallel(tp, 1)
        return
    layout.check_parallel(tp, 1)
    hf = _random_hf(layout)
    for spec in param_specs(layout):
        shards = [shard_from_hf(spec, layout, hf.__getitem__, tp, r) for r in range(tp)]
        for s in shards:
            assert tuple(s.shape) == shard_shape(spec, layout, tp)
        for name, t in hf_from_shards(spec, layout, shards):
            assert torch.equal(t, hf[name]), (spec.name, name)


def test_fused_qkv_layout_is_grouped_per_kv_head():
    layout = ModelLayout.from_hf_config(_config(num_attention_heads=4, num_key_value_heads=2, hidden_size=8))
    hd = layout.head_dim  # 2
    q = torch.arange(4 * hd, dtype=torch.float32)[:, None].expand(-1, 8).contiguous()
    k = 100 + torch.arange(2 * hd, dtype=torch.float32)[:, None].expand(-1, 8).contiguous()
    v = 200 + torch.arange(2 * hd, dtype=torch.float32)[:, None].expand(-1, 8).contiguous()
    hf = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
          "model.layers.0.self_attn.v_proj.weight": v}
    spec = next(s for s in param_specs(layout) if s.name == "decoder.layers.0.self_attention.linear_qkv.weight")
    fused = shard_from_hf(spec, layout, hf.__getitem__)[:, 0].tolist()
    # group 0: q heads 0,1 then k head 0 then v head 0; group 1 likewise.
    assert fused == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    # At TP=2 each rank owns one whole group.
    assert shard_from_hf(spec, layout, hf.__getitem__, 2, 1)[:, 0].tolist() == fused[8:]


def test_fc1_shard_holds_gate_then_up_of_its_slice():
    layout = ModelLayout.from_hf_config(_config())
    hf = _random_hf(layout)
    spec = next(s for s in param_specs(layout) if s.name.endswith("linear_fc1.weight"))
    gate, up = (hf[n] for n in spec.hf_names)
    shard = shard_from_hf(spec, layout, hf.__getitem__, 2, 1)
    assert torch.equal(shard, torch.cat([gate[24:], up[24:]]))


def test_specs_cover_the_tiny_models_exactly(tiny_model_dir):
    from safetensors import safe_open

    layout = ModelLayout.from_hf_config(json.loads((tiny_model_dir / "config.json").read_text()))
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
    assert set(hf_names(layout)) == keys
    assert {n: hf_shape(layout, n) for n in keys} == shapes


def test_tied_models_have_no_lm_head_and_pp_last_stage_keeps_a_copy():
    layout = ModelLayout.from_hf_config(_config(tie_word_embeddings=True))
    assert "lm_head.weight" not in hf_names(layout)
    last = [s.name for s in iter_stage_specs(layout, 2, 1)]
    assert "output_layer.weight" in last and "decoder.final_layernorm.weight" in last
    assert "embedding.word_embeddings.weight" in [s.name for s in iter_stage_specs(layout, 2, 0)]
    assert "output_layer.weight" not in [s.name for s in iter_stage_specs(layout, 1, 0)]


def test_pipeline_stage_offsets():
    layout = ModelLayout.from_hf_config(_config(num_hidden_layers=4))
    stage1 = list(iter_stage_specs(layout, 2, 1))
    layers = sorted({s.layer for s in stage1 if s.layer is not None})
    assert layers == [2, 3]
    spec = next(s for s in stage1 if s.layer == 2 and s.name.endswith("input_layernorm.weight"))
    assert spec.local_name(layout, 2) == "decoder.layers.0.input_layernorm.weight"
    assert global_name("decoder.layers.1.mlp.linear_fc2.weight", layout, 2, 1) == "decoder.layers.3.mlp.linear_fc2.weight"
    assert global_name("output_layer.weight", layout, 2, 1) == "output_layer.weight"


@pytest.mark.parametrize("bad,match", [
    ({"architectures": ["GPT2LMHeadModel"]}, "not supported"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
    ({"use_sliding_window": True}, "sliding"),
])
def test_unsupported_configs_are_named(bad, match):
    with pytest.raises(LayoutError, match=match):
        ModelLayout.from_hf_config(_config(**bad))


def test_parallel_sizes_must_divide_the_model():
    layout = ModelLayout.from_hf_config(_config(num_hidden_layers=3))
    with pytest.raises(LayoutError, match="pipeline_parallel=2 does not divide the model's 3 layers"):
        layout.check_parallel(1, 2)
    with pytest.raises(LayoutError, match="tensor_parallel=3"):
        layout.check_parallel(3, 1)


def _megatron_module(layout: ModelLayout, hf: dict) -> torch.nn.Module:
    m = torch.nn.Module()
    for spec in param_specs(layout):
        # Dotted names as a flat ParameterDict would mangle them; register on nested modules.
        *path, leaf = spec.name.split(".")
        node = m
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, torch.nn.Parameter(shard_from_hf(spec, layout, hf.__getitem__)))
    return m


@pytest.mark.parametrize("bucket_bytes", [1, 3000, 20_000, 10 ** 9])
def test_exporter_buckets_are_bounded_and_complete(bucket_bytes):
    layout = ModelLayout.from_hf_config(_config())
    hf = _random_hf(layout)
    module = _megatron_module(layout, hf)
    stats = HFExportStats()
    seen = {}
    largest = max(t.numel() * 4 for t in hf.values())
    largest_param = max(sum(t.numel() * 4 for n, t in hf.items() if n in s.hf_names) for s in param_specs(layout))
    for bucket in export_hf_buckets(module, layout, None, bucket_bytes, stats=stats):
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= max(bucket_bytes, largest_param)
        for name, t in bucket:
            assert name not in seen
            seen[name] = t.clone()
    assert list(seen) == hf_names(layout)  # HF order
    assert all(torch.equal(seen[n], hf[n]) for n in hf)
    assert stats.bytes_out == sum(t.numel() * 4 for t in hf.values())
    assert stats.peak_extra_bytes <= max(bucket_bytes, largest_param) + largest_param
    assert stats.buckets == len(stats.bucket_sizes) >= 1
    if bucket_bytes == 1:
        assert stats.buckets == len(param_specs(layout))
    assert largest > 0


def test_exporter_hands_out_views_where_no_conversion_is_needed():
    layout = ModelLayout.from_hf_config(_config())
    module = _megatron_module(layout, _random_hf(layout))
    params = dict(module.named_parameters())
    stats = HFExportStats()
    out = {n: t for b in export_hf_buckets(module, layout, None, 10 ** 9, stats=stats) for n, t in b}
    emb = params["embedding.word_embeddings.weight"]
    assert out["model.embed_tokens.weight"].data_ptr() == emb.data_ptr()
    # Only the fused QKV (interleaved per group) needs new memory at TP=1.
    qkv = sum(p.numel() * 4 for n, p in params.items() if "linear_qkv" in n)
    assert stats.peak_extra_bytes == qkv
