"""Cost-aware draft lengths: per engine step, maximise expected emitted tokens per second.

Three pieces, all pure Python (no engine, no torch):

``StepCostModel``
    Predicted seconds of one engine step that scores ``T`` tokens for ``R`` requests:
    ``fixed + per_request * R + per_token * T`` (``T = R + draft tokens``). Fitted online
    by exponentially weighted least squares from ``observe_step(num_requests,
    num_scored_tokens, seconds)``, regularised towards the configured prior (a ridge
    prior of ``prior_steps`` pseudo-steps), so the split between per-request and
    per-token cost stays sane while every step has the same shape (no drafts: R == T).

``AcceptanceTracker``
    A history draft token d with history continuation probability q (counts in the
    suffix index) is accepted by the target with probability p(d). We model
    P(accept | position reached) = min(1, f * a[i] * q): a per-source multiplier per draft
    depth i (ratio estimators: accepted tokens / history probability mass tried) and a
    per-request factor f (accepted / expected so far). So a request whose drafts keep
    failing stops drafting even where the history is unanimous, and vice versa.

``plan_step``
    Given each request's candidate chain as per-position acceptance probabilities, the
    expected tokens of drafting k is ``1 + sum_{i<=k} prod_{j<=i} p_j``; the marginal gain
    of the k-th token (``prod_{j<=k} p_j``) never increases with k. Adding one draft token
    anywhere costs ``per_token`` seconds, so goodput E/T rises iff its gain exceeds
    ``per_token * E / T``. Taking tokens in order of decreasing gain while that holds is
    optimal (a fractional-knapsack argument on the ratio). Requests whose first token
    does not pay get an empty draft; a step where no token pays drafts nothing at all.
    A request's draft is also capped by its predicted remaining length (tokens drafted
    past the end of a response are never accepted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence


class StepCostModel:
    """Online fit of seconds = fixed + per_request * R + per_token * T.

    Fitted in the basis (1, R, D) with D = T - R the draft tokens, i.e. a cost per row
    (per_request + per_token) and a cost per draft token (per_token): while drafts are
    rare D carries no information and the ridge prior holds the draft-token cost, instead
    of letting noise split one row's cost between two collinear columns.
    """

    def __init__(self, fixed: float, per_request: float, per_token: float, prior_steps: float = 1.0,
                 decay: float = 0.999):
        for name, v in (("fixed", fixed), ("per_request", per_request), ("per_token", per_token)):
            if not (v >= 0.0 and math.isfinite(v)):
                raise ValueError(f"step cost prior {name} must be a finite number >= 0 (got {v})")
        if not per_token > 0.0:
            raise ValueError(f"step cost prior per_token must be > 0 (got {per_token})")
        if not prior_steps > 0.0:
            raise ValueError(f"step cost prior_steps must be > 0 (got {prior_steps})")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"step cost decay must be in (0, 1] (got {decay})")
        self.prior = (float(fixed), float(per_request), float(per_token))
        self._prior_basis = (float(fixed), float(per_request) + float(per_token), float(per_token))
        self.prior_steps = float(prior_steps)
        self.decay = float(decay)
        # Weighted sums of x x^T and x y over observed steps, x = (1, R, D).
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self.num_observed = 0
        self._coef: Optional[tuple[float, float, float]] = self.prior

    def observe_step(self, num_requests: int, num_scored_tokens: int, seconds: float) -> None:
        """One engine step's measured duration (forward + sampling + scheduling)."""
        if num_requests <= 0 or num_scored_tokens < num_requests or not (seconds > 0 and math.isfinite(seconds)):
            return
        x = (1.0, float(num_requests), float(num_scored_tokens - num_requests))
        d = self.decay
        # Relative errors (weight 1/seconds^2): interference from other processes stretches
        # steps multiplicatively, and a stretched step then counts for less.
        w = 1.0 / (seconds * seconds)
        for i in range(3):
            self._xy[i] = d * self._xy[i] + w * x[i] * seconds
            row = self._xx[i]
            for j in range(3):
                row[j] = d * row[j] + w * x[i] * x[j]
        self.num_observed += 1
        self._coef = None

    @property
    def coef(self) -> tuple[float, float, float]:
        """(fixed, per_request, per_token) in seconds, non-negative."""
        if self._coef is None:
            self._coef = self._solve()
        return self._coef

    def _solve(self) -> tuple[float, float, float]:
        # Ridge towards the prior, scaled to the observed magnitudes (at least one unit) so
        # it weighs like ``prior_steps`` steps of the typical shape whatever the batch size.
        n = self._xx[0][0]
        if n <= 0:
            return self.prior
        lam = [self.prior_steps * max(1.0, self._xx[i][i] / n) for i in range(3)]
        a = [[self._xx[i][j] + (lam[i] if i == j else 0.0) for j in range(3)] for i in range(3)]
        b = [self._xy[i] + lam[i] * self._prior_basis[i] for i in range(3)]
        sol = _solve3(a, b)
        if sol is None:
            return self.prior
        fixed, per_row, per_tok = sol
        # Negative coefficients are fitting artefacts: clamp, and keep the draft-token cost
        # strictly positive so drafting is never free.
        per_tok = max(per_tok, 1e-3 * self.prior[2])
        return (max(0.0, fixed), max(0.0, per_row - per_tok), per_tok)

    def predict(self, num_requests: int, num_scored_tokens: int) -> float:
        f, r, t = self.coef
        return f + r * num_requests + t * num_scored_tokens

    def state(self) -> dict:
        f, r, t = self.coef
        return {"fixed_s": f, "per_request_s": r, "per_token_s": t, "observed_steps": self.num_observed}


