"""Draft proposer: drafts for every running request of an engine step, one call per step.

Draft sources (``SOURCES``), each a suffix automaton matched incrementally against the
request's generated tokens (a call costs O(tokens emitted + draft length) steps):
  history  the same prompt's responses from its last ``epochs_kept`` visits (store)
  group    the request's GRPO group in this step: siblings finished *and in flight*
           (every request's emitted tokens are indexed as they arrive), the request's
           own output so far and the prompt (``include_siblings``)
  global   other prompts' responses, newest visit of each (``include_global``)
Per request the chain with the most expected accepted tokens wins, expected under each
source's online acceptance (``goodput.AcceptanceTracker``), so a source is weighted by
what it has actually predicted; vLLM verifies one chain per request.

Matching follows the released HistoSpec: the longest suffix of the last
``match_window`` generated tokens that occurs in the history, at least ``min_match``
long; if that match yields no draft, back off to shorter matches (down to
``min_match``). A chain follows the preferred child at each step (most frequent, or
reward-weighted) and stops when the running path probability drops below
``min_prob``, at the end of a response, at the length chosen by the draft-length
rule, or (``match_length_factor`` > 0) at that factor times the match length. A tree
keeps that chain as its spine and spends the rest of the node budget on the most
probable side branches (best-first on path probability, ``tree_topk`` children per
node).

Draft-length rules (``draft_rule``), all capped by ``max_draft`` and the engine's
``max_len``:
  goodput   the default: all requests of the step together, the lengths that maximise
            expected emitted tokens per second of the step (``goodput.plan_step``),
            capped near each response's predicted end; often nobody drafts
  fixed     always ``fixed_len``
  aimd      the paper: start 2, +2 after a fully accepted draft, back to 2 on a rejection
  mimd      the release: start 2, x2 after a fully accepted draft, //2 (floor 2) on a rejection
  adaptive  ours: the mimd window, but a draft may run past the window while the
            history is near-unanimous (path probability >= ADAPTIVE_CONF); such
            continuations are accepted almost always, so capping them wastes steps.

Measured with ``python -m benchmarks histospec`` (synthetic traces, similarity
0.5-0.95): among the per-request rules ``adaptive`` has the best modelled speedup
(fixed 4..32, aimd, mimd), and ``min_match=1, start_after=0`` beat the released 4/4 at every
similarity (the ``min_prob`` cut already rejects ambiguous short matches). The
benchmark's main rows use those settings (``benchmarks/histospec.py: RECOMMENDED``).

Not thread-safe: the engine calls it from one thread. ``generated`` must extend the
previous call's tokens for the same request (a changed last token or a jump of more
than ``match_window`` tokens re-matches from scratch, which is always correct). It may be
a list or a 1-D NumPy integer array (the engine passes a view of its token table): only the
tokens not seen before are read, so a step costs the same at token 100 and at token 16,000.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from rhymerl.config import HistoSpecConfig
from rhymerl.histospec.goodput import AcceptanceTracker, StepCostModel, draft_can_pay, plan_step, remaining_cap
import rhymerl.histospec.index as _index
from rhymerl.histospec.index import NO_CHILD, START, CompiledGroupIndex, FrozenSuffixAutomaton, SuffixAutomaton, _samc
from rhymerl.histospec.store import HistoryStore

# Draft sources, in the order they are consulted (ties go to the earlier one).
SOURCES = ("history", "group", "global")
RULES = ("fixed", "aimd", "mimd", "adaptive", "goodput")

START_LEN = 2
# Path probability above which the adaptive rule keeps drafting past its window.
ADAPTIVE_CONF = 0.6


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    # Empirical probability of each token given its parent path (history counts).
    probs: list[float] = field(default_factory=list)
    # Index of each token's parent in ``tokens``; -1 = the last generated token.
    # A chain has parents [-1, 0, 1, ...].
    parents: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))


_EMPTY = Draft()


class _Match:
    """Incremental match of one request's generated tokens in one index."""

    __slots__ = ("sam", "state", "length", "version", "pos", "last")

    def __init__(self, sam: SuffixAutomaton):
        self.sam = sam
        self.state = 0
        self.length = 0
        self.version = -1
        self.pos = 0
        self.last = START

    def advance(self, generated: Sequence[int], window: int, reward: bool = False) -> None:
        # Positions count the virtual START marker in front of the response.
        sam = self.sam
        n = len(generated) + 1
        # Rematch if the index changed, the tokens are not an extension of what we saw
        # (checked on the last seen token: cheap, and catches a reused request id), or
        # more than a window of new tokens arrived.
        if (self.version != sam.version or self.pos > n or n - self.pos > window
                or (self.pos > 1 and generated[self.pos - 2] != self.last)):
            st, ln, start = 0, 0, max(0, n - window)
        else:
            st, ln, start = self.state, self.length, self.pos
        if (view := _compiled(sam, reward)) is not None:
            st, ln = _samc.advance(view, st, ln, generated, start, n, window, START)
        else:
            st, ln = _python_advance(sam, st, ln, generated, start, n, window, reward)
        self.state, self.length, self.version, self.pos = st, ln, sam.version, n
        self.last = generated[-1] if n > 1 else START


