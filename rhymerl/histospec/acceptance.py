"""Lossless verification of history drafts (chains and trees).

History drafts are deterministic: the draft distribution q is one-hot on the drafted
token x. Speculative sampling then accepts x with probability min(1, p(x)/q(x)) = p(x)
and, on rejection, samples from the residual max(0, p - q) normalised, which is p with
x removed and renormalised. Summing both branches, token y is emitted with probability
p(y): the output distribution equals plain sampling from p.

Trees generalise this with sequential rejection among the children of a node (distinct
tokens x_1..x_k, tried in order): keep a residual r (initially p); try child x_j with
probability r(x_j)/sum(r); on rejection set r(x_j) = 0 and try the next; if all are
rejected, sample from r. By telescoping, child x_j is taken with probability p(x_j) and
any other token y with probability p(y), so the tree is lossless too. After accepting a
child, verification continues with that child's children against the target
distribution at that position. When a node is left (all rejected, or a leaf), the
token sampled from the residual (or the bonus token at a leaf) ends the step.

Greedy (temperature 0): accept a draft token iff it is the target argmax.

``target_probs`` turns logits into the sampling distribution with the engine's
temperature / top-k / top-p rules, so the tests can check the composition.
"""

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
    """Verify a one-hot draft chain.

    ``probs[i]`` is the target distribution for the token after draft[:i] (so it has
    len(draft) + 1 rows). Returns (number of accepted draft tokens, emitted tokens):
    the accepted tokens followed by one corrected or bonus token.
    """
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


def verify_tree(tokens: Sequence[int], parents: Sequence[int], probs: np.ndarray,
                rng: np.random.Generator | None = None, greedy: bool = False) -> tuple[list[int], list[int]]:
    """Verify a one-hot draft tree.

    ``tokens[i]`` has parent ``parents[i]`` (-1 = root). ``probs[0]`` is the target
    distribution at the root, ``probs[i + 1]`` the one after node i. Children are tried
    in the order they appear in ``tokens``. Returns (accepted node indices, emitted
    tokens), emitted = accepted tokens + one corrected/bonus token.
    """
    children: dict[int, list[int]] = {}
    for i, par in enumerate(parents):
        children.setdefault(par, []).append(i)
    node = -1
    path: list[int] = []
    out: list[int] = []
    while True:
        p = probs[node + 1]
        kids = children.get(node, ())
        if greedy:
            y = int(np.argmax(p))
            nxt = next((k for k in kids if tokens[k] == y), None)
            if nxt is None:
                return path, out + [y]
        else:
            r = np.array(p, dtype=np.float64)
            nxt = None
            for k in kids:
                tot = r.sum()
                x = tokens[k]
                if tot > 0 and rng.random() * tot < r[x]:
                    nxt = k
                    break
                r[x] = 0.0
            if nxt is None:
                return path, out + [_sample(r, rng)]
        path.append(nxt)
        out.append(int(tokens[nxt]))
        node = nxt


def accepted_prefix(draft: Sequence[int], actual: Sequence[int]) -> int:
    """Greedy replay of a recorded sequence: accepted = longest common prefix."""
    n = 0
    for a, b in zip(draft, actual):
        if a != b:
            break
        n += 1
    return n


def accepted_tree_path(tokens: Sequence[int], parents: Sequence[int], actual: Sequence[int]) -> int:
    """Greedy replay against a recorded sequence for a tree: depth of the matching path."""
    node, depth = -1, 0
    kids: dict[int, dict[int, int]] = {}
    for i, par in enumerate(parents):
        kids.setdefault(par, {}).setdefault(tokens[i], i)
    while depth < len(actual):
        nxt = kids.get(node, {}).get(actual[depth])
        if nxt is None:
            break
        node = nxt
        depth += 1
    return depth
