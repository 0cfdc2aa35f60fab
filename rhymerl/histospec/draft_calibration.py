"""Is the goodput rule's acceptance model calibrated? Verified positions bucketed by predicted acceptance."""

from __future__ import annotations

import math
from typing import Sequence

BUCKETS = 10
FIELDS = ("tokens", "predicted", "accepted")
MIN_TOKENS = 200  # a bucket's realised rate is read only over at least this many positions
TARGET_GAP = 0.05  # the most a bucket's realised rate should differ from its prediction


def bucket_label(b: int) -> str:
    return f"{b / BUCKETS:.1f}"


class Calibration:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._tokens = [0] * BUCKETS
        self._predicted = [0.0] * BUCKETS
        self._accepted = [0] * BUCKETS

    def observe(self, survival: Sequence[float], accepted: int) -> None:
        """A verified draft predicted ``survival`` whose first ``accepted`` tokens were accepted."""
        for i, p in enumerate(survival[:max(0, accepted) + 1]):
            b = min(int(p * BUCKETS), BUCKETS - 1)
            self._tokens[b] += 1
            self._predicted[b] += p
            self._accepted[b] += i < accepted

    def counts(self) -> dict:
        out = {}
        for b in range(BUCKETS):
            label = bucket_label(b)
            out[f"calibration/{label}/tokens"] = self._tokens[b]
            out[f"calibration/{label}/predicted"] = self._predicted[b]
            out[f"calibration/{label}/accepted"] = self._accepted[b]
        return out


def table(counts: dict, prefix: str = "calibration/") -> list[dict]:
    """Per non-empty bucket: positions, mean prediction, realised rate, gap and the realised rate's binomial
    standard error, from ``Calibration.counts``."""
    rows = []
    for b in range(BUCKETS):
        label = bucket_label(b)
        n = counts.get(f"{prefix}{label}/tokens", 0)
        if not n:
            continue
        pred = counts[f"{prefix}{label}/predicted"] / n
        real = counts[f"{prefix}{label}/accepted"] / n
        rows.append({"bucket": f"{label}-{(b + 1) / BUCKETS:.1f}", "tokens": int(n), "predicted": round(pred, 4),
                     "realised": round(real, 4), "gap": round(real - pred, 4),
                     "standard_error": round(math.sqrt(real * (1.0 - real) / n), 4)})
    return rows


def worst_gap(counts: dict, min_tokens: int = MIN_TOKENS, prefix: str = "calibration/") -> float:
    """The largest |realised - predicted| over buckets of at least ``min_tokens`` positions (0 if none)."""
    return max((abs(r["gap"]) for r in table(counts, prefix) if r["tokens"] >= min_tokens), default=0.0)


def count_over(counts: dict, gap: float = TARGET_GAP, min_tokens: int = MIN_TOKENS,
               prefix: str = "calibration/") -> int:
    """Buckets of at least ``min_tokens`` positions whose realised rate is more than ``gap`` off."""
    return sum(abs(r["gap"]) > gap for r in table(counts, prefix) if r["tokens"] >= min_tokens)


def chance_over(counts: dict, gap: float = TARGET_GAP, min_tokens: int = MIN_TOKENS,
                prefix: str = "calibration/") -> float:
    """How many buckets of at least ``min_tokens`` positions a perfectly calibrated rule would put more than
    ``gap`` off by sampling alone (at most: each realised rate taken as binomial at its bucket's mean
    prediction, normally approximated). What ``worst_gap`` is read against: beyond it, a gap is bias."""
    out = 0.0
    for r in table(counts, prefix):
        if r["tokens"] >= min_tokens:
            p = r["predicted"]
            se = math.sqrt(max(p * (1.0 - p), 0.0) / r["tokens"])
            out += math.erfc(gap / (se * math.sqrt(2.0))) if se > 0 else 0.0
    return out
