"""Draft proposer: one call per engine step drafts every running request from incrementally matched suffix
automata (history, the GRPO group in flight, other prompts), lengths by ``goodput.plan_step``. Not thread-safe."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from rhymerl.config import HistoSpecConfig
from rhymerl.histospec.draft_calibration import Calibration
from rhymerl.histospec.goodput import AcceptanceTracker, StepCostModel, draft_can_pay, plan_step, remaining_cap
import rhymerl.histospec.index as _index
from rhymerl.histospec.index import NO_CHILD, START, CompiledGroupIndex, FrozenSuffixAutomaton, SuffixAutomaton, _samc
from rhymerl.histospec.step_costs import CPU_PRIOR, StepCosts
from rhymerl.histospec.store import HistoryStore

# Draft sources, in the order they are consulted (ties go to the earlier one).
SOURCES = ("history", "group", "global")
MIN_MATCH = 1  # shortest match a chain may follow; min_prob already rejects ambiguous short ones


@dataclass(frozen=True)
class Drafting:
    """How chains are found, compared and carried between rollouts (the lab's ablations replace fields)."""
    sources: tuple[str, ...] = SOURCES
    # A match is the longest suffix of at most this many generated tokens (or the draft limit, if larger).
    match_window: int = 32
    # A chain stops where its path probability falls below this (SuffixDecoding's min_token_prob).
    min_prob: float = 0.1
    # A chain after a match of L tokens is at most max(1, this x L) long; 0 = no cap.
    match_length_factor: float = 1.0
    # Chains compare at L / (L + this): a short match in a small index looks certain. 0 = unscaled.
    match_confidence_tokens: float = 4.0
    # P(accept) = this x the history's probability, before any draft is verified.
    acceptance_prior: float = 0.7
    # The acceptance learnt in earlier rollouts counts this many times in a new one.
    acceptance_carry: float = 0.5
    # Drafts stop at this multiple of the response's predicted length (0 = no cap).
    length_margin: float = 1.5


DRAFTING = Drafting()


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)


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

    def advance(self, generated: Sequence[int], window: int) -> None:
        # Positions count the virtual START marker in front of the response.
        sam = self.sam
        n = len(generated) + 1
        # Rematch on a changed index, tokens not extending the last seen (a reused id), or a window's jump.
        if (self.version != sam.version or self.pos > n or n - self.pos > window
                or (self.pos > 1 and generated[self.pos - 2] != self.last)):
            st, ln, start = 0, 0, max(0, n - window)
        else:
            st, ln, start = self.state, self.length, self.pos
        if (view := _compiled(sam)) is not None:
            st, ln = _samc.advance(view, st, ln, generated, start, n, window, START)
        else:
            st, ln = _python_advance(sam, st, ln, generated, start, n, window)
        self.state, self.length, self.version, self.pos = st, ln, sam.version, n
        self.last = generated[-1] if n > 1 else START


def _python_advance(sam, st: int, ln: int, generated: Sequence[int], start: int, n: int,
                    window: int) -> tuple[int, int]:
    """The match (st, ln) extended by positions [start, n), at most ``window`` long (``_samc.advance``)."""
    trans, link, lens = sam.trans, sam.link, sam.ln
    if isinstance(sam, FrozenSuffixAutomaton):
        best = sam.best
    else:
        arrays = sam._arrays
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


def _python_chain(sam, walk, v: int, length: int, limit: int, min_prob: float, min_match: int = MIN_MATCH):
    """(tokens, cond_probs, score, state, match length), backing off to shorter matches (``_samc.chain``)."""
    lens, link = sam.ln, sam.link
    while length >= min_match:
        toks, probs, score = walk(sam, v, limit, min_prob)
        if toks:
            return toks, probs, score, v, length
        v = link[v]
        length = lens[v]
    return None


def _compiled(sam):
    """The compiled handle to read ``sam`` through, or None for the Python walks."""
    if isinstance(sam, CompiledGroupIndex):
        return sam.handle
    if isinstance(sam, FrozenSuffixAutomaton):
        return sam.compiled()
    return None


