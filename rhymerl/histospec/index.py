"""Generalised suffix automaton over past responses with continuation counts, P(next = c | s) =
cnt[trans(s, c)] / cnt[s]; matches carry across decode steps. Frozen form built by ``_samc.c`` if compiled."""

from __future__ import annotations

import logging
import sys
from array import array
from bisect import bisect_left
from typing import Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)

START = -1  # virtual token before every response and match context, so first tokens can be drafted
NO_CHILD = -2


class SuffixAutomaton:
    __slots__ = ("nxt", "ln", "link", "cnt", "num_tokens", "num_seqs", "version", "_last", "_best", "_arrays", "online")

    def __init__(self, online: bool = True) -> None:
        # online=False (bulk builds): ``freeze`` sums the counts in one pass instead of per token.
        self.online = online
        self.nxt: list[dict[int, int]] = [{}]
        self.ln: list[int] = [0]
        self.link: list[int] = [-1]
        self.cnt: list[int] = [0]
        self.num_tokens = 0
        self.num_seqs = 0
        self.version = 0  # bumped on every change: invalidates cached matches
        self._last = 0
        self._best: dict[int, tuple | None] = {}
        self._arrays: Optional[tuple[list[int], list[int], list[float]]] = None

    @property
    def num_states(self) -> int:
        return len(self.ln)

    def _clone(self, p: int, q: int, c: int) -> int:
        nxt, link = self.nxt, self.link
        clone = len(self.ln)
        nxt.append(dict(nxt[q]))
        self.ln.append(self.ln[p] + 1)
        link.append(link[q])
        # Online: the clone's end positions are q's. Bulk: a clone owns no end position itself.
        self.cnt.append(self.cnt[q] if self.online else 0)
        while p != -1 and nxt[p].get(c) == q:
            nxt[p][c] = clone
            p = link[p]
        link[q] = clone
        return clone

    def _extend(self, last: int, c: int) -> int:
        nxt, ln, link = self.nxt, self.ln, self.link
        q = nxt[last].get(c)
        if q is not None:
            # Generalised SAM: the extension exists already; reuse (or split) its state.
            cur = q if ln[last] + 1 == ln[q] else self._clone(last, q, c)
        else:
            cur = len(ln)
            nxt.append({})
            ln.append(ln[last] + 1)
            link.append(0)
            self.cnt.append(0)
            p = last
            while p != -1 and c not in nxt[p]:
                nxt[p][c] = cur
                p = link[p]
            if p != -1:
                q = nxt[p][c]
                link[cur] = q if ln[p] + 1 == ln[q] else self._clone(p, q, c)
        # The new end position belongs to cur and every state on its suffix-link path.
        cnt = self.cnt
        if not self.online:
            cnt[cur] += 1
            return cur
        v = cur
        while v > 0:
            cnt[v] += 1
            v = link[v]
        cnt[0] += 1
        return cur

    def add(self, tokens: Sequence[int]) -> None:
        """Index one more sequence (a response)."""
        last = 0
        for c in tokens:
            last = self._extend(last, int(c))
        self.num_tokens += len(tokens)
        self.num_seqs += 1
        self._changed()

    def start_sequence(self) -> None:
        """Begin a sequence that grows one token at a time with ``push``."""
        self._last = 0
        self.num_seqs += 1

    def push(self, c: int) -> None:
        self._last = self._extend(self._last, int(c))
        self.num_tokens += 1
        self._changed()

    def push_at(self, cursor: int, tokens: Sequence[int]) -> int:
        """Extend the sequence ending at ``cursor`` (0 = new) by ``tokens``; the new end state (interleaving ok)."""
        if cursor == 0:
            self.num_seqs += 1
        for c in tokens:
            cursor = self._extend(cursor, int(c))
        self.num_tokens += len(tokens)
        if tokens:
            self._changed()
        return cursor

    def _changed(self) -> None:
        self.version += 1
        if self._best:
            self._best.clear()
        self._arrays = None

    def freeze(self) -> "FrozenSuffixAutomaton":
        """A compact read-only copy (what the history store keeps)."""
        if not self.online:
            self._total_counts()
        return FrozenSuffixAutomaton.from_automaton(self)

    def _total_counts(self) -> None:
        # Children in the suffix-link tree are strictly longer: sum in decreasing length.
        cnt, link = self.cnt, self.link
        buckets: list[list[int]] = [[] for _ in range(max(self.ln) + 1)]
        for v, length in enumerate(self.ln):
            buckets[length].append(v)
        for length in range(len(buckets) - 1, 0, -1):
            for v in buckets[length]:
                cnt[link[v]] += cnt[v]
        self.online = True

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

    def children(self, state: int) -> list[tuple[int, int, float]]:
        """[(token, child, prob)] of one state, most frequent first."""
        cnt = self.cnt
        tot = cnt[state]
        out = [(c, v, cnt[v] / tot) for c, v in self.nxt[state].items()]
        out.sort(key=lambda t: (-t[2], t[0]))
        return out

    def best_child(self, state: int) -> tuple | None:
        """(token, child, prob) of the most frequent continuation, cached until the next add."""
        cache = self._best
        hit = cache.get(state)
        if hit is not None or state in cache:
            return hit
        trans = self.nxt[state]
        if not trans:
            cache[state] = None
            return None
        cnt = self.cnt
        # Ties go to the smaller token id so drafts are deterministic.
        c, v = max(trans.items(), key=lambda kv: (cnt[kv[1]], -kv[0]))
        res = (c, v, cnt[v] / cnt[state])
        cache[state] = res
        return res

    def best_arrays(self) -> tuple[list[int], list[int], list[float]]:
        """Preferred continuation of every state as flat lists (token or NO_CHILD, child, prob), once per version."""
        arr = self._arrays
        if arr is not None:
            return arr
        n = len(self.ln)
        bt = [NO_CHILD] * n
        bd = [0] * n
        bq = [0.0] * n
        cnt = self.cnt
        for v, trans in enumerate(self.nxt):
            if not trans:
                continue
            if len(trans) == 1:
                (c, u), = trans.items()
            else:
                c, u = max(trans.items(), key=lambda kv: (cnt[kv[1]], -kv[0]))
            bt[v] = c
            bd[v] = u
            bq[v] = cnt[u] / cnt[v]
        arr = (bt, bd, bq)
        self._arrays = arr
        return arr

    def memory_bytes(self) -> int:
        """Approximate resident size (CPython object sizes), for per-token reporting."""
        total = sum(sys.getsizeof(d) for d in self.nxt)
        total += sum(sys.getsizeof(x) for x in (self.nxt, self.ln, self.link, self.cnt))
        n_trans = sum(len(d) for d in self.nxt)
        total += n_trans * 28 * 2 + len(self.ln) * 28 * 3
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
    """Read-only compact suffix automaton (CSR edges; a state's first edge is its preferred continuation)."""

    _next_version = 1 << 40

    def __init__(self, ln, link, cnt, off, etok, edst, num_tokens: int, num_seqs: int):
        """Columns as NumPy arrays (ln/link/off/etok/edst int32, cnt int64)."""
        self.ln = _column(ln)
        self.link = _column(link)
        self.cnt = _column(cnt)
        self.off = _column(off)
        self.etok = _column(etok)
        self.edst = _column(edst)
        self.num_tokens = int(num_tokens)
        self.num_seqs = int(num_seqs)
        FrozenSuffixAutomaton._next_version += 1
        self.version = FrozenSuffixAutomaton._next_version
        self._arrays: Optional[tuple] = None
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
                   np.asarray(sam.cnt, dtype=np.int64), off,
                   np.asarray(etok, dtype=np.int32), np.asarray(edst, dtype=np.int32), sam.num_tokens, sam.num_seqs)

    @property
    def num_states(self) -> int:
        return len(self.ln)

    def compiled(self):
        """A handle for ``_samc``'s drafting reads, made on first use; None where not compiled."""
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

    def children(self, state: int) -> list[tuple[int, int, float]]:
        cnt = self.cnt
        tot = cnt[state]
        lo, hi = self.off[state], self.off[state + 1]
        out = [(c, v, cnt[v] / tot) for c, v in zip(self.etok[lo:hi], self.edst[lo:hi])]
        out.sort(key=lambda t: (-t[2], t[0]))
        return out

    def best_child(self, state: int) -> tuple | None:
        c, u = self.best(state)
        return None if c == NO_CHILD else (c, u, self.cnt[u] / self.cnt[state])

    def best_arrays(self):
        """Preferred continuation of every state as flat columns (token, child, prob), on request."""
        arr = self._arrays
        if arr is not None:
            return arr
        n = len(self.ln)
        bt = array("i", [NO_CHILD]) * n
        bd = array("i", [0]) * n
        bq = array("d", [0.0]) * n
        cnt, off, etok, edst = self.cnt, self.off, self.etok, self.edst
        for v in range(n):
            lo, hi = off[v], off[v + 1]
            if lo == hi:
                continue
            c, u = etok[lo], edst[lo]
            bt[v] = c
            bd[v] = u
            bq[v] = cnt[u] / cnt[v]
        arr = (bt, bd, bq)
        self._arrays = arr
        return arr

    def memory_bytes(self) -> int:
        cols = [self.ln, self.link, self.cnt, self.off, self.etok, self.edst]
        if self._arrays is not None:
            cols.extend(self._arrays)
        return sum(a.itemsize * len(a) for a in cols)


