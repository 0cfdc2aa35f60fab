"""Lossless speculative sampling on the CPU path (vLLM's rejection sampler + our CPU fix), for
the batches HistoSpec actually sends: draft tokens without draft probabilities, per-request
temperatures in one batch (greedy 0 next to 0.7, 1.0, 1.3), top-k and top-p, and draft lengths
that differ per request and from one step to the next.

Every emitted token, at every draft position and the bonus position, must follow the target
distribution after the request's own temperature, top-k and top-p: for position j, among the rows
whose first j tokens were the accepted drafts, the token at j is a sample of that position's
processed target distribution, whatever the draft proposed there. Greedy rows must emit the argmax.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.integration]

VOCAB = 8
COPIES = 1500  # rows per request configuration
# (temperature, top_k, top_p); top_k = VOCAB and top_p = 1.0 mean "off", as vLLM's input batch sets them.
CONFIGS = [(0.0, VOCAB, 1.0), (0.7, VOCAB, 1.0), (1.0, VOCAB, 1.0), (1.3, VOCAB, 1.0),
           (1.0, 3, 1.0), (1.0, VOCAB, 0.7), (1.3, 4, 0.8)]


@pytest.fixture(scope="module")
def rs():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the CPU fix is what is tested; GPU runs vLLM's own kernels")
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample import rejection_sampler

    from rhymerl.rollout import vllm_patches

    vllm_patches.apply_all()
    return rejection_sampler


def reference_probs(logits, temperature: float, top_k: int, top_p: float):
    """The distribution a request samples from: temperature, then top-k, then top-p (nucleus)."""
    import torch

    z = logits / temperature
    if top_k < z.numel():
        z = z.masked_fill(z < z.topk(top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        p_sorted, idx = torch.softmax(z, -1).sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (at least one token).
        keep = (p_sorted.cumsum(-1) - p_sorted) < top_p
        z = z.masked_fill(~keep.scatter(0, idx, keep), float("-inf"))
    return torch.softmax(z, -1)


def _metadata(temps, top_k, top_p, spec_tokens):
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    n = len(temps)
    return SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32), all_greedy=False, all_random=False,
        top_p=torch.tensor(top_p, dtype=torch.float32), top_k=torch.tensor(top_k, dtype=torch.int64),
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(), spec_token_ids=spec_tokens)


def run_step(rs, pos_logits, drafts_per_config: list[list[int]], seed: int):
    """One verification step: COPIES rows per configuration, row r of config c drafting
    ``drafts_per_config[c]`` over the position logits ``pos_logits[c]`` (one row per draft position
    plus the bonus position). Returns the sampled token ids [rows, max_len + 1] and row -> config."""
    import torch
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    torch.manual_seed(seed)
    temps, top_k, top_p, spec, logits_rows, configs = [], [], [], [], [], []
    for _ in range(COPIES):
        for c, (t, k, p) in enumerate(CONFIGS):
            d = drafts_per_config[c]
            temps.append(t), top_k.append(k), top_p.append(p), spec.append(list(d)), configs.append(c)
            logits_rows.append(pos_logits[c][: len(d) + 1])
    meta = SpecDecodeMetadata.make_dummy(spec, device=torch.device("cpu"))
    # Row layout of the model's logits for a step: each request's draft positions, then its bonus.
    target_idx, bonus_idx, at = [], [], 0
    for d in spec:
        target_idx.extend(range(at, at + len(d)))
        bonus_idx.append(at + len(d))
        at += len(d) + 1
    meta.target_logits_indices = torch.tensor(target_idx, dtype=torch.int32)
    meta.bonus_logits_indices = torch.tensor(bonus_idx, dtype=torch.int32)
    meta.logits_indices = torch.arange(at, dtype=torch.int32)
    sampler = rs.RejectionSampler(Sampler(logprobs_mode="raw_logprobs"))
    out = sampler(meta, draft_probs=None, logits=torch.cat(logits_rows).clone(),
                  sampling_metadata=_metadata(temps, top_k, top_p, spec))
    return out.sampled_token_ids, configs


def check_distributions(rs, pos_logits, drafts_per_config, seed: int) -> None:
    import torch

    ids, configs = run_step(rs, pos_logits, drafts_per_config, seed)
    configs = torch.tensor(configs)
    for c, (t, k, p) in enumerate(CONFIGS):
        rows = ids[configs == c]
        d = torch.tensor(drafts_per_config[c], dtype=rows.dtype)
        for j in range(len(d) + 1):
            reached = (rows[:, :j] == d[:j]).all(1) if j else torch.ones(len(rows), dtype=torch.bool)
            got = rows[reached, j]
            if t == 0.0:
                assert (got == pos_logits[c][j].argmax()).all(), (c, j, got.unique())
                continue
            if len(got) < 200:
                continue  # too few rows reach this position for a statistic
            want = reference_probs(pos_logits[c][j], t, k, p)
            emp = torch.bincount(got, minlength=VOCAB).double() / len(got)
            # Total variation vs the target; 4 standard errors of the multinomial, summed over tokens.
            bound = 4 * float(((want * (1 - want)).sqrt()).sum()) / len(got) ** 0.5 / 2 + 1e-3
            tv = 0.5 * float((emp - want.double()).abs().sum())
            assert tv <= bound, f"config {CONFIGS[c]} position {j}: TV {tv:.3f} > {bound:.3f} over {len(got)} rows"
            assert emp[want == 0].sum() == 0, f"config {CONFIGS[c]} position {j}: sampled a masked token"


def _position_logits(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, VOCAB, generator=g) * 1.5 for _ in CONFIGS]


def test_mixed_batch_follows_each_requests_distribution_with_varying_draft_lengths(rs):
    pos_logits = _position_logits(0)
    # Drafts: the target's likeliest token at some positions (mostly accepted), a mid-ranked one at
    # others (mostly rejected), lengths 1-5 differing per request and between the two steps.
    def drafts(lengths, rank_at):
        return [[int(pos_logits[c][j].argsort(descending=True)[rank_at(c, j)]) for j in range(n)]
                for c, n in enumerate(lengths)]

    check_distributions(rs, pos_logits, drafts([1, 3, 2, 4, 5, 2, 3], lambda c, j: (c + j) % 3), seed=1)
    check_distributions(rs, pos_logits, drafts([4, 1, 5, 2, 1, 3, 2], lambda c, j: 0 if j % 2 else 2), seed=2)


def test_reference_distribution_is_what_the_config_says():
    import torch

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0, -4.0])
    assert torch.allclose(reference_probs(logits, 1.0, VOCAB, 1.0), torch.softmax(logits, -1))
    topk = reference_probs(logits, 0.7, 3, 1.0)
    assert (topk[3:] == 0).all() and torch.allclose(topk[:3], torch.softmax(logits[:3] / 0.7, -1))
    nucleus = reference_probs(logits, 1.0, VOCAB, 0.7)
    full = torch.softmax(logits, -1)
    kept = int((nucleus > 0).sum())
    assert full[: kept - 1].sum() < 0.7 <= full[:kept].sum()
