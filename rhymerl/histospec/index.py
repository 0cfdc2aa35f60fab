"""Suffix automaton over a prompt's past responses, with continuation counts.

A generalised suffix automaton (SAM) over a set of token sequences: every distinct
substring of any response corresponds to exactly one state, states are added online
(``add`` extends the automaton with one more response in amortised O(len)), and all
strings of one state share the same set of end positions. That last fact makes the
empirical continuation probability exact and cheap:

    P(next = c | matched string s) = cnt[trans(s, c)] / cnt[s]

where ``cnt[v]`` is the number of occurrences (end positions) of v's strings over all
indexed responses. Occurrences at the very end of a response have no continuation, so
the probabilities of all children sum to <= 1 (the rest is "the response stopped
here"), which is exactly what the released suffix tree's ``-1`` separators encode.

``wcnt[v]`` is the same count where each occurrence weighs its response's reward
weight (used by reward-aware branch choice). With ``online=True`` both are kept exact
after every token (see ``_extend``), so an index can grow while requests draft from
it (sibling responses, SuffixDecoding's per-request tree); bulk builds
(``online=False``) sum them once in ``freeze``.

Layout: the growing form is parallel Python lists indexed by state id (``nxt`` holds
one small dict per state); plain lists beat NumPy here because every operation touches
one element. What the history store keeps is ``FrozenSuffixAutomaton``: flat integer
columns with the transitions in CSR form, built by ``build_frozen`` in compiled code
(``_samc.c``, the same automaton state for state; ~0.3-0.7 us and 22-39 bytes per
history token against ~2.4-5 us and ~180 bytes in Python objects), or by ``freeze``.

Why an automaton and not the release's suffix tree: same counts, O(n) states, online
construction, and the matched state can be carried from one decode step to the next
(feeding only the newly emitted tokens), so a step costs O(new tokens), not a rematch.
"""

from __future__ import annotations

import logging
from array import array
from bisect import bisect_left
from typing import Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)

# Virtual token in front of every indexed response (and of every request's match
# context), so the first tokens of a response can be drafted and matches near the
# start are anchored to it. Real token ids are >= 0.
START = -1
NO_CHILD = -2