try:
    import rhymerl.histospec._samc as _samc
except ImportError:  # not compiled (source checkout without `pip install -e .`)
    _samc = None

BUILDER = "compiled" if _samc is not None else "python"
# The proposer's per-step reads and its growing group indexes in compiled code.
DRAFT_READS = _samc is not None and hasattr(_samc, "group_new")
_warned = False


class CompiledGroupIndex:
    """A GRPO group's growing index in compiled code (``SuffixAutomaton(online=True)``'s automaton)."""

    __slots__ = ("handle", "num_tokens", "num_seqs", "version")

    def __init__(self) -> None:
        self.handle = _samc.group_new()
        self.num_tokens = 0
        self.num_seqs = 0
        self.version = 0  # bumped on every change, as SuffixAutomaton's

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


def build_frozen(sequences: Sequence[Sequence[int]]) -> Optional[FrozenSuffixAutomaton]:
    """The frozen index of ``sequences`` (each behind a START marker); None if there are none."""
    seqs = [np.asarray(s, dtype=np.int32).reshape(-1) for s in sequences]
    if not seqs:
        return None
    num_tokens = sum(int(s.size) + 1 for s in seqs)
    if _samc is None:
        global _warned
        if not _warned:
            _warned = True
            log.warning("rhymerl.histospec._samc is not compiled (reinstall with `pip install -e .`): history "
                        "indexes are built in pure Python, about 7x slower")
        sam = SuffixAutomaton(online=False)
        for s in seqs:
            sam.add([START] + s.tolist())
        return sam.freeze()
    toks = np.empty(num_tokens, dtype=np.int32)
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    pos = 0
    for k, s in enumerate(seqs):
        toks[pos] = START
        toks[pos + 1:pos + 1 + s.size] = s
        pos += s.size + 1
        offsets[k + 1] = pos
    ln, link, cnt, off, etok, edst = _samc.build(toks, offsets)
    return FrozenSuffixAutomaton(np.frombuffer(ln, np.int32), np.frombuffer(link, np.int32),
                                 np.frombuffer(cnt, np.int64), np.frombuffer(off, np.int32), np.frombuffer(etok, np.int32),
                                 np.frombuffer(edst, np.int32), num_tokens, len(seqs))
