"""Cost-aware draft lengths: per engine step, maximise expected emitted tokens per second.

Three pieces, all pure Python (no engine, no torch):

``StepCostModel``
    Predicted seconds of one engine step that scores ``T`` tokens for ``R`` requests of
    which ``N`` draft: ``fixed + per_request * R + per_token * T + per_drafting_request * N``
    (``T = R`` + the draft tokens charged). What a draft token costs depends on the step's
    shape, and two shapes are offered. ``ramp_requests``: its price rises with the step's rows,
    min(1, R / ramp_requests) of ``per_token`` (on a 2-core CPU, fixed-length drafts: ~0.9 ms
    at 1 request, ~1.4 ms at 2 with 14 drafts, 2.8-3.8 ms from 4 requests on with 8 drafts
    or 100: the rows set the price, not the step's token count). ``free_tokens``: drafts
    that keep the step's scored tokens within that many are not charged (a forward bound by
    reading the weights). Fitted online by exponentially weighted least squares
    from ``observe_step``, regularised towards the configured prior (a ridge prior of
    ``prior_steps`` pseudo-steps), so the split between the costs stays sane while every
    step has the same shape (no drafts: R == T).

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
    of the k-th token (``prod_{j<=k} p_j``) never increases with k. A draft token costs
    ``per_token`` seconds (the step's first ``free_tokens`` scored tokens nothing: they go
    to the tokens that gain most) and a request that drafts at all ``per_drafting_request`` more;
    the lengths maximising goodput E/T are found by Dinkelbach's iteration on the ratio
    (for a fixed goodput the requests separate). Requests whose draft does not pay get an
    empty one; a step where nothing pays drafts nothing at all.
    A request's draft is also capped by its predicted remaining length (tokens drafted
    past the end of a response are never accepted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence


class StepCostModel:
    """Online fit of seconds = fixed + per_request * R + per_token * T + per_drafting_request * N.

    ``T`` is the tokens scored (R rows plus D draft tokens) and ``N`` the rows that carry a
    draft: besides its tokens, a drafting row may cost a multi-token attention query and its
    rejection-sampling pass (on a 2-core CPU host ``bench step --calibrate`` measured 0.13 ms
    a drafting row beyond its draft tokens' 2.5 ms each). Fitted in the basis (1, R, D, N), i.e. a cost per row
    (per_request + per_token), per draft token and per drafting row: while drafts are rare
    D and N carry no information and the ridge prior holds their costs, instead of letting
    noise split one row's cost between collinear columns.

    Two guards keep the fit from locking itself out of drafting (a drafting cost
    overestimated once stops all drafting, and with it every observation that could
    correct it):

    - the first ``warmup`` steps with drafts and without are not fitted (first use of a
      code path: allocation, kernel selection);
    - plans use optimistic drafting costs (``planning_coef``): each fitted cost less ``z``
      standard errors, never below half of it, so while few drafted steps were seen the
      plan keeps drafting what would pay at a lower cost, and those steps measure it;
    - until ``explore`` drafted steps have been fitted (``exploring``), the planned drafting
      costs are also never above the prior's ratio to the fitted per-row cost: one drafted
      step stretched by another process (a busy host stretches steps 1-10x, and the 1/s^2
      weights cannot tell such a step from a costly draft while it is the only one) would
      otherwise price drafting out before a second drafted step is ever measured.
    """

    def __init__(self, fixed: float, per_request: float, per_token: float, per_drafting_request: float = 0.0,
                 prior_steps: float = 1.0, decay: float = 0.999, warmup: int = 2, z: float = 1.0,
                 explore: int = 16, free_tokens: int = 0, ramp_requests: int = 1):
        for name, v in (("fixed", fixed), ("per_request", per_request), ("per_token", per_token),
                        ("per_drafting_request", per_drafting_request)):
            if not (v >= 0.0 and math.isfinite(v)):
                raise ValueError(f"step cost prior {name} must be a finite number >= 0 (got {v})")
        if not per_token > 0.0:
            raise ValueError(f"step cost prior per_token must be > 0 (got {per_token})")
        if not prior_steps > 0.0:
            raise ValueError(f"step cost prior_steps must be > 0 (got {prior_steps})")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"step cost decay must be in (0, 1] (got {decay})")
        if z < 0.0 or warmup < 0 or explore < 0:
            raise ValueError("step cost z, warmup and explore must be >= 0")
        if free_tokens < 0:
            raise ValueError(f"step cost free_tokens must be >= 0 (got {free_tokens})")
        if ramp_requests < 1:
            raise ValueError(f"step cost ramp_requests must be >= 1 (got {ramp_requests})")
        self.free_tokens = int(free_tokens)
        self.ramp_requests = int(ramp_requests)
        self.prior = (float(fixed), float(per_request), float(per_token), float(per_drafting_request))
        self._prior_basis = (float(fixed), float(per_request) + float(per_token), float(per_token),
                             float(per_drafting_request))
        self.prior_steps = float(prior_steps)
        self.decay = float(decay)
        self.warmup = int(warmup)
        self.z = float(z)
        self.explore = int(explore)
        self.drafted_steps_fitted = 0
        # Weighted sums of x x^T, x y and y^2 over fitted steps, x = (1, R, D, N); decayed count.
        self._xx = [[0.0] * _K for _ in range(_K)]
        self._xy = [0.0] * _K
        self._yy = 0.0
        self._count = 0.0
        self._seen = [0, 0]  # steps seen without / with drafts (warm-up)
        self.num_observed = 0
        self._rel_err = 0.0
        self._coef: Optional[tuple[float, float, float, float]] = self.prior
        self._plan: Optional[tuple[float, float, float, float]] = self.prior

    def observe_step(self, num_requests: int, num_scored_tokens: int, seconds: float,
                     num_drafting_requests: Optional[int] = None) -> None:
        """One engine step's measured duration (forward + sampling + scheduling). Without
        ``num_drafting_requests``, every row is taken to draft while drafts last."""
        if num_requests <= 0 or num_scored_tokens < num_requests or not (seconds > 0 and math.isfinite(seconds)):
            return
        drafts = num_scored_tokens - num_requests
        n_draft = _drafting_requests(num_requests, drafts, num_drafting_requests)
        drafted = int(drafts > 0)
        charged = self.charged(num_requests, drafts)
        self._seen[drafted] += 1
        if self._seen[drafted] <= self.warmup:
            return
        # Relative errors (weight 1/seconds^2): interference from other processes stretches
        # steps multiplicatively, and a stretched step then counts for less. (Clipping steps
        # to a band around the prediction was tried: a fit that had drifted kept itself there.)
        w = 1.0 / (seconds * seconds)
        x = (1.0, float(num_requests), float(charged), float(n_draft))
        d = self.decay
        for i in range(_K):
            self._xy[i] = d * self._xy[i] + w * x[i] * seconds
            row = self._xx[i]
            for j in range(_K):
                row[j] = d * row[j] + w * x[i] * x[j]
        self._yy = d * self._yy + 1.0  # w * seconds^2
        self._count = d * self._count + 1.0
        self.num_observed += 1
        self.drafted_steps_fitted += drafted
        self._coef = self._plan = None

    @property
    def exploring(self) -> bool:
        """Fewer than ``explore`` drafted steps fitted: what drafting costs is not known yet."""
        return self.drafted_steps_fitted < self.explore

    @property
    def coef(self) -> tuple[float, float, float, float]:
        """(fixed, per_request, per_token, per_drafting_request) in seconds, non-negative:
        the fitted costs."""
        if self._coef is None:
            self._fit()
        return self._coef

    @property
    def planning_coef(self) -> tuple[float, float, float, float]:
        """The costs to plan drafts with: the drafting costs optimistic by their uncertainty
        (see the class docstring); the same as ``coef`` for the prior."""
        if self._plan is None:
            self._fit()
        return self._plan

    def _fit(self) -> None:
        if self._count <= 0:
            self._coef = self._plan = self.prior
            return
        # Ridge weighing like ``prior_steps`` fitted steps of the typical shape (mean weight x
        # mean square of the column, at least one unit): the fixed and per-row costs towards
        # the prior's, the drafting costs towards the prior's *ratio* to the fitted per-row
        # cost (a draft token costing ~1/4 of a row holds for a 135M model on a CPU and a 7B
        # on a GPU alike; the prior's milliseconds do not).
        cnt = self._count
        mean_w = self._xx[0][0] / cnt
        lam = [self.prior_steps * max(mean_w, self._xx[i][i] / cnt) for i in range(_K)]
        a = [[self._xx[i][j] for j in range(_K)] for i in range(_K)]
        b = [self._xy[i] for i in range(_K)]
        for i in (0, 1):
            a[i][i] += lam[i]
            b[i] += lam[i] * self._prior_basis[i]
        row = self._prior_basis[1]
        for i in (2, 3):
            # lam * (beta_i - rho * beta_row)^2
            rho = self._prior_basis[i] / row if row > 0 else 0.0
            a[i][i] += lam[i]
            a[i][1] -= lam[i] * rho
            a[1][i] -= lam[i] * rho
            a[1][1] += lam[i] * rho * rho
        beta = _solve(a, b)
        if beta is None:
            self._coef = self._plan = self.prior
            return
        fixed, per_row, per_tok, per_drow = beta
        # Negative coefficients are fitting artefacts: clamp, and keep the draft-token cost
        # strictly positive so drafting is never free.
        prior_tok_per_row = self.prior[2] / max(self._prior_basis[1], 1e-12)
        floor = 1e-3 * prior_tok_per_row * max(per_row, 0.0)
        per_tok = max(per_tok, floor, 1e-9)
        per_drow = max(per_drow, 0.0)
        self._coef = (max(0.0, fixed), max(0.0, per_row - per_tok), per_tok, per_drow)
        # Standard errors of the drafting costs: relative residual variance (weights are
        # 1/seconds^2) times the diagonal of the inverse normal matrix. 25% until the
        # residuals say; never under 5% (the prior's own uncertainty: steps of one shape
        # fitting exactly say nothing about what drafting costs).
        xx, xy = self._xx, self._xy
        rss = self._yy - 2.0 * sum(beta[i] * xy[i] for i in range(_K)) \
            + sum(beta[i] * xx[i][j] * beta[j] for i in range(_K) for j in range(_K))
        dof = cnt - _K
        self._rel_err = math.sqrt(max(rss, 0.0) / dof) if dof > 0 else 0.0
        var = max(rss / dof, 0.05 ** 2) if dof >= 2.0 else 0.25 ** 2
        plan = []
        for col, c in ((2, per_tok), (3, per_drow)):
            e = [0.0] * _K
            e[col] = 1.0
            inv = _solve(a, e)
            se = math.sqrt(var * max(inv[col], 0.0)) if inv is not None else 0.0
            p_c = max(0.5 * c, c - self.z * se)
            if self.exploring:
                p_c = min(p_c, self._prior_basis[col] / row * max(per_row, 0.0) if row > 0 else p_c)
            plan.append(p_c)
        self._plan = (self._coef[0], max(0.0, per_row - plan[0]), plan[0], plan[1])

    @property
    def relative_error(self) -> float:
        """Relative rms error of the fitted step times (0 while the prior stands)."""
        if self._count <= _K + 2:
            return 0.0
        if self._plan is None:
            self._fit()
        return self._rel_err

    def hurdle(self, floor: float) -> float:
        """How much better than drafting nothing a plan must be predicted to be: the fit's own
        relative error (at least ``floor``), once drafting has been measured. While exploring
        the error is the host's scatter, not the drafts', and a hurdle would stop the drafting
        that measures it."""
        return 0.0 if self.exploring else max(floor, self.relative_error)

    def charged(self, num_requests: int, draft_tokens: int) -> float:
        """Draft tokens a step of ``num_requests`` rows pays for, in full-price tokens: those
        beyond ``free_tokens`` scored tokens, each at ``draft_scale`` of the per-token cost."""
        return charged_drafts(num_requests, draft_tokens, self.free_tokens) * self.draft_scale(num_requests)

    def draft_scale(self, num_requests: int) -> float:
        """Share of the per-token cost a draft token costs in a step of ``num_requests`` rows
        (``draft_price_scale``)."""
        return draft_price_scale(num_requests, self.ramp_requests)

    def plan_prices(self, num_requests: int) -> tuple[float, float, float]:
        """What plans for a step of ``num_requests`` rows are priced at (``planning_coef``):
        the step's seconds without drafts, a draft token's and a drafting row's."""
        fixed, per_req, per_tok, per_drow = self.planning_coef
        return fixed + (per_req + per_tok) * num_requests, per_tok * self.draft_scale(num_requests), per_drow

    def free_drafts(self, num_requests: int) -> int:
        """Draft tokens a step of ``num_requests`` rows scores at no charge."""
        return max(0, self.free_tokens - num_requests)

    def predict(self, num_requests: int, num_scored_tokens: int, num_drafting_requests: Optional[int] = None) -> float:
        f, r, t, dr = self.coef
        drafts = num_scored_tokens - num_requests
        n = _drafting_requests(num_requests, drafts, num_drafting_requests)
        return f + (r + t) * num_requests + t * self.charged(num_requests, drafts) + dr * n

    def state(self) -> dict:
        f, r, t, dr = self.coef
        p = self.planning_coef
        return {"fixed_s": f, "per_request_s": r, "per_token_s": t, "per_drafting_request_s": dr,
                "planning_per_token_s": p[2], "planning_per_drafting_request_s": p[3],
                "observed_steps": self.num_observed, "drafted_steps_fitted": self.drafted_steps_fitted,
                "exploring": self.exploring}


_K = 4  # columns of the step-cost fit: 1, R, D, N


def charged_drafts(num_requests: int, draft_tokens: int, free_tokens: int) -> int:
    """Draft tokens a step of ``num_requests`` rows pays for when its first ``free_tokens``
    scored tokens cost no more than one."""
    return max(0, num_requests + draft_tokens - free_tokens) - max(0, num_requests - free_tokens)


def draft_price_scale(num_requests: int, ramp_requests: int) -> float:
    """Share of the per-token cost a draft token costs in a step of ``num_requests`` rows:
    rising in proportion to the rows up to ``ramp_requests`` (on a 2-core CPU a draft token
    costs ~0.9 ms at 1 request, ~1.4 ms at 2 and ~3.3 ms from 4 on, whatever the draft
    count: it is not the step's token count that sets the price)."""
    return min(1.0, num_requests / ramp_requests) if num_requests > 0 else 1.0


def _drafting_requests(num_requests: int, drafts: int, given: Optional[int]) -> int:
    """Requests that drafted: as given (at most one per request and per draft token), or,
    not given, as many as the drafts could have come from."""
    bound = max(0, min(num_requests, drafts))
    return bound if given is None else max(0, min(bound, int(given)))


def _solve(a: list[list[float]], b: list[float]) -> Optional[list[float]]:
    """Gaussian elimination with partial pivoting (4x4; avoids a NumPy call per step)."""
    n = len(b)
    m = [row[:] + [bb] for row, bb in zip(a, b)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


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
        self._forecast = [0.0, 0.0]  # accepted tokens, and what the model forecast for them
        self._src: dict[str, list[list[float]]] = {}  # source -> per depth [accepted, q mass]
        self._rates: dict[str, list[float]] = {}  # cache of source_rates
        self._req: dict[str, list[float]] = {}  # request -> [accepted, expected]

    def source_rates(self, source: str, n: int) -> list[float]:
        """Multipliers a_src[0..n-1] (the cached list may hold more)."""
        rates = self._rates.get(source)
        if rates is not None and len(rates) >= n:
            return rates
        # Each depth's rate needs only the shallower ones: extend the cached prefix to the
        # depth asked for. Every verified draft invalidates the cache, and drafts ask for a
        # few depths while the table holds up to MAX_DEPTH: this runs per request per step.
        if rates is None:
            rates = self._rates[source] = []
        table = self._src.get(source, ())
        prev = rates[-1] if rates else self.prior
        w = self.prior_weight
        for i in range(len(rates), max(n, 1)):
            acc, mass = table[i] if i < len(table) else (0.0, 0.0)
            prev = (acc + w * prev) / (mass + w)
            rates.append(prev)
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
        f = self.request_factor(req)
        # source_rates returns at least n multipliers; this runs per request per engine step.
        return [x if (x := f * a * q) < 1.0 else 1.0 for a, q in zip(self.source_rates(source, n), cond_probs)]

    def expected_accepted(self, req: str, source: str, cond_probs: Sequence[float]) -> tuple[float, list[float]]:
        """(expected accepted tokens, ``survival``) of one chain."""
        surv = self.survival(req, source, cond_probs)
        e, p = 0.0, 1.0
        for a in surv:
            p *= a
            e += p
        return e, surv

    def bound(self, req: str, source: str, n: int) -> float:
        """Most expected accepted tokens any chain of n tokens from ``source`` can have (q = 1):
        ``expected_accepted`` of n certain tokens, without building their lists (it runs per
        request and source every engine step)."""
        f = self.request_factor(req)
        rates = self.source_rates(source, n)
        e, p = 0.0, 1.0
        for i in range(n):
            x = f * rates[i]
            p *= x if x < 1.0 else 1.0
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
        self._forecast[0] += min(accepted, tried)
        self._forecast[1] += expected
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

    def carry(self, weight: float) -> None:
        """A new rollout: the per-source evidence learnt so far counts ``weight`` times (0: the
        prior stands again, 1: all of it stays); requests and the forecast start afresh."""
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"acceptance carry weight must be in [0, 1] (got {weight})")
        if weight == 0.0:
            self._src.clear()
        else:
            for table in self._src.values():
                for row in table:
                    row[0] *= weight
                    row[1] *= weight
        self._rates.clear()
        self._req.clear()
        self._forecast = [0.0, 0.0]

    def state_dict(self) -> dict:
        """The per-source evidence (what ``carry`` keeps), JSON-safe."""
        return {"sources": {src: [list(row) for row in table] for src, table in self._src.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._src = {str(src): [[float(a), float(m)] for a, m in table] for src, table in state["sources"].items()}
        self._rates.clear()

    def accepted_over_forecast(self) -> float:
        """Tokens accepted / the model's forecast for the positions verified (0 before any):
        how far the plan's expectations are from the outcomes. The plan drafts where its
        forecasts are high, so there they tend to run high."""
        return self._forecast[0] / self._forecast[1] if self._forecast[1] > 0 else 0.0

    def state(self) -> dict:
        return {"acceptance_vs_forecast": round(self.accepted_over_forecast(), 4),
                **{f"acceptance_multiplier/{s}": round(self.source_rate(s), 4) for s in sorted(self._src)}}


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
              min_gain: float = 0.0, hurdle: float = 0.0) -> StepPlan:
    """Draft length per request (index-aligned with ``survival``) maximising E / T.

    ``survival[r]`` are request r's per-position acceptance probabilities (given the
    position is reached), ``caps[r]`` the most tokens it may draft (engine room,
    predicted remaining length). Requests with nothing to draft still count: every row
    of the step emits one token and costs a scored token.
    """
    n = len(survival)
    t0, per_tok, per_drow = cost.plan_prices(n)
    e0 = float(n)
    if n == 0 or not t0 > 0:
        return StepPlan([0] * n, e0, t0)
    chains: list[list[float]] = []  # per request, the gains of its draft positions (non-increasing)
    for r, surv in enumerate(survival):
        cap = len(surv) if caps is None else max(0, min(len(surv), caps[r]))
        gains: list[float] = []
        p = 1.0
        for k in range(cap):
            p *= surv[k]
            if p <= min_gain or p <= 0.0:
                break
            gains.append(p)
        chains.append(gains)
    # The free tokens go to the draft positions that gain most, whatever the goodput: per
    # request, how many of its first positions are among them (gains never rise along a
    # chain, so the best positions overall are a prefix of every chain).
    free = [0] * n
    nfree = cost.free_drafts(n)
    if nfree:
        best = sorted(((-g, r, k) for r, gains in enumerate(chains) for k, g in enumerate(gains)))[:nfree]
        for _, r, k in best:
            free[r] = max(free[r], k + 1)
    # Dinkelbach on the ratio: for the goodput lam of the current plan, maximise E - lam * T;
    # requests are then independent (a request drafts its free tokens and the tokens whose
    # gain exceeds lam * per_token, if together they also pay for its drafting-row cost);
    # repeat with the new plan's goodput until it stops rising. Starts from no drafts at all,
    # and a plan must beat no drafts by the relative ``hurdle`` (the models' own error) to count.
    lengths, e, t = [0] * n, e0, t0
    for it in range(32):
        lam = e / t * ((1.0 + max(0.0, hurdle)) if it == 0 else 1.0)
        new, ne, nt = [0] * n, e0, t0
        for r, gains in enumerate(chains):
            k, got = 0, 0.0
            for g in gains:
                if k >= free[r] and g <= lam * per_tok:
                    break
                k += 1
                got += g
            paid = k - free[r] if k > free[r] else 0
            if k and got - lam * (per_drow + per_tok * paid) > 0.0:
                new[r] = k
                ne += got
                nt += per_drow + per_tok * paid
        if ne <= lam * nt * (1.0 + 1e-12):
            break
        lengths, e, t = new, ne, nt
    return StepPlan(lengths, e, t)


def draft_can_pay(factor: float, rates: Sequence[float], cap: int, lam: float, per_tok: float, per_drow: float,
                  evaluation_s: float = 0.0, free: int = 0) -> bool:
    """Whether any draft of at most ``cap`` tokens for one request could enter a plan whose
    goodput is at least ``lam`` and also pay ``evaluation_s`` (what finding its chain costs).

    The bound takes every history probability as 1: the acceptance ``min(1, factor * a_i)``
    is then the most any chain can have (``AcceptanceTracker.survival`` with q = 1). A
    draft enters a plan at goodput ``lam`` only if its gains beat ``lam`` times its costs
    (``plan_step``), and every plan's goodput is at least that of drafting nothing, so with
    ``lam`` that of drafting nothing and ``evaluation_s`` = 0 a False here means the plan
    gives this request no draft whatever its chain: skipping the chain's search changes
    nothing but the time spent. ``free``: draft tokens the step scores at no charge (this
    request could have them all).
    """
    # As in plan_step: the tokens whose gain beats their price, then the drafting row's price.
    # Gains never rise along a chain, so the net only grows until the first token that does
    # not pay, and no later token pays either.
    p, net = 1.0, -lam * per_drow
    tok = lam * per_tok
    for i, a in enumerate(rates[:cap]):
        x = factor * a
        p *= x if x < 1.0 else 1.0
        price = 0.0 if i < free else tok
        if p <= price or p <= 0.0:
            break
        net += p - price
    return net > lam * evaluation_s


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