def _solve3(a: list[list[float]], b: list[float]) -> Optional[tuple[float, float, float]]:
    """Gaussian elimination with partial pivoting (3x3; avoids a NumPy call per step)."""
    m = [row[:] + [bb] for row, bb in zip(a, b)]
    for c in range(3):
        p = max(range(c, 3), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, 3):
            f = m[r][c] / m[c][c]
            for k in range(c, 4):
                m[r][k] -= f * m[c][k]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][k] * x[k] for k in range(r + 1, 3))) / m[r][r]
    return x[0], x[1], x[2]


class AcceptanceTracker:
    """Online acceptance model: P(accept position i | reached) = min(1, f_req * a_src[i] * q_i).

    ``a_src[i]`` is a per-source, per-depth multiplier (ratio estimator: accepted tokens /
    history probability mass over the positions tried at depth i, shrunk towards the
    previous depth's, and depth 0 towards ``prior``): runs of accepted tokens are
    correlated (a request that follows its history keeps following it), so deeper
    positions are accepted more often than a constant rate predicts. ``f_req`` scales a
    request's rates by how it fared so far against them (accepted / expected), shrunk
    towards 1 with ``request_weight`` pseudo-tokens.
    """

    MAX_DEPTH = 64

    def __init__(self, prior: float = 0.5, prior_weight: float = 4.0, request_weight: float = 4.0):
        if not 0.0 < prior <= 1.0:
            raise ValueError(f"acceptance prior must be in (0, 1] (got {prior})")
        if prior_weight <= 0 or request_weight <= 0:
            raise ValueError("acceptance prior weights must be > 0")
        self.prior = prior
        self.prior_weight = prior_weight
        self.request_weight = request_weight
        self._src: dict[str, list[list[float]]] = {}  # source -> per depth [accepted, q mass]
        self._rates: dict[str, list[float]] = {}  # cache of source_rates
        self._req: dict[str, list[float]] = {}  # request -> [accepted, expected]

    def source_rates(self, source: str, n: int) -> list[float]:
        """Multipliers a_src[0..n-1]."""
        cached = self._rates.get(source)
        if cached is not None and len(cached) >= n:
            return cached
        table = self._src.get(source, [])
        rates = []
        prev = self.prior
        w = self.prior_weight
        for i in range(max(n, len(table), 1)):
            acc, mass = table[i] if i < len(table) else (0.0, 0.0)
            prev = (acc + w * prev) / (mass + w)
            rates.append(prev)
        self._rates[source] = rates
        return rates

    def source_rate(self, source: str) -> float:
        return self.source_rates(source, 1)[0]

    def request_factor(self, req: str) -> float:
        r = self._req.get(req)
        if r is None:
            return 1.0
        return (r[0] + self.request_weight) / (r[1] + self.request_weight)

    def survival(self, req: str, source: str, cond_probs: Sequence[float]) -> list[float]:
        """Per-position acceptance probabilities given the position is reached."""
        n = len(cond_probs)
        if n == 0:
            return []
        rates = self.source_rates(source, n)
        f = self.request_factor(req)
        last = len(rates) - 1
        return [min(1.0, f * rates[min(i, last)] * q) for i, q in enumerate(cond_probs)]

    def bound(self, req: str, source: str, n: int) -> float:
        """Most expected accepted tokens any chain of n tokens from ``source`` can have (q = 1)."""
        e, p = 0.0, 1.0
        for a in self.survival(req, source, [1.0] * n):
            p *= a
            e += p
        return e

    def observe(self, req: str, source: str, cond_probs: Sequence[float], accepted: int) -> None:
        """A verified draft: its first ``accepted`` tokens were accepted."""
        n = len(cond_probs)
        if n == 0:
            return
        accepted = max(0, min(accepted, n))
        tried = min(n, accepted + 1, self.MAX_DEPTH)
        expected = sum(self.survival(req, source, cond_probs[:tried])) if req in self._req else \
            sum(self.survival("", source, cond_probs[:tried]))
        table = self._src.setdefault(source, [])
        while len(table) < tried:
            table.append([0.0, 0.0])
        for i in range(tried):
            table[i][0] += 1.0 if i < accepted else 0.0
            table[i][1] += float(cond_probs[i])
        self._rates.pop(source, None)
        r = self._req.setdefault(req, [0.0, 0.0])
        r[0] += min(accepted, tried)
        r[1] += expected

    def end(self, req: str) -> None:
        self._req.pop(req, None)

    def state(self) -> dict:
        return {f"acceptance_multiplier/{s}": round(self.source_rate(s), 4) for s in sorted(self._src)}