def _python_advance(sam, st: int, ln: int, generated: Sequence[int], start: int, n: int, window: int,
                    reward: bool) -> tuple[int, int]:
    """The match (st, ln) extended by positions [start, n) of the response behind a virtual
    START marker, at most ``window`` tokens long (what ``_samc.advance`` compiles)."""
    trans, link, lens = sam.trans, sam.link, sam.ln
    # best(state) -> (token, child) of the preferred continuation (token NO_CHILD if none).
    if isinstance(sam, FrozenSuffixAutomaton) and not reward:
        best = sam.best
    else:
        arrays = sam._arrays.get(reward)
        best = None if arrays is None else (lambda s, bt=arrays[0], bd=arrays[1]: (bt[s], bd[s]))
    for i in range(start, n):
        c = generated[i - 1] if i else START
        if best is not None and (b := best(st))[0] == c:
            # Fast path: accepted draft tokens are exactly the preferred children.
            st = b[1]
            ln += 1
        else:
            while True:
                q = trans(st, c)
                if q >= 0:
                    st = q
                    ln += 1
                    break
                if st == 0:
                    ln = 0
                    break
                st = link[st]
                ln = lens[st]
        if ln > window:
            ln = window
            while lens[link[st]] >= window:
                st = link[st]
    return st, ln


def _python_chain(sam, walk, v: int, length: int, min_match: int, limit: int, conf_limit: int, min_prob: float,
                  reward: bool, conf: float):
    """(tokens, cond_probs, score, state, match length) of ``walk``'s chain after the match
    (v, length), backing off to shorter matches while it is empty; None below ``min_match``
    (what ``_samc.chain`` compiles)."""
    lens, link = sam.ln, sam.link
    while length >= min_match:
        toks, probs, score = walk(sam, v, limit, conf_limit, min_prob, reward, conf)
        if toks:
            return toks, probs, score, v, length
        # Back off to the next shorter match (the release tries 7, 6, 5, 4).
        v = link[v]
        length = lens[v]
    return None


def _compiled(sam, reward: bool):
    """The compiled handle to read ``sam`` through, or None for the Python walks: a group's
    compiled index, or a frozen index unless drafts follow reward-weighted counts."""
    if isinstance(sam, CompiledGroupIndex):
        return sam.handle
    if not reward and isinstance(sam, FrozenSuffixAutomaton):
        return sam.compiled()
    return None


class _Req:
    __slots__ = ("key", "group", "hist", "sib", "glob", "window", "last_depth", "gcur", "gpushed", "pred_len",
                 "last_src", "last_q")

    def __init__(self, key: int, group: Optional[str], pred_len: Optional[float] = None):
        self.key = key
        self.group = group
        self.hist: Optional[_Match] = None
        self.sib: Optional[_Match] = None
        self.glob: Optional[_Match] = None
        self.window = START_LEN
        self.last_depth = 0
        # End state and pushed length of this request's own sequence in its group's index.
        self.gcur = 0
        self.gpushed = -1
        self.pred_len = pred_len
        self.last_src = ""
        self.last_q: list[float] = []


class _Group:
    __slots__ = ("sam", "members")

    def __init__(self, compiled: bool) -> None:
        # Tree drafts grow side branches from the Python automaton's children.
        self.sam = CompiledGroupIndex() if compiled else SuffixAutomaton()
        self.members = 0


