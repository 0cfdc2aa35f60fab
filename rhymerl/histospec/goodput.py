"""Cost-aware draft lengths: per engine step, maximise expected emitted tokens per second (pure Python)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence


class StepCostModel:
    """Online ridge fit of seconds = fixed + per_request * R + per_token * T + per_drafting_request * N.
    Guards against pricing drafting out for good: ``warmup`` steps unfitted, optimistic plan costs (``z``
    standard errors less), capped at the prior's ratio while ``exploring``."""

    def __init__(self, fixed: float, per_request: float, per_token: float, per_drafting_request: float = 0.0,
                 prior_steps: float = 1.0, decay: float = 0.999, warmup: int = 2, z: float = 1.0, explore: int = 16):
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
        """One engine step's measured duration. Without ``num_drafting_requests`` every row drafts while drafts last."""
        if num_requests <= 0 or num_scored_tokens < num_requests or not (seconds > 0 and math.isfinite(seconds)):
            return
        drafts = num_scored_tokens - num_requests
        n_draft = _drafting_requests(num_requests, drafts, num_drafting_requests)
        drafted = int(drafts > 0)
        self._seen[drafted] += 1
        if self._seen[drafted] <= self.warmup:
            return
        # Relative errors (weight 1/seconds^2): interference stretches steps multiplicatively.
        w = 1.0 / (seconds * seconds)
        x = (1.0, float(num_requests), float(drafts), float(n_draft))
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
        """The fitted (fixed, per_request, per_token, per_drafting_request) in seconds, non-negative."""
        if self._coef is None:
            self._fit()
        return self._coef

    @property
    def planning_coef(self) -> tuple[float, float, float, float]:
        """The costs to plan with: drafting costs optimistic by their uncertainty."""
        if self._plan is None:
            self._fit()
        return self._plan

    def _fit(self) -> None:
        if self._count <= 0:
            self._coef = self._plan = self.prior
            return
        # Ridge towards the prior; drafting costs towards its *ratio* to the per-row cost (device-independent).
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
            rho = self._prior_basis[i] / row if row > 0 else 0.0  # lam * (beta_i - rho * beta_row)^2
            a[i][i] += lam[i]
            a[i][1] -= lam[i] * rho
            a[1][i] -= lam[i] * rho
            a[1][1] += lam[i] * rho * rho
        beta = _solve(a, b)
        if beta is None:
            self._coef = self._plan = self.prior
            return
        fixed, per_row, per_tok, per_drow = beta
        # Clamp fitting artefacts; drafting is never free.
        prior_tok_per_row = self.prior[2] / max(self._prior_basis[1], 1e-12)
        floor = 1e-3 * prior_tok_per_row * max(per_row, 0.0)
        per_tok = max(per_tok, floor, 1e-9)
        per_drow = max(per_drow, 0.0)
        self._coef = (max(0.0, fixed), max(0.0, per_row - per_tok), per_tok, per_drow)
        # Drafting costs' standard errors, at least 5%: an exact fit of one step shape says nothing of drafts.
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
        """The relative gain a plan must predict: the fit's error (>= ``floor``); 0 while exploring."""
        return 0.0 if self.exploring else max(floor, self.relative_error)

    def plan_prices(self, num_requests: int) -> tuple[float, float, float]:
        """(seconds without drafts, per draft token, per drafting row) at ``planning_coef``."""
        fixed, per_req, per_tok, per_drow = self.planning_coef
        return fixed + (per_req + per_tok) * num_requests, per_tok, per_drow

    def predict(self, num_requests: int, num_scored_tokens: int, num_drafting_requests: Optional[int] = None) -> float:
        f, r, t, dr = self.coef
        drafts = num_scored_tokens - num_requests
        n = _drafting_requests(num_requests, drafts, num_drafting_requests)
        return f + (r + t) * num_requests + t * drafts + dr * n

    def state(self) -> dict:
        f, r, t, dr = self.coef
        p = self.planning_coef
        return {"fixed_s": f, "per_request_s": r, "per_token_s": t, "per_drafting_request_s": dr,
                "planning_per_token_s": p[2], "planning_per_drafting_request_s": p[3],
                "observed_steps": self.num_observed, "drafted_steps_fitted": self.drafted_steps_fitted,
                "exploring": self.exploring}


_K = 4  # columns of the step-cost fit: 1, R, D, N


