"""Baseline drafters for the offline benchmark (not used by the engine).

``NgramDrafter`` is vLLM's "ngram" (prompt lookup) rule: the longest n-gram,
n in [min_n, max_n], that ends the request's context (prompt + generated) and also
occurs earlier in it; the draft is the k tokens that followed its *earliest* earlier
occurrence (vLLM's KMP scan picks the earliest position on ties). Same result as
``vllm/v1/spec_decode/ngram_proposer.py``; kept incrementally with a dict per n.

``SuffixDecodingDrafter`` re-implements SuffixDecoding (arctic-inference's
``SuffixDecodingCache``, which is not installed here) over the same history:
  * a global index over the responses of all earlier requests (every prompt; no
    per-prompt keying), plus each finished request of the current step as it ends,
  * a per-request index over the request's prompt + generated tokens,
  * pattern = the last ``max_depth`` tokens; for every match length L that occurs,
    a greedy path by maximum count while the path probability >= ``min_token_prob``,
    at most min(k, max_spec_factor * L + max_spec_offset) tokens and never past the
    tree depth (L + draft <= max_depth), scored by the sum of path probabilities;
    the best score wins (ties to the longer match), global vs local likewise.
Differences from the C++ original: suffix automata instead of depth-bounded suffix
trees (same occurrence counts for strings within ``max_depth``) and no
``max_cached_requests`` eviction (the benchmark's history fits).
"""

from __future__ import annotations

from typing import Sequence

from rhymerl.histospec.index import SuffixAutomaton


class NgramDrafter:
    def __init__(self, min_n: int = 5, max_n: int = 5, k: int = 16):
        self.min_n, self.max_n, self.k = min_n, max_n, k
        self._ctx: list[int] = []
        self._first: list[dict[tuple, int]] = []
        self._indexed = 0

    def begin(self, context: Sequence[int]) -> None:
        self._ctx = list(context)
        self._first = [dict() for _ in range(self.max_n + 1)]
        self._indexed = 0

    def _sync(self, generated_total: Sequence[int]) -> None:
        ctx = self._ctx
        # Record the earliest start of every n-gram that ends before the last token.
        end = len(ctx) - 1
        for e in range(self._indexed, end):
            for n in range(self.min_n, self.max_n + 1):
                s = e - n + 1
                if s >= 0:
                    self._first[n].setdefault(tuple(ctx[s:e + 1]), s)
        self._indexed = max(self._indexed, end)

    def propose(self, new_tokens: Sequence[int], k: int) -> list[int]:
        self._ctx.extend(new_tokens)
        self._sync(self._ctx)
        ctx = self._ctx
        k = min(k, self.k)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(ctx) < n + 1:
                continue
            s = self._first[n].get(tuple(ctx[-n:]))
            if s is not None:
                return ctx[s + n:s + n + k]
        return []


def _path(sam: SuffixAutomaton, v: int, max_tokens: int, min_prob: float) -> tuple[list[int], list[float]]:
    toks: list[int] = []
    paths: list[float] = []
    p = 1.0
    while len(toks) < max_tokens:
        b = sam.best_child(v)
        if b is None:
            break
        c, u, q = b
        p *= q
        if p < min_prob:
            break
        toks.append(c)
        paths.append(p)
        v = u
    return toks, paths


def suffix_speculate(sam: SuffixAutomaton, pattern: Sequence[int], k: int, factor: float, offset: float,
                     min_prob: float, max_depth: int) -> tuple[list[int], float, int]:
    """Best (draft, score, match_len) over all match lengths of ``pattern`` in ``sam``."""
    if sam.num_tokens == 0 or not pattern:
        return [], 0.0, 0
    st, length = sam.match(pattern)
    best: tuple[list[int], float, int] = ([], 0.0, 0)
    ln, link = sam.ln, sam.link
    v, hi = st, length
    while v > 0 and hi > 0:
        lo = ln[link[v]] + 1
        # Budget per match length L in [lo, hi]; one walk covers them all.
        budgets = {L: max(0, min(k, int(L * factor + offset + 1e-6), max_depth - L)) for L in range(lo, hi + 1)}
        need = max(budgets.values())
        toks, paths = _path(sam, v, need, min_prob)
        for L in range(lo, hi + 1):
            m = min(budgets[L], len(toks))
            score = sum(paths[:m])
            # arctic scans L upwards keeping `score >= best`: the longest best match wins.
            if (score, L) > (best[1], best[2]):
                best = (toks[:m], score, L)
        v = link[v]
        hi = ln[v]
    return best


class SuffixDecodingDrafter:
    def __init__(self, k: int = 16, max_depth: int = 24, factor: float = 1.0, offset: float = 0.0,
                 min_prob: float = 0.1):
        self.k, self.max_depth, self.factor, self.offset, self.min_prob = k, max_depth, factor, offset, min_prob
        self.global_index = SuffixAutomaton()
        self._local: dict[str, SuffixAutomaton] = {}
        self._ctx: dict[str, list[int]] = {}

    def add_response(self, tokens: Sequence[int]) -> None:
        if tokens:
            self.global_index.add(tokens)

    def begin(self, req_id: str, prompt: Sequence[int]) -> None:
        local = SuffixAutomaton()
        local.start_sequence()
        for t in prompt:
            local.push(t)
        self._local[req_id] = local
        self._ctx[req_id] = list(prompt)

    def propose(self, req_id: str, new_tokens: Sequence[int], k: int) -> list[int]:
        local = self._local[req_id]
        ctx = self._ctx[req_id]
        # The request's own tree must not contain the pattern's last occurrence as a
        # "continuation": index up to the current token, then match.
        for t in new_tokens:
            local.push(t)
            ctx.append(t)
        pattern = ctx[-self.max_depth:]
        k = min(k, self.k)
        g = suffix_speculate(self.global_index, pattern, k, self.factor, self.offset, self.min_prob, self.max_depth)
        l = suffix_speculate(local, pattern, k, self.factor, self.offset, self.min_prob, self.max_depth)
        return (l if l[1] > g[1] else g)[0]

    def end(self, req_id: str, response: Sequence[int]) -> None:
        self._local.pop(req_id, None)
        self._ctx.pop(req_id, None)
        self.add_response(response)
