"""The one place a rollout batch's figures are computed, whichever dispatch produced it."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from rhymerl.histospec.proposer import STAT_COUNTS, add_stat_fractions
from rhymerl.rollout.batch import InstanceReport, Sample

# Engine figures that add up over instances and over DAPO's refill rounds; ratios are recomputed.
ADDITIVE_ENGINE = ("draft_proposed", "draft_accepted", "target_forwards", "generated_tokens", "draft_time_s",
                   *STAT_COUNTS)
# Step figures that add up over DAPO's refill rounds.
ADDITIVE_PREFIXES = ("time/", "reward/errors", "reward/timeouts", "reward/workers_restarted", "rollout/responses",
                     "rollout/generated_tokens", "rollout/engine_steps/", "rollout/idle_steps/", "rollout/instance_s/",
                     "histospec/source/", "histospec/calibration/")
RATIOS = ("acceptance", "tokens_per_forward", "history_tokens_per_forward", "history_served_fraction",
          "steps_without_drafts_fraction", "searches_skipped_fraction")


def sum_engine_metrics(ms: Sequence[dict]) -> dict:
    """Instances' engine figures as one: counts summed, fractions recomputed, step costs averaged."""
    tot = {k: float(sum(m.get(k, 0) for m in ms)) for k in ADDITIVE_ENGINE}
    out = add_stat_fractions(dict(tot))
    for k in sorted({k for m in ms for k in m if k.startswith(("source/", "calibration/"))}):
        out[k] = float(sum(m.get(k, 0) for m in ms))
    for k in sorted({k for m in ms for k in m if k.startswith("step_cost/") or k == "search_us_per_request"}):
        vals = [m[k] for m in ms if k in m]
        out[k] = float(sum(vals) / len(vals))
    out["acceptance"] = tot["draft_accepted"] / tot["draft_proposed"] if tot["draft_proposed"] else 0.0
    out["tokens_per_forward"] = tot["generated_tokens"] / tot["target_forwards"] if tot["target_forwards"] else 1.0
    if "source/history/accepted" in out:
        # What the prompts' earlier responses add per forward: none in the first epoch, by construction.
        out["history_tokens_per_forward"] = (out["source/history/accepted"] / tot["target_forwards"]
                                             if tot["target_forwards"] else 0.0)
    return out


def rollout_metrics(samples: Sequence[Sample], instances: Sequence[InstanceReport], makespan_s: float,
                    predicted: dict[int, float]) -> dict:
    """A batch's figures (``predicted``: group -> HistoPipe's predicted mean length)."""
    actual: dict[int, list[int]] = {}
    for s in samples:
        actual.setdefault(s.group, []).append(len(s.token_ids))
    groups = sorted(actual)
    pred = np.array([predicted.get(g, np.nan) for g in groups], dtype=float)
    act = np.array([np.mean(actual[g]) for g in groups], dtype=float)
    ok = ~np.isnan(pred)
    busy = [r.busy_s for r in instances]
    out = {
        "time/rollout_s": makespan_s, "rollout/responses": len(samples),
        "rollout/generated_tokens": sum(len(s.token_ids) for s in samples), "rollout/instances": len(instances),
        "histopipe/bubble_fraction": max(0.0, 1 - sum(busy) / (makespan_s * len(busy)))
        if makespan_s > 0 and busy else 0.0,
        "histopipe/pred_len_mean": float(np.mean(pred[ok])) if ok.any() else float("nan"),
        "histopipe/actual_len_mean": float(np.mean(act)) if len(act) else float("nan"),
        "histopipe/pred_abs_err": float(np.mean(np.abs(pred[ok] - act[ok]))) if ok.any() else float("nan"),
        **{f"histospec/{k}": v for k, v in sum_engine_metrics([r.engine for r in instances]).items()}}
    for i, r in enumerate(instances):
        out[f"rollout/engine_steps/{i}"] = int(r.engine_steps)
        out[f"rollout/idle_steps/{i}"] = int(r.idle_steps)
        out[f"rollout/instance_s/{i}"] = r.busy_s
    return out


def merge_round_metrics(into: dict, extra: dict, rounds: int) -> None:
    """Add a refill round's figures into the step's ``rounds`` so far (sums, ratios recomputed, averages)."""
    for k, v in extra.items():
        if k.startswith(ADDITIVE_PREFIXES) or k.removeprefix("histospec/") in ADDITIVE_ENGINE:
            into[k] = into.get(k, 0) + v
        elif k.startswith("histopipe/") and k in into:
            into[k] = (into[k] * rounds + v) / (rounds + 1)
        else:
            into.setdefault(k, v)
    sources = {k.removeprefix("histospec/"): v for k, v in into.items() if k.startswith("histospec/source/")}
    spec = sum_engine_metrics([{**{k: into.get(f"histospec/{k}", 0) for k in ADDITIVE_ENGINE}, **sources}])
    for k in RATIOS:
        if f"histospec/{k}" in into:
            into[f"histospec/{k}"] = spec[k]