class _Req:
    __slots__ = ("key", "group", "hist", "sib", "glob", "live", "toks", "gcur", "gpushed", "lcur", "lpushed",
                 "pred_len", "last_src", "last_q", "last_surv", "declined")

    def __init__(self, key: int, group: Optional[str], pred_len: Optional[float] = None):
        self.key = key
        self.group = group
        self.hist: Optional[_Match] = None
        self.sib: Optional[_Match] = None
        self.glob: Optional[_Match] = None
        self.live: Optional[_Match] = None
        self.toks: list[int] = []
        # End state and pushed length of this request's sequence in its group's / the rollout's index.
        self.gcur = 0
        self.gpushed = -1
        self.lcur = 0
        self.lpushed = -1
        self.pred_len = pred_len
        self.last_src = ""
        self.last_q: list[float] = []
        self.last_surv: list[float] = []
        # A chain the rule did not draft: (position, tokens, cond_probs, source), checked against what follows.
        self.declined: Optional[tuple[int, list[int], list[float], str]] = None


def _growing():
    """An index that grows while requests draft from it."""
    return CompiledGroupIndex() if _index.DRAFT_READS else SuffixAutomaton()


class _Group:
    __slots__ = ("sam", "members")

    def __init__(self) -> None:
        self.sam = _growing()
        self.members = 0


def _greedy(next_of, v: int, limit: int, min_prob: float):
    """(tokens, cond_probs, score) of the greedy chain from v along ``next_of(v) -> (token, child, q) | None``."""
    toks: list[int] = []
    probs: list[float] = []
    score = 0.0  # sum of path probabilities = expected accepted tokens (empirically)
    p = 1.0
    n = 0
    while n < limit:
        nx = next_of(v)
        if nx is None:
            break
        c, u, q = nx
        p *= q
        if p < min_prob:
            break
        toks.append(c)
        probs.append(q)
        score += p
        v = u
        n += 1
    return toks, probs, score


def _walk(sam: SuffixAutomaton | FrozenSuffixAutomaton, v: int, limit: int, min_prob: float):
    """Greedy chain along the most frequent children."""
    if isinstance(sam, FrozenSuffixAutomaton):
        best, cnt = sam.best, sam.cnt

        def next_of(v: int):
            c, u = best(v)
            return None if c == NO_CHILD else (c, u, cnt[u] / cnt[v])
    else:
        bt, bd, bq = sam.best_arrays()

        def next_of(v: int):
            c = bt[v]
            return None if c == NO_CHILD else (c, bd[v], bq[v])
    return _greedy(next_of, v, limit, min_prob)


def _walk_group(sam: SuffixAutomaton, v: int, limit: int, min_prob: float):
    """Greedy chain in a growing group index (in-flight ends mean "not yet", so they do not dilute counts)."""
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
    return _greedy(next_of, v, limit, min_prob)


# ``DraftProposer.stats()``'s counts behind its fractions: they add up over rollouts and engines.
STAT_COUNTS = ("requests", "requests_with_history", "steps", "steps_without_drafts", "searches", "searches_skipped")


def add_stat_fractions(s: dict) -> dict:
    """Set ``DraftProposer.stats()``'s fractions from its counts (also counts summed over rollouts)."""
    if "steps" in s:
        s["steps_without_drafts_fraction"] = s["steps_without_drafts"] / max(1, s["steps"])
    if "requests" in s:
        s["history_served_fraction"] = s["requests_with_history"] / max(1, s["requests"])
    if "searches" in s:
        s["searches_skipped_fraction"] = s["searches_skipped"] / max(1, s["searches"] + s["searches_skipped"])
    return s


