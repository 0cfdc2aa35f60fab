"""Synthetic rollout traces with controllable epoch-to-epoch similarity.

Lets the HistoSpec benchmark run without a model. The generative story:

* Text is made of *phrases* (2-8 tokens): a global bank shared by all prompts
  (boilerplate such as "Let me think step by step") and a bank per prompt (its
  entities and sub-results). Phrases are drawn Zipf-like, so responses repeat
  themselves a little (what n-gram prompt lookup feeds on) and prompts share some
  text (what a global suffix cache feeds on). Fresh text replaces TOKEN_NOISE of its
  tokens with random ones, so one matched token does not determine a whole phrase.
* Epoch 0: each of the n responses of a prompt is an independent phrase sequence with
  a log-normal length, ending in an answer phrase and EOS; reward 1 if its answer is
  the prompt's correct one.
* Epoch e+1: each response picks a *parent* among the prompt's epoch-e responses,
  favouring rewarded ones (weight 1 + 2 * reward: the policy moves toward what was
  reinforced), and copies it with edits: at every parent token a divergence starts
  with probability (1 - similarity) / DIVERGE_LEN; a divergence emits fresh phrases
  (about DIVERGE_LEN tokens) and resumes copying the parent a few tokens later
  (insertions, deletions and substitutions all happen). ``similarity`` is therefore
  close to the fraction of a response's tokens copied from last epoch's responses
  (the paper reports 75-95% reusable tokens). Siblings that share a parent rhyme with
  each other as well. The child's answer stays the parent's with probability 0.9.

Records carry ``reward`` and ``prompt_token_ids``; no ``logprobs`` (there is no model).
"""

from __future__ import annotations

import math

import numpy as np

from rhymerl.outputs.traces import TraceRecord

EOS = 1
DIVERGE_LEN = 6
TOKEN_NOISE = 0.15


def synthetic_trace(num_prompts: int = 32, n: int = 8, epochs: int = 3, similarity: float = 0.85,
                    mean_len: int = 256, vocab_size: int = 4096, seed: int = 0) -> list[TraceRecord]:
    if not 0.0 <= similarity <= 1.0:
        raise ValueError(f"similarity must be in [0, 1] (got {similarity})")
    rng = np.random.default_rng(seed)
    first = 16  # ids below are reserved (EOS and friends)

    def phrase_bank(size: int) -> list[list[int]]:
        return [rng.integers(first, vocab_size, size=int(rng.integers(2, 9))).tolist() for _ in range(size)]

    global_bank = phrase_bank(200)
    zipf_g = 1.0 / np.arange(1, len(global_bank) + 1) ** 1.1
    zipf_g /= zipf_g.sum()

    out: list[TraceRecord] = []
    for pid in range(num_prompts):
        bank = phrase_bank(60)
        zipf_p = 1.0 / np.arange(1, len(bank) + 1) ** 0.8
        zipf_p /= zipf_p.sum()
        answers = phrase_bank(4)
        prompt = rng.integers(first, vocab_size, size=48).tolist()

        def fresh(num_tokens: int) -> list[int]:
            m = num_tokens // 4 + 2
            use_global = rng.random(m) < 0.35
            gi = rng.choice(len(global_bank), size=m, p=zipf_g)
            pi = rng.choice(len(bank), size=m, p=zipf_p)
            toks: list[int] = []
            for k in range(m):
                toks.extend(global_bank[gi[k]] if use_global[k] else bank[pi[k]])
                if len(toks) >= num_tokens:
                    break
            # Token-level noise: a phrase's first token must not determine the rest.
            noisy = np.flatnonzero(rng.random(len(toks)) < TOKEN_NOISE)
            for k, t in zip(noisy.tolist(), rng.integers(first, vocab_size, size=len(noisy)).tolist()):
                toks[k] = t
            return toks

        prev: list[tuple[list[int], int]] = []  # (body, answer idx)
        for ep in range(epochs):
            cur = []
            for j in range(n):
                if ep == 0:
                    length = max(16, int(rng.lognormal(math.log(mean_len), 0.35)))
                    body = fresh(length)
                    ans = int(rng.integers(0, len(answers)))
                else:
                    w = np.array([1.0 + 2.0 * (a == 0) for _, a in prev])
                    pb, pa = prev[rng.choice(len(prev), p=w / w.sum())]
                    body = _mutate(pb, similarity, fresh, rng)
                    ans = pa if rng.random() < 0.9 else int(rng.integers(0, len(answers)))
                cur.append((body, ans))
                toks = body + answers[ans] + [EOS]
                out.append(TraceRecord(prompt_id=f"p{pid}", epoch=ep, sample_idx=j, token_ids=toks,
                                       reward=1.0 if ans == 0 else 0.0, prompt_token_ids=prompt))
            prev = cur
    return out


def _mutate(parent: list[int], similarity: float, fresh, rng) -> list[int]:
    child: list[int] = []
    rate = (1.0 - similarity) / DIVERGE_LEN
    i = 0
    while i < len(parent):
        # Tokens until the next divergence are geometric with the per-token rate.
        gap = int(rng.geometric(rate)) - 1 if rate > 0 else len(parent)
        child.extend(parent[i:i + gap])
        i += gap
        if i >= len(parent):
            break
        child.extend(fresh(int(rng.geometric(1.0 / DIVERGE_LEN))))
        i += int(rng.geometric(1.0 / DIVERGE_LEN))  # resume a few tokens later
    return child
