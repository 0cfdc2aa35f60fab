"""Calibration of the decode cost model: its JSON file, and ``StepCostFit``, the refit from engine steps."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Optional

import numpy as np

from rhymerl.outputs.atomic import atomic_write_text
from rhymerl.histopipe.cost import DecodeCostModel

DEFAULT = Path(__file__).with_name("data") / "h100x4-32b-roofline.json"


def load(path: Optional[str | Path] = None) -> tuple[DecodeCostModel, str, dict]:
    """(cost model, its source, the whole file)."""
    path = Path(path) if path is not None else DEFAULT
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"calibration file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"calibration file {path}: not JSON ({e})") from None
    c = d.get("cost")
    if not isinstance(c, dict) or not isinstance(d.get("source"), str):
        raise ValueError(f"calibration file {path}: needs a 'source' string and a 'cost' object")
    try:
        cost = DecodeCostModel(a=float(c["a"]), b=float(c["b"]), c=float(c["c"]), p=float(c["p"]),
                               max_batch=int(c["max_batch"]), kv_capacity=int(c["kv_capacity"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"calibration file {path}: cost field missing or ill-typed ({e})") from None
    if min(cost.a, cost.b, cost.c, cost.p) < 0 or cost.a <= 0 or cost.max_batch < 1 or cost.kv_capacity < 1:
        raise ValueError(f"calibration file {path}: a must be > 0, b, c, p >= 0, max_batch and kv_capacity >= 1")
    return cost, d["source"], d


def save(path: str | Path, cost: DecodeCostModel, source: str, extra: Optional[dict] = None) -> None:
    atomic_write_text(Path(path), json.dumps({"source": source, "cost": cost.to_dict(), **(extra or {})}, indent=1) + "\n")


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| over x >= 0, for a few columns. The optimum is the least-squares solution
    on its own support, so the best non-negative one over every subset of columns is exact;
    dropping whichever term fits negative first is not (a wrong drop can shift the rest)."""
    n = a.shape[1]
    best, best_res = np.zeros(n), float(b @ b)
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sol = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if (sol < 0).any():
                continue
            x = np.zeros(n)
            x[list(cols)] = sol
            res = float(np.sum((a @ x - b) ** 2))
            if res < best_res:
                best, best_res = x, res
    return best


class StepCostFit:
    """Least-squares fit of step_time = a + b*B + c*K + p*F (F: tokens prefilled in the step)."""

    def __init__(self, prior: DecodeCostModel, max_samples: int = 4096):
        self.prior = prior
        self.rows: list[tuple[float, float, float, float]] = []
        self.max_samples = max_samples

    def add(self, batch: int, context_tokens: int, seconds: float, prefill_tokens: int = 0) -> None:
        if batch > 0 and seconds > 0:
            self.rows.append((float(batch), float(context_tokens), float(prefill_tokens), float(seconds)))
            if len(self.rows) > self.max_samples:
                del self.rows[: len(self.rows) - self.max_samples]

    def fit(self) -> DecodeCostModel:
        """The prior until enough batch sizes are seen; then every cost >= 0 (a negative one would
        price a longer step below a shorter one)."""
        if len(self.rows) < 8 or len({r[0] for r in self.rows}) < 3:
            return self.prior
        A = np.array([[1.0, r[0], r[1], r[2]] for r in self.rows])
        y = np.array([r[3] for r in self.rows])
        cols = [0, 1, 2, 3] if A[:, 3].any() else [0, 1, 2]
        full = dict(zip(cols, nonnegative_lstsq(A[:, cols], y)))
        # A prefill cost the steps cannot tell from zero keeps the prior's: a free re-prefill
        # would make every move between instances look free.
        p = float(full.get(3, 0.0)) or self.prior.p
        return DecodeCostModel(a=max(float(full.get(0, 0.0)), 1e-6), b=float(full.get(1, 0.0)),
                               c=float(full.get(2, 0.0)), p=p,
                               max_batch=self.prior.max_batch, kv_capacity=self.prior.kv_capacity)