class DraftProposer:
    """``costs``: the engine device's step-cost prior; ``drafting``: how chains are found."""

    def __init__(self, store: HistoryStore, cfg: HistoSpecConfig, costs: StepCosts = CPU_PRIOR,
                 drafting: Drafting = DRAFTING):
        if drafting.match_window < MIN_MATCH:
            raise ValueError(f"histospec: match_window must be >= {MIN_MATCH} (got {drafting.match_window})")
        if unknown := set(drafting.sources) - set(SOURCES):
            raise ValueError(f"histospec: unknown draft sources {sorted(unknown)}; allowed: {', '.join(SOURCES)}")
        self.store = store
        self.cfg = cfg
        self.costs = costs
        self.drafting = drafting
        self._reqs: dict[str, _Req] = {}
        self._groups: dict[str, _Group] = {}
        # Every response since the store's shared index was built, indexed as its tokens arrive.
        self._rollout = _growing()
        self._rollout_base: Optional[FrozenSuffixAutomaton] = None
        self.cost = StepCostModel(costs.fixed_ms * 1e-3, costs.per_request_ms * 1e-3, costs.per_token_ms * 1e-3,
                                  costs.per_drafting_request_ms * 1e-3)
        self.acceptance = AcceptanceTracker(drafting.acceptance_prior)
        self.calibration = Calibration()
        self._stats = {"calls": 0, "drafts": 0, "proposed": 0, "accepted": 0, "feedbacks": 0, "draft_time_s": 0.0,
                       "steps": 0, "steps_without_drafts": 0, "requests_with_history": 0, "requests": 0,
                       "capped_by_length": 0, "searches": 0, "searches_skipped": 0}
        # Seconds to find one request's chain: the prior, or measured as the engine runs (step_cost: measured).
        self._search_s = costs.search_us * 1e-6
        self._by_source = {src: [0, 0, 0] for src in SOURCES}  # drafts, proposed, accepted

    def begin(self, req_id: str, key: int, group: str | None = None, predicted_len: float | None = None,
              prompt: Sequence[int] | None = None) -> None:
        """Start drafting for a request (``predicted_len`` caps drafts; ``prompt`` joins the group's index)."""
        if req_id in self._reqs:  # a re-used id: retire the old request first
            self.end(req_id)
        r = _Req(key, group, predicted_len)
        sources = self.drafting.sources
        sam = self.store.index(key)
        self._stats["requests"] += 1
        if sam is not None:
            self._stats["requests_with_history"] += 1
            if "history" in sources:
                r.hist = _Match(sam)
        if "group" in sources and group is not None:
            g = self._groups.get(group)
            if g is None:
                g = self._groups[group] = _Group()
                if prompt:
                    # No START marker: the prompt is matched mid-text, never as a response's start.
                    g.sam.push_at(0, [int(t) for t in prompt])
            g.members += 1
            r.sib = _Match(g.sam)
        if "global" in sources and self.cfg.global_token_budget > 0:
            gsam = self.store.global_index()
            if gsam is not self._rollout_base:
                self._rollout = _growing()  # a rebuilt shared index holds every finished response
                self._rollout_base = gsam
            if gsam is not None:
                r.glob = _Match(gsam)
            r.live = _Match(self._rollout)
        self._reqs[req_id] = r

    def end(self, req_id: str, response: Sequence[int] | None = None) -> None:
        """The request finished (or was aborted): ``response``'s unseen tokens join its indexes."""
        r = self._reqs.pop(req_id, None)
        if r is None:
            return
        if response is not None:
            if r.declined is not None:
                self._check_declined(req_id, r, response)
            self._take_tokens(r, response)
        self.acceptance.end(req_id)
        if r.group is None or r.sib is None:
            return
        g = self._groups.get(r.group)
        if g is None:
            return
        g.members -= 1
        if g.members <= 0:
            del self._groups[r.group]

    def has_request(self, req_id: str) -> bool:
        return req_id in self._reqs

    def _take_tokens(self, r: _Req, tokens: Sequence[int]) -> None:
        """Index the request's newly emitted tokens in its group and in the rollout's index."""
        n, have = len(tokens), len(r.toks)
        if n > have:
            r.toks.extend(int(t) for t in tokens[have:n])
        # A request whose rollout index was replaced stays out of the new one; the index stops at the budget.
        if (r.live is not None and r.live.sam is self._rollout and r.lpushed < len(r.toks)
                and self._rollout.num_tokens < self.cfg.global_token_budget):
            if r.lpushed < 0:
                r.lcur = self._rollout.push_at(0, [START])
                r.lpushed = 0
            r.lcur = self._rollout.push_at(r.lcur, r.toks[r.lpushed:])
            r.lpushed = len(r.toks)
        if r.sib is None or r.gpushed >= len(r.toks):
            return
        g = self._groups.get(r.group)
        if g is None:
            return
        if r.gpushed < 0:
            r.gcur = g.sam.push_at(0, [START])
            r.gpushed = 0
        r.gcur = g.sam.push_at(r.gcur, r.toks[r.gpushed:])
        r.gpushed = len(r.toks)

    def _best_chain(self, req_id: str, r: _Req, generated: Sequence[int], limit: int, window: int):
        """(tokens, cond_probs, source, survival) of the chain with the most expected accepted tokens."""
        d = self.drafting
        best = None
        best_val = 0.0
        acc = self.acceptance
        shrink = d.match_confidence_tokens
        # Matches are at most a window long, so no scaled chain exceeds this share of its bound.
        bound_scale = window / (window + shrink)
        bounds: dict[str, float] = {}
        for src, m, walk in (("history", r.hist, _walk), ("group", r.sib, _walk_group), ("global", r.glob, _walk),
                             ("global", r.live, _walk_group)):
            if m is None or not m.sam.num_tokens:
                continue
            if best is not None:
                if (b := bounds.get(src)) is None:
                    b = bounds[src] = acc.bound(req_id, src, limit) * bound_scale
                if b <= best_val:
                    continue  # even a unanimous chain from this source could not beat the best so far
            m.advance(generated, window)
            cand = self._chain_from(m, limit, walk)
            if cand is None:
                continue
            toks, probs, length = cand
            val, surv = acc.expected_accepted(req_id, src, probs)
            if shrink > 0.0:
                val *= length / (length + shrink)
            if val > best_val:
                best, best_val = (toks, probs, src, surv), val
        return best

    def _chain_from(self, m: _Match, limit: int, walk):
        """(tokens, cond_probs, match length) of the chain after ``m``'s match, or None."""
        d = self.drafting
        sam = m.sam
        v, length = m.state, m.length
        if d.match_length_factor > 0:
            limit = min(limit, max(1, int(d.match_length_factor * length + 1e-9)))
        if (view := _compiled(sam)) is not None:
            got = _samc.chain(view, v, length, MIN_MATCH, limit, d.min_prob)
        else:
            got = _python_chain(sam, walk, v, length, limit, d.min_prob)
        return None if got is None else (got[0], got[1], got[4])

    def propose(self, req_id: str, generated: Sequence[int], max_len: int) -> Draft:
        """One request's draft (the step-level ``propose_step`` is what the engine uses)."""
        return self.propose_step([(req_id, generated, max_len)])[0]

    def propose_step(self, items: Sequence[tuple[str, Sequence[int], int]]) -> list[Draft]:
        """Drafts for one engine step's (request id, generated tokens, draft limit); lengths chosen jointly."""
        t0 = time.perf_counter()
        st = self._stats
        cfg = self.cfg
        measured = cfg.step_cost == "measured"
        cands: list = []
        # Requests whose best conceivable draft could not pay are not searched (the proposer's main cost).
        plain_s, per_tok, per_drow = self.cost.plan_prices(len(items))
        # A prior's plans clear the floor too (deterministic, so sampled runs replay exactly).
        hurdle = self.cost.hurdle(cfg.min_goodput_gain) if measured else cfg.min_goodput_gain
        lam0 = len(items) / plain_s * (1.0 + hurdle) if items else 0.0
        acc = self.acceptance
        margin = self.drafting.length_margin
        match_window = self.drafting.match_window
        searched, skipped, search_s = 0, 0, 0.0
        clock = time.perf_counter
        for req_id, generated, max_len in items:
            st["calls"] += 1
            r = self._reqs.get(req_id)
            if r is not None:
                r.last_src = ""
                r.last_q = []
                if r.declined is not None:
                    self._check_declined(req_id, r, generated)
                self._take_tokens(r, generated)
            if r is None or max_len <= 0 or (r.hist is None and r.sib is None and r.glob is None and r.live is None):
                cands.append(None)
                continue
            cap = max_len
            rc = remaining_cap(len(generated), r.pred_len, margin)
            if rc is not None and rc < cap:
                cap = rc
                st["capped_by_length"] += 1
            if cap > 0 and lam0 > 0.0:
                with_text = {src for src, m in (("history", r.hist), ("group", r.sib), ("global", r.glob),
                                                ("global", r.live)) if m is not None and m.sam.num_tokens}
                if not any(draft_can_pay(acc.rate_bounds(req_id, src, cap), lam0, per_tok,
                                         per_drow, self._search_s) for src in with_text):
                    skipped += 1
                    cands.append(None)
                    continue
            best = None
            if cap > 0:
                ts = clock()
                # No window shorter than the longest draft: a chain is at most its match long.
                best = self._best_chain(req_id, r, generated, cap, max(match_window, max_len))
                search_s += clock() - ts
                searched += 1
            cands.append(best)
        lengths = plan_step([[] if c is None else c[3] for c in cands], self.cost, hurdle=hurdle).lengths
        st["steps"] += 1
        out: list[Draft] = []
        for (req_id, generated, _), c, k in zip(items, cands, lengths):
            if c is None or k <= 0:
                if c is not None:
                    self._reqs[req_id].declined = (len(generated), c[0], c[1], c[2])
                out.append(Draft())
                continue
            toks, probs, src, surv = c
            toks, probs = toks[:k], probs[:k]
            r = self._reqs[req_id]
            r.last_src = src
            r.last_q = probs
            r.last_surv = surv[:k]
            st["drafts"] += 1
            st["proposed"] += len(toks)
            bs = self._by_source[src]
            bs[0] += 1
            bs[1] += len(toks)
            out.append(Draft(toks, probs))
        if not any(out):
            st["steps_without_drafts"] += 1
        st["draft_time_s"] += time.perf_counter() - t0
        st["searches"] += searched
        st["searches_skipped"] += skipped
        if measured:
            if searched:
                # The searches alone: the step's other work would price searches up and skip more.
                self._search_s += 0.05 * (search_s / searched - self._search_s)
            elif skipped:
                self._search_s *= 0.9  # Nothing measured: decay, else an overestimate would stand for good.
        return out

    def _check_declined(self, req_id: str, r: _Req, tokens: Sequence[int]) -> None:
        """Learn from a chain the rule declined as from a verified draft: the tokens the request went on to write
        are the target's own samples, so matching them has the probability verification would have accepted
        with. Without this the acceptance model learns only where it already drafts, and a source it
        underrates at the start is never drafted, so never corrected."""
        pos, toks, probs, src = r.declined
        known = len(tokens) - pos
        if known <= 0:
            return
        r.declined = None
        n = min(len(toks), known)
        matched = 0
        while matched < n and toks[matched] == tokens[pos + matched]:
            matched += 1
        # Positions past what has been written are unknown: a chain matching all of them is cut there.
        self.acceptance.observe(req_id, src, probs[:n] if matched == n else probs, matched, forecast=False)

    def observe_step(self, num_requests: int, num_scored_tokens: int, seconds: float,
                     num_drafting_requests: Optional[int] = None) -> None:
        """A measured engine step (see ``goodput.StepCostModel``); ignored with step_cost=prior."""
        if self.cfg.step_cost == "measured":
            self.cost.observe_step(num_requests, num_scored_tokens, seconds, num_drafting_requests)

    def start_rollout(self) -> None:
        """A new rollout (new weights): stats afresh, learnt acceptance carried, step-cost model kept."""
        self.reset_stats()
        self.carry_acceptance()

    def carry_acceptance(self, weight: Optional[float] = None) -> None:
        """The learnt acceptance into a new rollout at ``weight`` (default ``acceptance_carry``; 0 forgets)."""
        self.acceptance.carry(self.drafting.acceptance_carry if weight is None else weight)

    def acceptance_state(self) -> dict:
        return self.acceptance.state_dict()

    def load_acceptance_state(self, state: dict) -> None:
        self.acceptance.load_state_dict(state)

    def feedback(self, req_id: str, proposed: int, accepted: int) -> None:
        st = self._stats
        st["feedbacks"] += 1
        st["accepted"] += max(0, accepted)
        r = self._reqs.get(req_id)
        if r is None or proposed <= 0 or not r.last_src:
            return
        acc = max(0, min(accepted, len(r.last_q)))
        self.acceptance.observe(req_id, r.last_src, r.last_q, acc)
        self.calibration.observe(r.last_surv, acc)
        self._by_source[r.last_src][2] += acc

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
        s["step_cost/drafted_steps_fitted"] = c["drafted_steps_fitted"]
        s["step_cost/exploring"] = int(c["exploring"])
        s.update(self.acceptance.state())
        s.update(self.calibration.counts())
        return s

    def reset_stats(self) -> None:
        for k in self._stats:
            self._stats[k] = 0.0 if k == "draft_time_s" else 0
        for v in self._by_source.values():
            v[:] = [0, 0, 0]
        self.calibration.reset()
