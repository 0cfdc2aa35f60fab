"""Lossless verification of one-hot draft chains: accept x with probability p(x), else resample without x."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def target_probs(logits: np.ndarray, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1) -> np.ndarray:
    """Sampling distribution over the vocabulary (last axis); temperature 0 = one-hot argmax."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature <= 0:
        out = np.zeros_like(logits)
        np.put_along_axis(out, np.argmax(logits, axis=-1)[..., None], 1.0, axis=-1)
        return out
    z = logits / temperature
    if top_k is not None and top_k > 0 and top_k < z.shape[-1]:
        kth = np.sort(z, axis=-1)[..., -top_k][..., None]
        z = np.where(z < kth, -np.inf, z)
    z = z - np.max(z, axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sp = np.take_along_axis(p, order, axis=-1)
        csum = np.cumsum(sp, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it stays).
        keep_sorted = (csum - sp) < top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def _sample(p: np.ndarray, rng: np.random.Generator) -> int:
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(p) - 1))


def verify_chain(draft: Sequence[int], probs: np.ndarray, rng: np.random.Generator | None = None,
                 greedy: bool = False) -> tuple[int, list[int]]:
    """(accepted count, emitted tokens) of a one-hot chain; ``probs[i]``: the target after draft[:i]."""
    out: list[int] = []
    for i, x in enumerate(draft):
        p = probs[i]
        if greedy:
            y = int(np.argmax(p))
            if y != x:
                return i, out + [y]
            out.append(int(x))
            continue
        if rng.random() < p[x]:
            out.append(int(x))
            continue
        r = np.array(p, dtype=np.float64)
        r[x] = 0.0
        return i, out + [_sample(r, rng)]
    last = probs[len(draft)]
    out.append(int(np.argmax(last)) if greedy else _sample(last, rng))
    return len(draft), out


def accepted_prefix(draft: Sequence[int], actual: Sequence[int]) -> int:
    """Greedy replay of a recorded sequence: accepted = longest common prefix."""
    n = 0
    for a, b in zip(draft, actual):
        if a != b:
            break
        n += 1
    return n