class SuffixAutomaton:
    __slots__ = ("nxt", "ln", "link", "cnt", "wcnt", "num_tokens", "num_seqs", "version", "_last", "_best", "_wbest", "_arrays",
                 "online")

    def __init__(self, online: bool = True) -> None:
        # online=False (bulk builds that are frozen afterwards): each token only marks its
        # own state and ``freeze`` sums the counts up the suffix-link tree in one O(states)
        # pass, instead of walking the suffix-link path per token.
        self.online = online
        self.nxt: list[dict[int, int]] = [{}]
        self.ln: list[int] = [0]
        self.link: list[int] = [-1]
        self.cnt: list[int] = [0]
        self.wcnt: list[float] = [0.0]
        self.num_tokens = 0
        self.num_seqs = 0
        # Bumped on every change so cached match states of requests can be invalidated.
        self.version = 0
        self._last = 0
        self._best: dict[int, tuple | None] = {}
        self._wbest: dict[int, tuple | None] = {}
        self._arrays: dict[bool, tuple[list[int], list[int], list[float]]] = {}

    @property
    def num_states(self) -> int:
        return len(self.ln)

    def _clone(self, p: int, q: int, c: int) -> int:
        nxt, link = self.nxt, self.link
        clone = len(self.ln)
        nxt.append(dict(nxt[q]))
        self.ln.append(self.ln[p] + 1)
        link.append(link[q])
        # Online: the clone's end positions are q's (the new one is added by the
        # caller's walk). Bulk: a clone owns no end position itself.
        self.cnt.append(self.cnt[q] if self.online else 0)
        self.wcnt.append(self.wcnt[q] if self.online else 0.0)
        while p != -1 and nxt[p].get(c) == q:
            nxt[p][c] = clone
            p = link[p]
        link[q] = clone
        return clone

    def _extend(self, last: int, c: int, weight: float) -> int:
        nxt, ln, link = self.nxt, self.ln, self.link
        q = nxt[last].get(c)
        if q is not None:
            # Generalised SAM: this extension already exists as a substring of an
            # earlier sequence; reuse (or split) its state instead of adding one.
            cur = q if ln[last] + 1 == ln[q] else self._clone(last, q, c)
        else:
            cur = len(ln)
            nxt.append({})
            ln.append(ln[last] + 1)
            link.append(0)
            self.cnt.append(0)
            self.wcnt.append(0.0)
            p = last
            while p != -1 and c not in nxt[p]:
                nxt[p][c] = cur
                p = link[p]
            if p != -1:
                q = nxt[p][c]
                link[cur] = q if ln[p] + 1 == ln[q] else self._clone(p, q, c)
        # The new end position belongs to cur and every state on its suffix-link path
        # (all suffixes of the current prefix); keeping counts exact online costs one
        # walk up that path, which is short unless the text repeats itself a lot.
        cnt, wcnt = self.cnt, self.wcnt
        if not self.online:
            cnt[cur] += 1
            wcnt[cur] += weight
            return cur
        v = cur
        while v > 0:
            cnt[v] += 1
            wcnt[v] += weight
            v = link[v]
        cnt[0] += 1
        wcnt[0] += weight
        return cur

    def add(self, tokens: Sequence[int], weight: float = 1.0) -> None:
        """Index one more sequence (a response); ``weight`` is its reward weight."""
        last = 0
        for c in tokens:
            last = self._extend(last, int(c), weight)
        self.num_tokens += len(tokens)
        self.num_seqs += 1
        self._changed()

    def start_sequence(self) -> None:
        """Begin a sequence that grows one token at a time with ``push``."""
        self._last = 0
        self.num_seqs += 1

    def push(self, c: int, weight: float = 1.0) -> None:
        self._last = self._extend(self._last, int(c), weight)
        self.num_tokens += 1
        self._changed()

    def push_at(self, cursor: int, tokens: Sequence[int], weight: float = 1.0) -> int:
        """Extend the sequence whose end state is ``cursor`` (0 = a new sequence) by
        ``tokens``; returns the new end state.

        Several sequences may grow interleaved (siblings decoding in the same step): a
        sequence's whole text is always the longest string of its end state (its
        occurrence at its own end has no predecessor), which is all ``_extend`` needs.
        """
        if cursor == 0:
            self.num_seqs += 1
        for c in tokens:
            cursor = self._extend(cursor, int(c), weight)
        self.num_tokens += len(tokens)
        if tokens:
            self._changed()
        return cursor

    def _changed(self) -> None:
        self.version += 1
        if self._best:
            self._best.clear()
        if self._wbest:
            self._wbest.clear()
        if self._arrays:
            self._arrays.clear()


    def counts(self) -> tuple[list[int], list[float]]:
        return self.cnt, self.wcnt

    def freeze(self) -> "FrozenSuffixAutomaton":
        """A compact read-only copy (what the history store keeps)."""
        if not self.online:
            self._total_counts()
        return FrozenSuffixAutomaton.from_automaton(self)

    def _total_counts(self) -> None:
        # Children in the suffix-link tree are strictly longer: sum in decreasing length.
        cnt, wcnt, link = self.cnt, self.wcnt, self.link
        buckets: list[list[int]] = [[] for _ in range(max(self.ln) + 1)]
        for v, length in enumerate(self.ln):
            buckets[length].append(v)
        for length in range(len(buckets) - 1, 0, -1):
            for v in buckets[length]:
                u = link[v]
                cnt[u] += cnt[v]
                wcnt[u] += wcnt[v]
        self.online = True

    # -- matching -------------------------------------------------------------------
    def trans(self, state: int, c: int) -> int:
        return self.nxt[state].get(c, -1)

    def step(self, state: int, length: int, c: int) -> tuple[int, int]:
        """Extend the match (state, length) by token c; returns the longest suffix match."""
        nxt, link = self.nxt, self.link
        while True:
            q = nxt[state].get(c)
            if q is not None:
                return q, length + 1
            if state == 0:
                return 0, 0
            state = link[state]
            length = self.ln[state]

    def match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """Longest suffix of ``tokens`` that occurs in the index: (state, length)."""
        state, length = 0, 0
        for c in tokens:
            state, length = self.step(state, length, c)
        return state, length

    def children(self, state: int) -> list[tuple[int, int, float, float]]:
        """[(token, child, prob, reward_weighted_prob)] of one state, most frequent first."""
        cnt, wcnt = self.cnt, self.wcnt
        tot = cnt[state]
        wtot = wcnt[state] or 1.0
        out = [(c, v, cnt[v] / tot, wcnt[v] / wtot) for c, v in self.nxt[state].items()]
        out.sort(key=lambda t: (-t[2], t[0]))
        return out

    def best_child(self, state: int, reward: bool = False) -> tuple | None:
        """(token, child, prob) of the preferred continuation, cached until the next add."""
        cache = self._wbest if reward else self._best
        hit = cache.get(state)
        if hit is not None or state in cache:
            return hit
        trans = self.nxt[state]
        if not trans:
            cache[state] = None
            return None
        score = self.wcnt if reward else self.cnt
        # Ties go to the smaller token id so drafts are deterministic.
        c, v = max(trans.items(), key=lambda kv: (score[kv[1]], -kv[0]))
        res = (c, v, self.cnt[v] / self.cnt[state])
        cache[state] = res
        return res

    def best_arrays(self, reward: bool = False) -> tuple[list[int], list[int], list[float]]:
        """Preferred continuation of every state as flat lists (token, child, prob).

        token is NO_CHILD where a state has no continuation. Built once per index
        version in O(transitions); list indexing is the cheapest lookup CPython has,
        which is what keeps a draft step at well under a microsecond per token.
        """
        arr = self._arrays.get(reward)
        if arr is not None:
            return arr
        n = len(self.ln)
        bt = [NO_CHILD] * n
        bd = [0] * n
        bq = [0.0] * n
        cnt = self.cnt
        score = self.wcnt if reward else cnt
        for v, trans in enumerate(self.nxt):
            if not trans:
                continue
            if len(trans) == 1:
                (c, u), = trans.items()
            else:
                c, u = max(trans.items(), key=lambda kv: (score[kv[1]], -kv[0]))
            bt[v] = c
            bd[v] = u
            bq[v] = cnt[u] / cnt[v]
        arr = (bt, bd, bq)
        self._arrays[reward] = arr
        return arr

    def memory_bytes(self) -> int:
        """Approximate resident size (CPython object sizes), for per-token reporting."""
        import sys

        total = sum(sys.getsizeof(d) for d in self.nxt)
        total += sum(sys.getsizeof(x) for x in (self.nxt, self.ln, self.link, self.cnt, self.wcnt))
        # Ints above 256 and floats are separate objects: 28/24 bytes each.
        n_trans = sum(len(d) for d in self.nxt)
        total += n_trans * 28 * 2 + len(self.ln) * (28 * 3 + 24)
        return total