def expected_tokens(survival: Sequence[float], k: int) -> float:
    """Expected tokens emitted by one verification of the first k draft tokens (>= 1)."""
    e, p = 1.0, 1.0
    for q in survival[:k]:
        p *= q
        e += p
    return e


@dataclass
class StepPlan:
    lengths: list[int]
    expected_tokens: float
    predicted_s: float

    @property
    def draft_tokens(self) -> int:
        return sum(self.lengths)


def plan_step(survival: Sequence[Sequence[float]], cost: StepCostModel, caps: Optional[Sequence[int]] = None,
              min_gain: float = 0.0) -> StepPlan:
    """Draft length per request (index-aligned with ``survival``) maximising E / T.

    ``survival[r]`` are request r's per-position acceptance probabilities (given the
    position is reached), ``caps[r]`` the most tokens it may draft (engine room,
    predicted remaining length). Requests with nothing to draft still count: every row
    of the step emits one token and costs a scored token.
    """
    n = len(survival)
    fixed, per_req, per_tok = cost.coef
    e = float(n)
    t = fixed + per_req * n + per_tok * n
    gains: list[tuple[float, int, int]] = []
    for r, surv in enumerate(survival):
        cap = len(surv) if caps is None else max(0, min(len(surv), caps[r]))
        p = 1.0
        for k in range(cap):
            p *= surv[k]
            if p <= 0.0:
                break
            gains.append((p, k, r))
    # Decreasing gain; within a request the position order is kept (ties by position).
    gains.sort(key=lambda g: (-g[0], g[1]))
    lengths = [0] * n
    for g, k, r in gains:
        if g <= min_gain or g * t <= per_tok * e:
            break
        if k != lengths[r]:
            continue  # an earlier position of this chain was not taken (cannot happen with sorted prefixes)
        lengths[r] = k + 1
        e += g
        t += per_tok
    return StepPlan(lengths, e, t)


def remaining_cap(generated: int, predicted_len: Optional[float], margin: float) -> Optional[int]:
    """Most draft tokens worth proposing for a request predicted to end at ``predicted_len``.

    ``margin`` scales the prediction (lengths are long-tailed: the group's mean is often
    exceeded). A request already past margin * prediction is in the tail, where the
    prediction says nothing: no cap. None = no prediction.
    """
    if predicted_len is None or not predicted_len > 0 or not margin > 0:
        return None
    horizon = margin * predicted_len - generated
    if horizon <= 0:
        return None
    # The last token of a response is sampled, never drafted usefully past the end.
    return max(0, int(math.ceil(horizon)) - 1)