def _greedy(next_of, v: int, limit: int, conf_limit: int, min_prob: float, conf: float):
    """Greedy chain from state v along ``next_of(v) -> (token, child, cond_prob) | None``:
    (tokens, cond_probs, score).

    Up to ``limit`` tokens (then up to ``conf_limit`` while the path probability stays
    >= ``conf``), stopping when the path probability falls below ``min_prob``.
    """
    toks: list[int] = []
    probs: list[float] = []
    score = 0.0  # sum of path probabilities = expected accepted tokens (empirically)
    p = 1.0
    n = 0
    while n < conf_limit:
        nx = next_of(v)
        if nx is None:
            break
        c, u, q = nx
        p *= q
        if p < min_prob or (n >= limit and p < conf):
            break
        toks.append(c)
        probs.append(q)
        score += p
        v = u
        n += 1
    return toks, probs, score


def _walk(sam: SuffixAutomaton | FrozenSuffixAutomaton, v: int, limit: int, conf_limit: int, min_prob: float,
          reward: bool, conf: float = ADAPTIVE_CONF):
    """Greedy chain along the preferred children (most frequent, or reward-weighted)."""
    if isinstance(sam, FrozenSuffixAutomaton) and not reward:
        best, cnt = sam.best, sam.cnt

        def next_of(v: int):
            c, u = best(v)
            return None if c == NO_CHILD else (c, u, cnt[u] / cnt[v])
    else:
        bt, bd, bq = sam.best_arrays(reward)

        def next_of(v: int):
            c = bt[v]
            return None if c == NO_CHILD else (c, bd[v], bq[v])
    return _greedy(next_of, v, limit, conf_limit, min_prob, conf)


def _walk_group(sam: SuffixAutomaton, v: int, limit: int, conf_limit: int, min_prob: float, reward: bool,
                conf: float = ADAPTIVE_CONF):
    """Greedy chain in a group index whose sequences are still growing.

    Probabilities are normalised over the continuations that exist: the ends of
    in-flight siblings (and of the request itself) are "not generated yet", not
    "the response stopped here", so they must not dilute the counts.
    """
    nxt, cnt = sam.nxt, sam.cnt

    def next_of(v: int):
        trans = nxt[v]
        if not trans:
            return None
        if len(trans) == 1:
            (c, u), = trans.items()
            return c, u, 1.0
        c, u = max(trans.items(), key=lambda kv: (cnt[kv[1]], -kv[0]))
        return c, u, cnt[u] / sum(cnt[x] for x in trans.values())
    return _greedy(next_of, v, limit, conf_limit, min_prob, conf)


# ``DraftProposer.stats()``'s counts behind its fractions: they add up over rollouts and engines.
STAT_COUNTS = ("requests", "requests_with_history", "steps", "steps_without_drafts", "searches", "searches_skipped")


def add_stat_fractions(s: dict) -> dict:
    """Set ``DraftProposer.stats()``'s fractions from its counts, those present: also for
    counts summed over several rollouts."""
    if "steps" in s:
        # Engine steps in which nobody drafted (speculation fully bypassed).
        s["steps_without_drafts_fraction"] = s["steps_without_drafts"] / max(1, s["steps"])
    if "requests" in s:
        s["history_served_fraction"] = s["requests_with_history"] / max(1, s["requests"])
    if "searches" in s:
        # Request-steps whose chain search was skipped because no draft of theirs could pay.
        s["searches_skipped_fraction"] = s["searches_skipped"] / max(1, s["searches"] + s["searches_skipped"])
    return s


