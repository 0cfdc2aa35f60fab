"""parallel.attention=sdpa computes megatron's core attention: same outputs and gradients as
megatron's unfused DotProductAttention (grouped-query heads, causal), without its score matrix."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.cpu


@pytest.fixture
def one_rank(one_rank_gloo):
    import megatron_patches
    from megatron.core import parallel_state, tensor_parallel

    fresh = not megatron_patches.applied()
    if fresh:
        megatron_patches.apply_all("cpu")
    # megatron's unfused attention computes its scores into this buffer.
    parallel_state._set_global_memory_buffer()
    # Its dropout region forks this stream of the model-parallel RNG tracker.
    tensor_parallel.get_cuda_rng_tracker().add("model-parallel-rng", 0)
    try:
        yield
    finally:
        tensor_parallel.get_cuda_rng_tracker().reset()
        parallel_state.destroy_global_memory_buffer()
        if fresh:
            megatron_patches.revert_all()


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=96, num_attention_heads=6, num_query_groups=2, kv_channels=16,
                ffn_hidden_size=64, hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
                attention_softmax_in_fp32=True, use_cpu_initialization=True)
    return TransformerConfig(**{**base, **kw})


def _both(config, mask_type):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from rhymerl.training.sdpa_attention import SdpaDotProductAttention

    pgs = ProcessGroupCollection(tp=dist.group.WORLD)
    kw = dict(config=config, layer_number=1, attn_mask_type=mask_type, attention_type="self", pg_collection=pgs)
    return DotProductAttention(**kw), SdpaDotProductAttention(**kw)


@pytest.mark.parametrize("causal", [True, False])
def test_outputs_and_gradients_match_megatrons_unfused_attention(one_rank, causal):
    from megatron.core.transformer.enums import AttnMaskType

    unfused, sdpa = _both(_config(), AttnMaskType.causal if causal else AttnMaskType.no_mask)
    torch.manual_seed(0)
    s, b = 37, 3
    q = torch.randn(s, b, 6, 16, requires_grad=True)
    k = torch.randn(s, b, 2, 16, requires_grad=True)
    v = torch.randn(s, b, 2, 16, requires_grad=True)
    outs, grads = [], []
    for attn in (unfused, sdpa):
        out = attn(q, k, v, None)
        weights = torch.linspace(-1, 1, out.numel()).view_as(out)
        g = torch.autograd.grad((out * weights).sum(), (q, k, v))
        outs.append(out.detach())
        grads.append(g)
    assert outs[1].shape == (s, b, 96)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(grads[1], grads[0]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    if causal:
        # The first position attends to itself only: a causal mask is really applied.
        torch.testing.assert_close(outs[1][0].view(b, 6, 16)[:, :3], v[0, :, :1].expand(b, 3, 16).detach())


def test_what_it_cannot_compute_is_refused_by_name(one_rank):
    from megatron.core.transformer.enums import AttnMaskType

    with pytest.raises(ValueError, match=r"parallel.attention=sdpa does not support attention_dropout > 0"):
        _both(_config(attention_dropout=0.1), AttnMaskType.causal)
    _, sdpa = _both(_config(), AttnMaskType.causal)
    q = torch.randn(4, 1, 6, 16)
    kv = torch.randn(4, 1, 2, 16)
    with pytest.raises(ValueError, match="explicit attention masks"):
        sdpa(q, kv, kv, torch.zeros(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="as many keys as queries"):
        sdpa(q, torch.randn(5, 1, 2, 16), torch.randn(5, 1, 2, 16), None)


def test_the_layer_spec_takes_the_configured_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from rhymerl.training.megatron_backend import layer_spec
    from rhymerl.training.sdpa_attention import SdpaDotProductAttention

    assert layer_spec("sdpa").submodules.self_attention.submodules.core_attention is SdpaDotProductAttention
    assert layer_spec("unfused").submodules.self_attention.submodules.core_attention is DotProductAttention