def _column(values) -> array:
    """An ``array`` of the narrowest integer type that holds ``values`` (a NumPy array)."""
    lo = int(values.min()) if values.size else 0
    hi = int(values.max()) if values.size else 0
    for code, dtype in (("h", np.int16), ("H", np.uint16), ("i", np.int32), ("I", np.uint32), ("q", np.int64)):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            out = array(code)
            out.frombytes(np.ascontiguousarray(values, dtype=dtype).tobytes())
            return out
    raise OverflowError("index column out of int64 range")


class FrozenSuffixAutomaton:
    """Read-only compact copy of a suffix automaton, for history indexes.

    Flat columns instead of per-state Python objects: ``ln``, ``link``, ``cnt`` per state,
    and every state's transitions in CSR form (``off``; ``etok``/``edst`` per edge), each
    column of the narrowest integer type that holds it. A state's first edge is its
    preferred continuation (most frequent, smaller token on ties), the others follow in
    token order, so a greedy draft reads one edge per token and a lookup is one compare
    or a bisection. ``wcnt`` (reward-weighted counts) is ``cnt`` itself when every
    sequence weighed 1, which is how the store builds unless the reward branch is on.

    Built by ``build_frozen`` (compiled, ``_samc``) or ``SuffixAutomaton.freeze``; both
    give the same states, ids and columns. Frozen indexes never change, so their version
    is fixed.
    """

    _next_version = 1 << 40

    def __init__(self, ln, link, cnt, wcnt, off, etok, edst, num_tokens: int, num_seqs: int):
        """Columns as NumPy arrays (ln/link/off/etok/edst int32, cnt int64, wcnt float64)."""
        self.ln = _column(ln)
        self.link = _column(link)
        self.cnt = _column(cnt)
        cnt_f = cnt.astype(np.float64)
        if np.array_equal(wcnt, cnt_f):
            self.wcnt = self.cnt
        else:
            self.wcnt = array("d")
            self.wcnt.frombytes(np.ascontiguousarray(wcnt, dtype=np.float64).tobytes())
        self.off = _column(off)
        self.etok = _column(etok)
        self.edst = _column(edst)
        self.num_tokens = int(num_tokens)
        self.num_seqs = int(num_seqs)
        FrozenSuffixAutomaton._next_version += 1
        self.version = FrozenSuffixAutomaton._next_version
        self._arrays: dict[bool, tuple] = {}
        self._view = None

    @classmethod
    def from_automaton(cls, sam: SuffixAutomaton) -> "FrozenSuffixAutomaton":
        """The frozen form of a (count-complete) growing automaton, in ``_samc``'s layout."""
        cnt = sam.cnt
        off = np.zeros(len(sam.ln) + 1, dtype=np.int32)
        etok: list[int] = []
        edst: list[int] = []
        for v, trans in enumerate(sam.nxt):
            if trans:
                items = sorted(trans.items())
                best = max(items, key=lambda kv: (cnt[kv[1]], -kv[0]))
                etok.append(best[0])
                edst.append(best[1])
                for c, u in items:
                    if c != best[0]:
                        etok.append(c)
                        edst.append(u)
            off[v + 1] = len(etok)
        return cls(np.asarray(sam.ln, dtype=np.int32), np.asarray(sam.link, dtype=np.int32),
                   np.asarray(sam.cnt, dtype=np.int64), np.asarray(sam.wcnt, dtype=np.float64), off,
                   np.asarray(etok, dtype=np.int32), np.asarray(edst, dtype=np.int32), sam.num_tokens, sam.num_seqs)

    @property
    def num_states(self) -> int:
        return len(self.ln)

    def compiled(self):
        """A handle on the columns for ``_samc``'s drafting reads (``advance``, ``chain``),
        made on first use (only indexes that are drafted from need one); None where the
        extension is not compiled."""
        if self._view is None and DRAFT_READS:
            self._view = _samc.view(self.ln, self.link, self.cnt, self.off, self.etok, self.edst)
        return self._view

    def trans(self, state: int, c: int) -> int:
        off = self.off
        lo = off[state]
        hi = off[state + 1]
        if lo == hi:
            return -1
        etok = self.etok
        if etok[lo] == c:
            return self.edst[lo]
        i = bisect_left(etok, c, lo + 1, hi)
        return self.edst[i] if i < hi and etok[i] == c else -1

    def best(self, state: int) -> tuple[int, int]:
        """(token, child) of the preferred continuation, token NO_CHILD if none."""
        o = self.off[state]
        if o == self.off[state + 1]:
            return NO_CHILD, 0
        return self.etok[o], self.edst[o]

    def match(self, tokens: Sequence[int]) -> tuple[int, int]:
        state, length = 0, 0
        trans, link, ln = self.trans, self.link, self.ln
        for c in tokens:
            while True:
                q = trans(state, c)
                if q >= 0:
                    state, length = q, length + 1
                    break
                if state == 0:
                    length = 0
                    break
                state = link[state]
                length = ln[state]
        return state, length

    def children(self, state: int) -> list[tuple[int, int, float, float]]:
        cnt, wcnt = self.cnt, self.wcnt
        tot = cnt[state]
        wtot = wcnt[state] or 1.0
        lo, hi = self.off[state], self.off[state + 1]
        out = [(c, v, cnt[v] / tot, wcnt[v] / wtot) for c, v in zip(self.etok[lo:hi], self.edst[lo:hi])]
        out.sort(key=lambda t: (-t[2], t[0]))
        return out

    def best_child(self, state: int, reward: bool = False) -> tuple | None:
        if reward:
            bt, bd, bq = self.best_arrays(True)
            return None if bt[state] == NO_CHILD else (bt[state], bd[state], bq[state])
        c, u = self.best(state)
        return None if c == NO_CHILD else (c, u, self.cnt[u] / self.cnt[state])

    def best_arrays(self, reward: bool = False):
        """Preferred continuation of every state as flat columns (token, child, prob).

        Frequency order needs none (each state's first edge is its preferred child;
        drafting reads the edges); these are materialised on request, and for the
        reward-weighted order, which only the reward branch uses."""
        arr = self._arrays.get(reward)
        if arr is not None:
            return arr
        n = len(self.ln)
        bt = array("i", [NO_CHILD]) * n
        bd = array("i", [0]) * n
        bq = array("d", [0.0]) * n
        cnt, off, etok, edst = self.cnt, self.off, self.etok, self.edst
        score = self.wcnt if reward else cnt
        for v in range(n):
            lo, hi = off[v], off[v + 1]
            if lo == hi:
                continue
            if reward and hi - lo > 1:
                c, u = max(zip(etok[lo:hi], edst[lo:hi]), key=lambda kv: (score[kv[1]], -kv[0]))
            else:
                c, u = etok[lo], edst[lo]
            bt[v] = c
            bd[v] = u
            bq[v] = cnt[u] / cnt[v]
        arr = (bt, bd, bq)
        self._arrays[reward] = arr
        return arr

    def memory_bytes(self) -> int:
        cols = [self.ln, self.link, self.cnt, self.off, self.etok, self.edst]
        if self.wcnt is not self.cnt:
            cols.append(self.wcnt)
        for arr in self._arrays.values():
            cols.extend(arr)
        return sum(a.itemsize * len(a) for a in cols)