class DraftProposer:
    def __init__(self, store: HistoryStore, cfg: HistoSpecConfig):
        if cfg.min_match < 1 or cfg.match_window < cfg.min_match:
            raise ValueError(f"histospec: need 1 <= min_match <= match_window (got {cfg.min_match}, {cfg.match_window})")
        if cfg.draft_rule not in RULES:
            raise ValueError(f"histospec.draft_rule: unknown rule {cfg.draft_rule!r}; allowed: {', '.join(RULES)}")
        self.store = store
        self.cfg = cfg
        self._reqs: dict[str, _Req] = {}
        self._groups: dict[str, _Group] = {}
        self._reward = cfg.branch == "reward"
        self.cost = StepCostModel(cfg.step_cost_fixed_ms * 1e-3, cfg.step_cost_per_request_ms * 1e-3,
                                  cfg.step_cost_per_token_ms * 1e-3, cfg.step_cost_per_drafting_request_ms * 1e-3,
                                  prior_steps=cfg.step_cost_prior_steps, free_tokens=cfg.step_cost_free_tokens,
                                  ramp_requests=cfg.step_cost_draft_ramp_requests)
        self.acceptance = AcceptanceTracker(cfg.acceptance_prior, cfg.acceptance_prior_weight)
        self._stats = {"calls": 0, "drafts": 0, "proposed": 0, "accepted": 0, "feedbacks": 0, "draft_time_s": 0.0,
                       "steps": 0, "steps_without_drafts": 0, "requests_with_history": 0, "requests": 0,
                       "capped_by_length": 0, "searches": 0, "searches_skipped": 0}
        # What finding one request's chain costs (seconds): the prior, or measured as the
        # engine runs with step_cost: measured.
        self._search_s = cfg.draft_search_us * 1e-6
        self._by_source = {src: [0, 0, 0] for src in SOURCES}  # drafts, proposed, accepted

    # -- request lifecycle ------------------------------------------------------------
    def begin(self, req_id: str, key: int, group: str | None = None, predicted_len: float | None = None,
              prompt: Sequence[int] | None = None) -> None:
        """Start drafting for a request; ``predicted_len`` is its predicted response length
        (HistoPipe's), which caps drafts near the predicted end (goodput rule); ``prompt``
        joins the group's index (answers copy numbers and phrases from their prompt)."""
        if req_id in self._reqs:  # a re-used id: retire the old request first
            self.end(req_id)
        r = _Req(key, group, predicted_len)
        cfg = self.cfg
        sam = self.store.index(key) if cfg.enabled else None
        self._stats["requests"] += 1
        if sam is not None:
            self._stats["requests_with_history"] += 1
            if cfg.include_history:
                r.hist = _Match(sam)
        if cfg.enabled and cfg.include_siblings and group is not None:
            g = self._groups.get(group)
            if g is None:
                g = self._groups[group] = _Group(_index.DRAFT_READS and not cfg.tree)
                if prompt:
                    # No START marker: the prompt is matched mid-text, never as a response's start.
                    g.sam.push_at(0, [int(t) for t in prompt])
            g.members += 1
            r.sib = _Match(g.sam)
        if cfg.enabled and cfg.include_global:
            gsam = self.store.global_index()
            if gsam is not None:
                r.glob = _Match(gsam)
        r.window = cfg.fixed_len if cfg.draft_rule == "fixed" else START_LEN
        self._reqs[req_id] = r

    def end(self, req_id: str, response: Sequence[int] | None = None) -> None:
        r = self._reqs.pop(req_id, None)
        if r is None:
            return
        self.acceptance.end(req_id)
        if r.group is None or r.sib is None:
            return
        g = self._groups.get(r.group)
        if g is None:
            return
        if response:
            self._push_group(r, g, response)
        g.members -= 1
        if g.members <= 0:
            del self._groups[r.group]

    def has_request(self, req_id: str) -> bool:
        return req_id in self._reqs

    def _push_group(self, r: _Req, g: _Group, tokens: Sequence[int]) -> None:
        """Index the request's newly emitted tokens in its group (in-flight sibling drafts)."""
        if r.gpushed < 0:
            r.gcur = g.sam.push_at(0, [START])
            r.gpushed = 0
        n = len(tokens)
        if n > r.gpushed:
            r.gcur = g.sam.push_at(r.gcur, [int(t) for t in tokens[r.gpushed:n]])
            r.gpushed = n

    # -- drafting ---------------------------------------------------------------------
    def _best_chain(self, req_id: str, r: _Req, generated: Sequence[int], limit: int, conf_limit: int):
        """The best chain over all sources: (tokens, cond_probs, source, state, sam, survival), or None.

        Sources are compared by expected accepted tokens under each source's online
        acceptance (``AcceptanceTracker``), not by raw history counts: a source whose
        drafts the policy keeps rejecting loses to one it accepts. With
        ``match_confidence_tokens`` = K > 0 a chain drawn after a match of L tokens is
        compared at L / (L + K) of that: in a small index (a prompt's dozen responses) a
        short match's one or two occurrences look certain, while a longer match in another
        source is the better evidence. The kept chain's planning is not scaled.
        """
        cfg = self.cfg
        best = None
        best_val = 0.0
        acc = self.acceptance
        shrink = cfg.match_confidence_tokens
        # Matches are at most match_window long, so no scaled chain exceeds this share of its bound.
        bound_scale = cfg.match_window / (cfg.match_window + shrink)
        hist, sib, glob = r.hist, r.sib, r.glob
        if sib is not None:
            g = self._groups.get(r.group)
            if g is not None:
                self._push_group(r, g, generated)
        for src, m, walk in (("history", hist, _walk), ("group", sib, _walk_group), ("global", glob, _walk)):
            if m is None or not m.sam.num_tokens:
                continue
            if best is not None and acc.bound(req_id, src, conf_limit) * bound_scale <= best_val:
                continue  # even a unanimous chain from this source could not beat the best so far
            m.advance(generated, cfg.match_window, self._reward and src == "history")
            cand = self._chain_from(m, limit, conf_limit, walk)
            if cand is None:
                continue
            toks, probs, _, v, length, sam = cand
            val, surv = acc.expected_accepted(req_id, src, probs)
            if shrink > 0.0:
                val *= length / (length + shrink)
            if val > best_val:
                best, best_val = (toks, probs, src, v, sam, surv), val
        return best

    def propose(self, req_id: str, generated: Sequence[int], max_len: int) -> Draft:
        """One request's draft (the step-level ``propose_step`` is what the engine uses)."""
        return self.propose_step([(req_id, generated, max_len)])[0]

    def propose_step(self, items: Sequence[tuple[str, Sequence[int], int]]) -> list[Draft]:
        """Drafts for every running request of one engine step: (request id, generated
        tokens, most draft tokens the engine allows). Under the goodput rule the lengths
        are chosen jointly (``goodput.plan_step``): every request may get an empty draft."""
        t0 = time.perf_counter()
        st = self._stats
        cfg = self.cfg
        rule = cfg.draft_rule
        goodput = rule == "goodput"
        cands: list = []
        if goodput:
            # A request whose best conceivable draft could not enter the step's plan (and
            # repay the search) is not searched: at a high batch most requests' drafts do
            # not pay the verification, and their search is the proposer's whole cost there.
            plain_s, per_tok, per_drow = self.cost.plan_prices(len(items))
            # A prior's costs are no surer than a fit's: its plans clear the floor too (a
            # deterministic rule, so sampled runs still replay token for token).
            hurdle = self.cost.hurdle(cfg.min_goodput_gain) if cfg.step_cost == "measured" else cfg.min_goodput_gain
            # Every draft in a plan pays at a goodput of at least the hurdle's.
            lam0 = len(items) / plain_s * (1.0 + hurdle) if items else 0.0
            free = self.cost.free_drafts(len(items))
            acc = self.acceptance
        searched, skipped, search_s = 0, 0, 0.0
        clock = time.perf_counter
        for req_id, generated, max_len in items:
            st["calls"] += 1
            r = self._reqs.get(req_id)
            if r is not None:
                r.last_depth = 0
                r.last_src = ""
                r.last_q = []
            if (r is None or max_len <= 0 or not cfg.enabled or len(generated) < cfg.start_after
                    or (r.hist is None and r.sib is None and r.glob is None)):
                if r is not None and r.sib is not None and r.group in self._groups:
                    self._push_group(r, self._groups[r.group], generated)
                cands.append(None)
                continue
            cap = min(max_len, cfg.fixed_len if rule == "fixed" else cfg.max_draft)
            if goodput:
                rc = remaining_cap(len(generated), r.pred_len, cfg.length_margin)
                if rc is not None and rc < cap:
                    cap = rc
                    st["capped_by_length"] += 1
                limit = conf_limit = cap
            else:
                limit = min(r.window, cap)
                conf_limit = cap if rule == "adaptive" else limit
            if cap > 0 and goodput and lam0 > 0.0:
                f = acc.request_factor(req_id)
                if not any(draft_can_pay(f, acc.source_rates(src, cap), cap, lam0, per_tok, per_drow, self._search_s,
                                         free)
                           for src, m in (("history", r.hist), ("group", r.sib), ("global", r.glob))
                           if m is not None and m.sam.num_tokens):
                    skipped += 1
                    if r.sib is not None and r.group in self._groups:
                        self._push_group(r, self._groups[r.group], generated)
                    cands.append(None)
                    continue
            best = None
            if cap > 0:
                ts = clock()
                best = self._best_chain(req_id, r, generated, limit, conf_limit)
                search_s += clock() - ts
                searched += 1
            cands.append(None if best is None else (best, cap))
        if goodput:
            surv = [[] if c is None else c[0][5] for c in cands]
            lengths = plan_step(surv, self.cost, min_gain=cfg.min_gain, hurdle=hurdle).lengths
        else:
            lengths = [0 if c is None else len(c[0][0]) for c in cands]
        st["steps"] += 1
        out: list[Draft] = []
        for (req_id, _, max_len), c, k in zip(items, cands, lengths):
            if c is None or k <= 0:
                out.append(Draft())
                continue
            (toks, probs, src, v, sam, _), cap = c
            toks, probs = toks[:k], probs[:k]
            r = self._reqs[req_id]
            r.last_depth = len(toks)
            r.last_src = src
            r.last_q = probs
            parents = list(range(-1, len(toks) - 1))
            if cfg.tree:
                budget = min(max_len, max(cfg.tree_nodes, len(toks)))
                if budget > len(toks):
                    toks, probs, parents = self._grow_tree(sam, v, toks, probs, parents, budget, cap)
            st["drafts"] += 1
            st["proposed"] += len(toks)
            bs = self._by_source[src]
            bs[0] += 1
            bs[1] += len(toks)
            out.append(Draft(toks, probs, parents))
        if not any(out):
            st["steps_without_drafts"] += 1
        st["draft_time_s"] += time.perf_counter() - t0
        st["searches"] += searched
        st["searches_skipped"] += skipped
        if cfg.step_cost == "measured":
            if searched:
                # The searches alone: with the step's other work in it, a step that skipped most
                # requests would price the few searches it made ever higher, and skip more.
                self._search_s += 0.05 * (search_s / searched - self._search_s)
            elif skipped:
                # Nothing searched, nothing measured: an overestimate would stand for good.
                # Lowering it step by step lets searches resume, and measure it again.
                self._search_s *= 0.9
        return out

    def observe_step(self, num_requests: int, num_scored_tokens: int, seconds: float,
                     num_drafting_requests: Optional[int] = None) -> None:
        """A measured engine step (see ``goodput.StepCostModel``); ignored with step_cost=prior."""
        if self.cfg.step_cost == "measured":
            self.cost.observe_step(num_requests, num_scored_tokens, seconds, num_drafting_requests)

    def start_rollout(self) -> None:
        """A new rollout (new policy weights): statistics start afresh, the acceptance learnt so
        far counts ``histospec.acceptance_carry`` times (``acceptance_state`` is what a checkpoint
        keeps of it, so a resumed run drafts as the uninterrupted one); the step-cost model
        carries over."""
        self.reset_stats()
        self.carry_acceptance()

    def carry_acceptance(self, weight: Optional[float] = None) -> None:
        """The learnt acceptance into a new rollout, at ``weight`` (by default
        ``histospec.acceptance_carry``; 0 forgets it)."""
        self.acceptance.carry(self.cfg.acceptance_carry if weight is None else weight)

    def acceptance_state(self) -> dict:
        return self.acceptance.state_dict()

    def load_acceptance_state(self, state: dict) -> None:
        self.acceptance.load_state_dict(state)

    def _chain_from(self, m: _Match, limit: int, conf_limit: int, walk):
        cfg = self.cfg
        sam = m.sam
        v, length = m.state, m.length
        if cfg.match_length_factor > 0:
            cap = max(1, int(cfg.match_length_factor * length + 1e-9))
            limit, conf_limit = min(limit, cap), min(conf_limit, cap)
        if (view := _compiled(sam, self._reward)) is not None:
            got = _samc.chain(view, v, length, cfg.min_match, limit, conf_limit, cfg.min_prob, cfg.adaptive_conf)
        else:
            got = _python_chain(sam, walk, v, length, cfg.min_match, limit, conf_limit, cfg.min_prob, self._reward,
                                cfg.adaptive_conf)
        return None if got is None else (*got, sam)

    def _grow_tree(self, sam, root_state, toks, probs, parents, budget, depth_limit):
        """Add the most probable side branches to a chain, up to ``budget`` nodes."""
        cfg = self.cfg
        toks, probs, parents = list(toks), list(probs), list(parents)
        # Re-walk the spine to know each spine node's automaton state.
        states, paths = [], []
        v, pp = root_state, 1.0
        for c, q in zip(toks, probs):
            v = sam.trans(v, c)
            pp *= q
            states.append(v)
            paths.append(pp)
        heap: list = []
        tick = 0

        def push_children(node: int, state: int, path: float, depth: int, skip: int | None):
            nonlocal tick
            if depth >= depth_limit:
                return
            k = 0
            for c, u, q, _ in sam.children(state):
                if c == skip:
                    continue
                pp = path * q
                if pp < cfg.min_prob or k >= cfg.tree_topk:
                    break
                tick += 1
                heapq.heappush(heap, (-pp, tick, node, c, u, q, depth + 1))
                k += 1

        push_children(-1, root_state, 1.0, 0, toks[0] if toks else None)
        for i, (s, pth) in enumerate(zip(states, paths)):
            push_children(i, s, pth, i + 1, toks[i + 1] if i + 1 < len(toks) else None)
        while heap and len(toks) < budget:
            negp, _, parent, c, u, q, depth = heapq.heappop(heap)
            toks.append(c)
            probs.append(q)
            parents.append(parent)
            push_children(len(toks) - 1, u, -negp, depth, None)
        return toks, probs, parents

    # -- adaptive length ----------------------------------------------------------------
    def feedback(self, req_id: str, proposed: int, accepted: int) -> None:
        st = self._stats
        st["feedbacks"] += 1
        st["accepted"] += max(0, accepted)
        r = self._reqs.get(req_id)
        if r is None or proposed <= 0:
            return
        if r.last_src:
            # Acceptance is tracked along the chain actually verified (a tree's spine).
            acc = max(0, min(accepted, len(r.last_q)))
            self.acceptance.observe(req_id, r.last_src, r.last_q, acc)
            self._by_source[r.last_src][2] += acc
        rule = self.cfg.draft_rule
        if rule in ("fixed", "goodput"):
            return
        cap = self.cfg.max_draft
        depth = r.last_depth or proposed
        full = accepted >= min(proposed, depth)
        w = r.window
        if rule == "aimd":
            r.window = min(w + 2, cap) if full else START_LEN
        else:  # mimd and adaptive
            r.window = min(2 * w, cap) if full else max(START_LEN, w // 2)

    def window(self, req_id: str) -> int:
        return self._reqs[req_id].window

    def stats(self) -> dict:
        s = dict(self._stats)
        s["draft_time_us_per_call"] = 1e6 * s["draft_time_s"] / max(1, s["calls"])
        s["acceptance_rate"] = s["accepted"] / max(1, s["proposed"])
        s["active_requests"] = len(self._reqs)
        s["active_groups"] = len(self._groups)
        add_stat_fractions(s)
        s["search_us_per_request"] = 1e6 * self._search_s
        for src, (drafts, proposed, accepted) in self._by_source.items():
            s[f"source/{src}/drafts"] = drafts
            s[f"source/{src}/proposed"] = proposed
            s[f"source/{src}/accepted"] = accepted
        c = self.cost.state()
        s["step_cost/fixed_ms"] = 1e3 * c["fixed_s"]
        s["step_cost/per_request_ms"] = 1e3 * c["per_request_s"]
        s["step_cost/per_token_ms"] = 1e3 * c["per_token_s"]
        s["step_cost/per_drafting_request_ms"] = 1e3 * c["per_drafting_request_s"]
        s["step_cost/planning_per_token_ms"] = 1e3 * c["planning_per_token_s"]
        s["step_cost/planning_per_drafting_request_ms"] = 1e3 * c["planning_per_drafting_request_s"]
        s["step_cost/observed_steps"] = c["observed_steps"]
        # Until `explore` drafted steps are fitted, measured costs plan without a hurdle.
        s["step_cost/drafted_steps_fitted"] = c["drafted_steps_fitted"]
        s["step_cost/exploring"] = int(c["exploring"])
        s.update(self.acceptance.state())
        return s

    def reset_stats(self) -> None:
        for k in self._stats:
            self._stats[k] = 0.0 if k == "draft_time_s" else 0
        for v in self._by_source.values():
            v[:] = [0, 0, 0]
