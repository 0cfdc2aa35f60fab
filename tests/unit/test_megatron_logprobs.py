"""The Megatron backend's token log-probs (megatron's own labels path: the vocab-parallel cross
entropy works in place on the output layer's logits, the temperature divides the output
layer's input) equal log_softmax(logits / T) of the same weights in HF transformers, in value
and in the gradient of the tied embedding/output weight."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cpu


@pytest.fixture
def one_rank(one_rank_gloo):
    import megatron_patches

    from rhymerl.config import ParallelConfig
    from rhymerl.distributed.process_groups import destroy_process_groups, init_process_groups

    fresh = not megatron_patches.applied()
    try:
        yield lambda: init_process_groups(ParallelConfig(), 1, 0)
    finally:
        destroy_process_groups()
        if fresh:
            megatron_patches.revert_all()


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (3, 12), generator=g)
    mask = torch.zeros(3, 12)
    mask[:, 4:] = 1
    mask[1, :6] = 0
    mask[2, 9:] = 0
    weights = torch.tensor([1.0, -0.5, 0.25])
    return ids, mask, weights


def _hf_reference(model_dir, ids, mask, weights, temperature):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    logits = hf(input_ids=ids).logits / temperature
    lp = torch.log_softmax(logits, dim=-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros(ids.shape[0], 1), lp], dim=1)
    (lp * mask * weights[:, None]).sum().backward()
    return lp.detach() * mask, {"output": hf.get_output_embeddings().weight.grad,
                                "embedding": hf.get_input_embeddings().weight.grad, "norm": hf.model.norm.weight.grad}


def _weighted_logprob_sum(lp, old, adv, m, cfg, ref, num_tokens, num_sequences):
    return (lp * m * adv[:, None]).sum(), {}


@pytest.mark.parametrize("temperature,micro_batch_tokens,over_budget", [
    (1.0, 4096, True), (0.7, 4096, True),
    # One 12-token row per micro-batch, over an 8-token budget: each recomputes its layers in
    # backward (or, switched off, keeps its activations); the gradient is the same.
    (0.7, 8, True), (0.7, 8, False)])
def test_logprobs_and_gradient_match_hf_log_softmax(one_rank, tiny_model_dir, temperature, micro_batch_tokens,
                                                    over_budget):
    from rhymerl.config import AlgorithmConfig, ParallelConfig
    from rhymerl.training.base import PolicyBatch
    from rhymerl.training.megatron_backend import MegatronBackend

    ids, mask, weights = _batch()
    ref_lp, ref_grads = _hf_reference(tiny_model_dir, ids, mask, weights, temperature)

    # Megatron's loss scaling cancels the backend's over micro-batches, and no clipping, which
    # would rescale main_grad in place: main_grad is then this loss's gradient.
    algo = AlgorithmConfig(lr=1e-2, micro_batch_tokens=micro_batch_tokens, grad_clip=0.0)
    b = MegatronBackend(ParallelConfig(recompute_over_budget=over_budget), algo, tiny_model_dir,
                        one_rank(), temperature=temperature, loss_fn=_weighted_logprob_sum)
    # Positions the output layer sees: only from the one that predicts a micro-batch's first
    # response token on: 3 of 12 with every row in one micro-batch; one row apiece, 3 of 12, 5 of
    # 12, and 3 of the 9 the last row's micro-batch is cut to.
    seen: list[int] = []
    b.module.output_layer.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[0]))
    lp = b.compute_logprobs(ids, mask)
    per_row = sorted([12 - 3, 12 - 5, 9 - 3])
    assert sorted(seen) == (per_row if micro_batch_tokens < 12 else [12 - 3])
    torch.testing.assert_close(lp, ref_lp, rtol=1e-4, atol=1e-5)
    assert (ref_lp != 0).sum() == mask.sum()

    seen.clear()
    out = b.train_step(PolicyBatch(ids, mask, weights))
    assert sorted(seen) == (per_row if micro_batch_tokens < 12 else [12 - 3])
    recomputed = 3 if micro_batch_tokens < 12 and over_budget else 0
    assert b.recomputed_micro_batches == out.extra["recomputed_micro_batches"] == recomputed
    assert b.config.recompute_granularity is None  # switched for those forwards only
    grads = {n: p.main_grad for n, p in b.model.named_parameters()}
    # The output weight is the embedding when tied (SmolLM2), a weight of its own otherwise.
    megatron_names = {"embedding": "embedding.word_embeddings.weight", "norm": "decoder.final_layernorm.weight",
                      "output": "output_layer.weight" if not b.layout.tied else "embedding.word_embeddings.weight"}
    for key, suffix in megatron_names.items():
        got = next(g for n, g in grads.items() if n.endswith(suffix))
        want = ref_grads[key]
        assert want.abs().sum() > 0, key
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5, msg=key)

def test_debug_logits_are_at_the_sampling_temperature(one_rank, tiny_model_dir):
    from rhymerl.config import AlgorithmConfig, ParallelConfig
    from rhymerl.training.megatron_backend import MegatronBackend

    ids, mask, _ = _batch()
    b = MegatronBackend(ParallelConfig(), AlgorithmConfig(micro_batch_tokens=4096), tiny_model_dir, one_rank(),
                        temperature=0.5, train=False)
    logits = b.forward_logits(ids)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(input_ids=ids).logits / 0.5, rtol=1e-4, atol=1e-4)
    lp = torch.log_softmax(logits, dim=-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    got = b.compute_logprobs(ids, mask)
    torch.testing.assert_close(got[:, 1:], lp * mask[:, 1:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_grpo_step_moves_logprobs_towards_its_advantages(one_rank, tiny_model_dir, sign):
    """train/update_gain's premise, on the real backend and loss: one step of the clipped
    policy loss raises the advantage-weighted log-probs of its own batch, whichever way the
    advantages point."""
    from rhymerl.algorithms import update_gain
    from rhymerl.config import AlgorithmConfig, ParallelConfig
    from rhymerl.training.base import PolicyBatch
    from rhymerl.training.megatron_backend import MegatronBackend

    ids, mask, weights = _batch()
    adv = sign * weights
    b = MegatronBackend(ParallelConfig(), AlgorithmConfig(lr=1e-3), tiny_model_dir, one_rank())
    before = b.compute_logprobs(ids, mask)
    b.train_step(PolicyBatch(ids, mask, adv))
    after = b.compute_logprobs(ids, mask)
    assert update_gain(adv, before, after, mask) > 0
    assert update_gain(-adv, before, after, mask) < 0


@pytest.mark.parametrize("advantages,skipped", [((1.0, 0.0, -0.5), 1), ((0.0, 0.0, 0.0), 2)])
def test_rows_without_advantage_are_not_run_and_the_update_is_unchanged(one_rank, tiny_model_dir, advantages,
                                                                          skipped):
    """The backend leaves zero-advantage rows out of the forward and backward (the output
    layer sees the rest; an all-zero batch runs its shortest row) and the step's gradient and
    updated weights are those of the whole batch."""
    from rhymerl.config import AlgorithmConfig, ParallelConfig
    from rhymerl.training.base import PolicyBatch
    from rhymerl.training.megatron_backend import MegatronBackend

    ids, mask, _ = _batch()
    adv = torch.tensor(advantages)
    steps = {}
    for skip in (True, False):
        algo = AlgorithmConfig(lr=1e-2, micro_batch_tokens=4096, skip_zero_advantage_rows=skip)
        b = MegatronBackend(ParallelConfig(), algo, tiny_model_dir, one_rank(), temperature=0.7)
        rows: list[int] = []
        b.module.output_layer.register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[1]))
        out = b.train_step(PolicyBatch(ids, mask, adv))
        grads = torch.cat([p.main_grad.flatten() for p in b.model.parameters()])
        weights = torch.cat([p.detach().flatten() for p in b.model.parameters()])
        steps[skip] = (out, rows, grads, weights)
    (on, rows_on, g_on, w_on), (off, rows_off, g_off, w_off) = steps[True], steps[False]
    assert on.extra["rows_skipped"] == skipped and off.extra["rows_skipped"] == 0
    assert rows_on == [3 - skipped] and rows_off == [3]
    assert on.extra["tokens"] == float(mask[adv != 0].sum() if skipped < 2 else mask[2].sum())
    if skipped == 2:
        assert float(g_off.abs().max()) == 0.0 and float(g_on.abs().max()) == 0.0
    else:
        assert float(g_off.abs().max()) > 0
        torch.testing.assert_close(g_on, g_off, rtol=1e-5, atol=1e-6 * float(g_off.abs().max()))
    torch.testing.assert_close(w_on, w_off, rtol=1e-6, atol=1e-7)
    assert on.loss == pytest.approx(off.loss, rel=1e-5, abs=1e-7)