try:
    import rhymerl.histospec._samc as _samc
except ImportError:  # not compiled (source checkout without `pip install -e .`)
    _samc = None

BUILDER = "compiled" if _samc is not None else "python"
# The proposer's per-step reads of frozen indexes and its growing group indexes in compiled
# code (the same automata and walks as the pure-Python ones).
DRAFT_READS = _samc is not None and hasattr(_samc, "group_new")
_warned = False


class CompiledGroupIndex:
    """A GRPO group's growing index in compiled code (``_samc.group_*``): the same automaton
    as ``SuffixAutomaton(online=True)`` grown by ``push_at`` (states, counts and edges; a
    test compares them), read by the proposer's compiled match and greedy walk. Every
    sibling's emitted tokens are pushed into it each engine step, which in Python was the
    largest remaining share of the proposer's time. Unweighted (groups weigh 1)."""

    __slots__ = ("handle", "num_tokens", "num_seqs", "version")

    def __init__(self) -> None:
        self.handle = _samc.group_new()
        self.num_tokens = 0
        self.num_seqs = 0
        # Bumped on every change, as SuffixAutomaton's, so cached matches re-match.
        self.version = 0

    def push_at(self, cursor: int, tokens: Sequence[int]) -> int:
        """``SuffixAutomaton.push_at``: extend the sequence ending at ``cursor`` (0 = a new one)."""
        if cursor == 0:
            self.num_seqs += 1
        cursor = _samc.group_push(self.handle, cursor, tokens)
        self.num_tokens += len(tokens)
        if len(tokens):
            self.version += 1
        return cursor

    def columns(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """(ln, link, count) per state and (state, token, child) per edge."""
        return _samc.group_columns(self.handle)


def build_frozen(sequences: Sequence[Sequence[int]], weights: Optional[Sequence[float]] = None
                 ) -> Optional[FrozenSuffixAutomaton]:
    """The frozen index of ``sequences`` (each indexed behind a START marker), weighed by
    ``weights`` (1 each by default); None if there are no sequences. Compiled when the
    ``_samc`` extension is built, else the pure-Python automaton (same result, about 7x slower)."""
    seqs = [np.asarray(s, dtype=np.int32).reshape(-1) for s in sequences]
    if not seqs:
        return None
    num_tokens = sum(int(s.size) + 1 for s in seqs)
    w = np.ones(len(seqs), dtype=np.float64) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (len(seqs),):
        raise ValueError(f"build_frozen: {w.size} weights for {len(seqs)} sequences")
    if _samc is None:
        global _warned
        if not _warned:
            _warned = True
            log.warning("rhymerl.histospec._samc is not compiled (reinstall with `pip install -e .`): history "
                        "indexes are built in pure Python, about 7x slower")
        sam = SuffixAutomaton(online=False)
        for s, x in zip(seqs, w.tolist()):
            sam.add([START] + s.tolist(), x)
        return sam.freeze()
    toks = np.empty(num_tokens, dtype=np.int32)
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    pos = 0
    for k, s in enumerate(seqs):
        toks[pos] = START
        toks[pos + 1:pos + 1 + s.size] = s
        pos += s.size + 1
        offsets[k + 1] = pos
    ln, link, cnt, wcnt, off, etok, edst = _samc.build(toks, offsets, w)
    return FrozenSuffixAutomaton(np.frombuffer(ln, np.int32), np.frombuffer(link, np.int32),
                                 np.frombuffer(cnt, np.int64), np.frombuffer(wcnt, np.float64),
                                 np.frombuffer(off, np.int32), np.frombuffer(etok, np.int32),
                                 np.frombuffer(edst, np.int32), num_tokens, len(seqs))
