"""Per-prompt length predictor: log_pred = prior + beta * (hist - prior) + drift, all learnt online."""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Optional, Sequence

from rhymerl.config import HistoPipeConfig

# Pseudo-observations behind the initial beta estimate (history trusted fully before any evidence).
_BETA_PRIOR_WEIGHT = 4.0
_MIN_BETA = 0.1
_EMA = 0.02  # weight of one group in the running prior / drift estimates


def _log_mean(lengths: Sequence[int]) -> float:
    return sum(math.log(max(1, x)) for x in lengths) / len(lengths)


class LengthPredictor:
    def __init__(self, cfg: HistoPipeConfig, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not 0.0 < cfg.decay <= 1.0:
            raise ValueError(f"histopipe.decay must be in (0, 1], got {cfg.decay}")
        self.cfg = cfg
        self.max_tokens = max_tokens
        # A quarter of the budget before anything is observed (over-estimating is the safe side).
        self.prior_log = math.log(max(1.0, max_tokens / 4))
        self.prior_n = 0
        self.drift = 0.0
        # Running sums for beta = cov(x, y) / var(x), x = hist - prior, y = actual - prior.
        self.sxx = _BETA_PRIOR_WEIGHT
        self.sxy = _BETA_PRIOR_WEIGHT
        self.syy = _BETA_PRIOR_WEIGHT
        self.fit_n = 0
        self._pending: dict[int, float] = {}  # key -> (hist - prior) at predict time
        self._pending_pred: dict[int, tuple[float, float]] = {}  # key -> (log-mean, mean) predicted
        # Within-group variance of log length: turns a predicted log-mean into a mean and quantiles.
        self.within_var = 0.25
        # Error accounting (groups with history only): |pred - mean actual| / mean actual.
        self.err_n = 0
        self.err_abs_rel = 0.0
        self.err_log_sq = 0.0

    @property
    def beta(self) -> float:
        """How much history is trusted: 0 unless the slope's 2-sigma lower bound exceeds _MIN_BETA."""
        if self.sxx <= 0:
            return 0.0
        beta = self.sxy / self.sxx
        if self.fit_n >= 2:
            resid = max(0.0, self.syy - beta * self.sxy) / max(1, self.fit_n - 1)
            se = math.sqrt(resid / self.sxx)
            if beta - 2.0 * se < _MIN_BETA:
                return 0.0
        return min(1.0, max(0.0, beta))

    def history_log_mean(self, history_lengths: Optional[list[list[int]]]) -> Optional[float]:
        if not history_lengths:
            return None
        num = den = 0.0
        w = 1.0
        for epoch in reversed(history_lengths):  # newest first
            if epoch:
                num += w * len(epoch) * _log_mean(epoch)
                den += w * len(epoch)
            w *= self.cfg.decay
        return num / den if den > 0 else None

    def predict_log(self, key: int, history_lengths: Optional[list[list[int]]]) -> float:
        h = self.history_log_mean(history_lengths)
        if h is None:
            self._pending.pop(key, None)
            return self.prior_log
        x = h - self.prior_log
        self._pending[key] = x
        return self.prior_log + self.beta * x + self.drift

    def predict(self, key: int, history_lengths: Optional[list[list[int]]]) -> float:
        """Per-response expected length (tokens) of ``key``'s next group."""
        lp = self.predict_log(key, history_lengths)
        pred = min(float(self.max_tokens), max(1.0, math.exp(lp + 0.5 * self.within_var)))
        if key in self._pending:
            self._pending_pred[key] = (lp, pred)
        return pred

    def predict_quantile(self, key: int, history_lengths: Optional[list[list[int]]], q: float) -> float:
        """``q``-quantile of one response's length (lognormal around the predicted log-mean)."""
        if not 0.0 < q < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {q}")
        lp = self.predict_log(key, history_lengths)
        z = NormalDist().inv_cdf(q)
        return min(float(self.max_tokens), max(1.0, math.exp(lp + z * math.sqrt(self.within_var))))

    def observe(self, key: int, lengths: list[int]) -> None:
        """Actual lengths of ``key``'s group this step (after the rollout)."""
        if not lengths:
            return
        y = _log_mean(lengths)
        if len(lengths) > 1:
            v = sum((math.log(max(1, t)) - y) ** 2 for t in lengths) / (len(lengths) - 1)
            self.within_var += _EMA * (v - self.within_var)
        x = self._pending.pop(key, None)
        if x is not None:
            yc = y - self.prior_log
            self.sxx += x * x
            self.sxy += x * yc
            self.syy += yc * yc
            self.fit_n += 1
            got = self._pending_pred.pop(key, None)
            if got is not None:
                lp, pred = got
                self.drift += _EMA * (y - lp)
                actual = sum(lengths) / len(lengths)
                self.err_n += 1
                self.err_abs_rel += abs(pred - actual) / max(1.0, actual)
                self.err_log_sq += (math.log(pred) - math.log(max(1.0, actual))) ** 2
        self.prior_n += 1  # Prior: running mean early on, then an EMA so it follows length drift.
        self.prior_log += max(_EMA, 1.0 / self.prior_n) * (y - self.prior_log)

    def error_report(self) -> dict:
        n = max(1, self.err_n)
        return {"groups": self.err_n, "mean_abs_rel_error": self.err_abs_rel / n,
                "rmse_log": math.sqrt(self.err_log_sq / n), "beta": self.beta,
                "prior_tokens": math.exp(self.prior_log), "drift": self.drift,
                "within_log_std": math.sqrt(self.within_var)}

    def state_dict(self) -> dict:
        return {"prior_log": self.prior_log, "prior_n": self.prior_n, "drift": self.drift,
                "sxx": self.sxx, "sxy": self.sxy, "syy": self.syy, "fit_n": self.fit_n, "err_n": self.err_n,
                "err_abs_rel": self.err_abs_rel, "err_log_sq": self.err_log_sq,
                "within_var": self.within_var, "max_tokens": self.max_tokens}

    def load_state_dict(self, d: dict) -> None:
        missing = {"prior_log", "prior_n", "drift", "sxx", "sxy"} - set(d)
        if missing:
            raise ValueError(f"LengthPredictor state is missing {sorted(missing)}")
        self.prior_log = float(d["prior_log"])
        self.prior_n = int(d["prior_n"])
        self.drift = float(d["drift"])
        self.sxx = float(d["sxx"])
        self.sxy = float(d["sxy"])
        self.syy = float(d.get("syy", _BETA_PRIOR_WEIGHT))
        self.fit_n = int(d.get("fit_n", 0))
        self.err_n = int(d.get("err_n", 0))
        self.err_abs_rel = float(d.get("err_abs_rel", 0.0))
        self.err_log_sq = float(d.get("err_log_sq", 0.0))
        self.within_var = float(d.get("within_var", 0.25))
        self._pending.clear()
        self._pending_pred.clear()