def _drafting_requests(num_requests: int, drafts: int, given: Optional[int]) -> int:
    """Requests that drafted: as given (bounded), else as many as the drafts could have come from."""
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
    """P(accept position i | reached) = min(1, x_i * m(x_i)), x_i = f_req * a_src[i] * q_i: per-source per-depth
    rates, the request's record so far, and a correction per tenth of x itself, all learnt online. Correcting by
    the prediction's own bucket keeps every bucket calibrated: the largest x are the noisiest estimates."""

    MAX_DEPTH = 64
    # Tenths of x up to 2, the last holding every larger x: above 1 a larger x still means likelier.
    Q_BUCKETS = 20
    Q_PER_UNIT = 10

    def __init__(self, prior: float = 0.5, prior_weight: float = 4.0, request_weight: float = 4.0,
                 q_weight: float = 20.0):
        if not 0.0 < prior <= 1.0:
            raise ValueError(f"acceptance prior must be in (0, 1] (got {prior})")
        if prior_weight <= 0 or request_weight <= 0 or q_weight <= 0:
            raise ValueError("acceptance prior weights must be > 0")
        self.prior = prior
        self.prior_weight = prior_weight
        self.request_weight = request_weight
        self.q_weight = q_weight
        # Per source and bucket of x: [accepted, x] over the positions tried.
        self._q: dict[str, list[list[float]]] = {}
        self._qmul: dict[str, tuple[list[float], list[float]]] = {}  # cache of _multipliers
        self._forecast = [0.0, 0.0]  # accepted tokens, and what the model forecast for them
        self._src: dict[str, list[list[float]]] = {}  # source -> per depth [accepted, q mass]
        self._rates: dict[str, list[float]] = {}  # cache of source_rates
        self._req: dict[str, list[float]] = {}  # request -> [accepted, expected]

    def source_rates(self, source: str, n: int) -> list[float]:
        """Multipliers a_src[0..n-1] (the cached list may hold more)."""
        rates = self._rates.get(source)
        if rates is not None and len(rates) >= n:
            return rates
        # Extend the cached prefix only to the depth asked for: this runs per request per step.
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

    def q_multipliers(self, source: str) -> list[float]:
        """A source's m per bucket of x."""
        return self._multipliers(source)[0]

    def _multipliers(self, source: str) -> tuple[list[float], list[float]]:
        """(m per bucket of x, and per bucket b the most x m(x) reaches below it: max over b' < b of hi_b' m_b')."""
        got = self._qmul.get(source)
        if got is None:
            w, nb = self.q_weight, self.Q_BUCKETS
            table = self._q.get(source)
            m = [1.0] * nb if table is None else [(acc + w) / (pred + w) for acc, pred in table]
            below, top = [0.0] * nb, 0.0
            for b in range(nb):
                below[b] = top
                top = max(top, (b + 1) / self.Q_PER_UNIT * m[b])
            got = self._qmul[source] = (m, below)
        return got

    def rate_bounds(self, req: str, source: str, n: int) -> list[float]:
        """Per position, the most ``survival`` can be for any chain from ``source`` (q <= 1, so x <= f_req a_src)."""
        f = self.request_factor(req)
        m, below = self._multipliers(source)
        nb, top = self.Q_PER_UNIT, self.Q_BUCKETS - 1
        out = []
        for a in self.source_rates(source, n)[:n]:
            x = f * a
            b = int(x * nb)
            if b > top:
                b = top
            # Any x' <= x: in x's bucket at most x m_b, in a bucket below at most that bucket's top.
            p = x * m[b]
            if below[b] > p:
                p = below[b]
            out.append(p if p < 1.0 else 1.0)
        return out

    def survival(self, req: str, source: str, cond_probs: Sequence[float]) -> list[float]:
        """Per-position acceptance probabilities given the position is reached."""
        n = len(cond_probs)
        if n == 0:
            return []
        f = self.request_factor(req)
        m, nb, top = self._multipliers(source)[0], self.Q_PER_UNIT, self.Q_BUCKETS - 1
        # source_rates returns at least n multipliers; this runs per request per engine step.
        out = []
        for a, q in zip(self.source_rates(source, n), cond_probs):
            x = f * a * q
            p = x * m[b if (b := int(x * nb)) < top else top]
            out.append(p if p < 1.0 else 1.0)
        return out

    def expected_accepted(self, req: str, source: str, cond_probs: Sequence[float]) -> tuple[float, list[float]]:
        """(expected accepted tokens, ``survival``) of one chain."""
        surv = self.survival(req, source, cond_probs)
        e, p = 0.0, 1.0
        for a in surv:
            p *= a
            e += p
        return e, surv

    def bound(self, req: str, source: str, n: int) -> float:
        """Most expected accepted tokens any chain of n tokens from ``source`` can have."""
        e, p = 0.0, 1.0
        for x in self.rate_bounds(req, source, n):
            p *= x
            e += p
        return e

    def observe(self, req: str, source: str, cond_probs: Sequence[float], accepted: int,
                forecast: bool = True) -> None:
        """A verified draft: its first ``accepted`` tokens were accepted (``forecast``: it was drafted)."""
        n = len(cond_probs)
        if n == 0:
            return
        accepted = max(0, min(accepted, n))
        tried = min(n, accepted + 1, self.MAX_DEPTH)
        who = req if req in self._req else ""
        expected = sum(self.survival(who, source, cond_probs[:tried]))
        if forecast:
            self._forecast[0] += min(accepted, tried)
            self._forecast[1] += expected
        # What the model without m predicted (x), per bucket of x, against what was accepted.
        f, rates, nb, top = self.request_factor(who), self.source_rates(source, tried), self.Q_PER_UNIT, self.Q_BUCKETS - 1
        qtable = self._q.setdefault(source, [[0.0, 0.0] for _ in range(self.Q_BUCKETS)])
        for i in range(tried):
            x = f * rates[i] * float(cond_probs[i])
            row = qtable[b if (b := int(x * nb)) < top else top]
            row[0] += 1.0 if i < accepted else 0.0
            row[1] += x
        self._qmul.pop(source, None)
        if forecast:  # per-depth source rates learn from drafted chains only
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
        """A new rollout: the evidence so far counts ``weight`` times (0: prior again, 1: all kept)."""
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"acceptance carry weight must be in [0, 1] (got {weight})")
        if weight == 0.0:
            self._src.clear()
            self._q.clear()
        for table in [*self._src.values(), *self._q.values()]:
            for row in table:
                row[0] *= weight
                row[1] *= weight
        self._rates.clear()
        self._qmul.clear()
        self._req.clear()
        self._forecast = [0.0, 0.0]

    def state_dict(self) -> dict:
        """The evidence (what ``carry`` keeps), JSON-safe."""
        return {"sources": {src: [list(row) for row in table] for src, table in self._src.items()},
                "q": {src: [list(row) for row in table] for src, table in self._q.items()}}

    def load_state_dict(self, state: dict) -> None:
        """``state_dict``'s, or an earlier version's (its m, by other buckets or none, starts from 1)."""
        self._src = {str(src): [[float(a), float(m)] for a, m in table] for src, table in state["sources"].items()}
        self._q = {str(src): [[float(a), float(p)] for a, p in table] for src, table in state.get("q", {}).items()
                   if len(table) == self.Q_BUCKETS}
        self._rates.clear()
        self._qmul.clear()

    def accepted_over_forecast(self) -> float:
        """Tokens accepted / the model's forecast for the positions verified (0 before any)."""
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
              hurdle: float = 0.0) -> StepPlan:
    """Draft length per request maximising E / T (``survival[r]``: per-position acceptance once reached)."""
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
            if p <= 0.0:
                break
            gains.append(p)
        chains.append(gains)
    # Dinkelbach: maximise E - lam * T (requests separate) until lam stops rising; first beat ``hurdle``.
    lengths, e, t = [0] * n, e0, t0
    for it in range(32):
        lam = e / t * ((1.0 + max(0.0, hurdle)) if it == 0 else 1.0)
        new, ne, nt = [0] * n, e0, t0
        for r, gains in enumerate(chains):
            k, got = 0, 0.0
            for g in gains:
                if g <= lam * per_tok:
                    break
                k += 1
                got += g
            if k and got - lam * (per_drow + per_tok * k) > 0.0:
                new[r] = k
                ne += got
                nt += per_drow + per_tok * k
        if ne <= lam * nt * (1.0 + 1e-12):
            break
        lengths, e, t = new, ne, nt
    return StepPlan(lengths, e, t)


def draft_can_pay(rate_bounds: Sequence[float], lam: float, per_tok: float, per_drow: float,
                  evaluation_s: float = 0.0) -> bool:
    """Whether any draft whose per-position acceptance is at most ``rate_bounds`` could pay ``evaluation_s`` at
    goodput >= ``lam`` (an upper bound)."""
    # Gains never rise along a chain: stop at the first token that does not pay.
    p, net = 1.0, -lam * per_drow
    tok = lam * per_tok
    for x in rate_bounds:
        p *= x
        if p <= tok or p <= 0.0:
            break
        net += p - tok
    return net > lam * evaluation_s


def remaining_cap(generated: int, predicted_len: Optional[float], margin: float) -> Optional[int]:
    """Most draft tokens worth proposing before ``predicted_len`` x ``margin``; None without one or past it."""
    if predicted_len is None or not predicted_len > 0 or not margin > 0:
        return None
    horizon = margin * predicted_len - generated
    if horizon <= 0:
        return None
    # The last token of a response is sampled, never drafted usefully past the end.
    return max(0, int(math.ceil(horizon)) - 1)
