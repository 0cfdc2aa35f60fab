"""Cluster simulator: one RL step's rollout on N GPUs under several schedulers.

    python -m benchmarks simulate --gpus 64,512,4096 --tp 4 --trace synthetic --json

Schedulers, all on the same workload and cost model:
- random: prompt groups shuffled and cut into equal-count chunks, one per instance
  (verl-style dispatch of a shuffled batch);
- round_robin: groups dealt to instances in dataset order (``NoopPlanner``);
- least_loaded: one central queue; an instance pulls the next request whenever a batch
  slot frees (least-loaded by count, dynamic);
- histopipe: ``scheduler.HistoPipePolicy`` (the policy the trainer runs) primed with the
  ``LengthPredictor``'s estimates (trained online on the earlier epochs): probes, online
  group estimates (a running probe counts as it runs), straggler migration;
- oracle: knows every response's true length: one central longest-work-first queue; the
  practical limit.

Every scheduler is a policy of ``scheduler.Scheduler`` driven by ``event_loop.simulate``.
The cost model comes from a calibration file (``calibration``; its source is printed), and
the projection rows combine it with HistoSpec's tokens per forward by position
(``spec_profile``) for {no speculation, HistoSpec} x {random/least-loaded, HistoPipe}.

``--json`` prints {"results": [{"gpus", "scheduler", "makespan_s", "bubble_fraction",
"ratio_to_oracle", "shuffled"}], "calibration": str, "projection": {"label", "calibration", "proposer_s_per_request",
"speculation", "rows": [{"gpus", "config", "makespan_s", "bubble_fraction",
"speedup_vs_least_loaded"}]}} on stdout; tables go to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Optional

import numpy as np

from rhymerl.config import HistoPipeConfig
from rhymerl.histopipe import calibration
from benchmarks.simulate import spec_profile
from rhymerl.histopipe.cost import DecodeCostModel
from benchmarks.simulate.event_loop import SimResult, simulate
from rhymerl.histopipe.planner import NoopPlanner, Plan
from rhymerl.histopipe.scheduler import HistoPipePolicy, Policy, PriorityPolicy, StaticPolicy
from benchmarks.simulate.spec_profile import SpecProfile
from rhymerl.histopipe.predictor import LengthPredictor
from benchmarks.simulate.workload import (DEFAULT_MAX_TOKENS, DEFAULT_PROMPT_LEN, Workload, from_trace, reorder,
                                          synthetic, tile)
from rhymerl.outputs.traces import TraceError, by_epoch, read_trace

SCHEDULERS = ("random", "round_robin", "least_loaded", "histopipe", "oracle")
DEFAULT_GPUS = (64, 512, 4096)
# --genie: the diagnostic that reveals the responses this far above their group's mean.
GENIE_OUTLIER_FACTORS = (1.5, 2.5)


def plan_queues(w: Workload, plan: Plan) -> list[list[int]]:
    off = w.offsets
    return [[int(off[g]) + s for g, s in inst] for inst in plan.instances]


def trained_predictor(w: Workload, cfg: HistoPipeConfig) -> LengthPredictor:
    """A predictor that has lived through the workload's earlier epochs (online updates)."""
    pr = LengthPredictor(cfg, w.max_tokens)
    for hist, actual in w.warmup:
        for key, lens in actual.items():
            pr.predict(key, hist.get(key))
            pr.observe(key, lens)
    return pr


def predictions(w: Workload, pr: LengthPredictor) -> dict[int, float]:
    return {g.index: pr.predict(g.key, w.history.get(g.key)) for g in w.groups}


def predictor_error(w: Workload, pred: dict[int, float]) -> dict:
    true = w.true_group_mean()
    p = np.array([pred[g.index] for g in w.groups])
    t = np.array([true[g.index] for g in w.groups])
    rel = np.abs(p - t) / np.maximum(1.0, t)
    rank_corr = float(np.corrcoef(np.argsort(np.argsort(p)), np.argsort(np.argsort(t)))[0, 1]) if len(p) > 2 and p.std() > 0 else 0.0
    return {"groups": len(p), "mean_abs_rel_error": float(rel.mean()), "median_abs_rel_error": float(np.median(rel)),
            "spearman": rank_corr}


def histopipe_policy(w: Workload, cost: DecodeCostModel, cfg: HistoPipeConfig, pr: LengthPredictor,
                     cls: type[HistoPipePolicy] = HistoPipePolicy) -> HistoPipePolicy:
    """The live trainer's policy, primed with the predictor's history-based estimates."""
    prior = [pr.predict_log(g.key, w.history.get(g.key)) for g in w.groups]
    return cls.from_config(cfg, prior, pr, cost, max_tokens=w.max_tokens)


def make_policy(name: str, w: Workload, num_instances: int, cost: DecodeCostModel, cfg: HistoPipeConfig,
                seed: int = 0, pr: Optional[LengthPredictor] = None, step: int = 1) -> Policy:
    N = num_instances
    if name == "random":
        rng = np.random.default_rng(seed + 17)
        order = rng.permutation(len(w.groups))
        chunks = np.array_split(order, N)
        return StaticPolicy([[int(r) for g in ch for r in range(w.offsets[g], w.offsets[g + 1])] for ch in chunks], "random")
    if name == "round_robin":
        plan = NoopPlanner(N).plan(step, w.groups)
        return StaticPolicy(plan_queues(w, plan), "round_robin")
    if name == "least_loaded":
        return Policy()
    if name == "histopipe":
        return histopipe_policy(w, cost, cfg, pr if pr is not None else trained_predictor(w, cfg))
    if name == "oracle":
        # Knows every response's length: one central longest-work-first queue.
        P = w.prompt_lens()
        return PriorityPolicy([cost.request_work(float(x), float(pl)) for x, pl in zip(w.lengths.tolist(), P.tolist())], "oracle")
    raise ValueError(f"unknown scheduler {name!r}; choose from {', '.join(SCHEDULERS)}")


class OutlierGenie(HistoPipePolicy):
    """Diagnostic, never a real scheduler: HistoPipe told which responses run past a factor
    x their group's true mean, and how long they are (``known``: request -> length); those
    start first, longest first. How much of the gap to the oracle per-response knowledge
    inside a group would close. ``outlier_genie`` sets ``known``."""

    known: dict[int, float]

    def key(self, rid: int) -> tuple:
        if rid in self.known and self.s.generated[rid] == 0:
            return (-1, -self.known[rid], rid)
        return super().key(rid)


def outlier_genie(w: Workload, cost: DecodeCostModel, cfg: HistoPipeConfig, pr: LengthPredictor, factor: float) -> OutlierGenie:
    pol = histopipe_policy(w, cost, cfg, pr, cls=OutlierGenie)
    mean = w.true_group_mean()
    gof = w.group_of()
    pol.known = {r: float(L) for r, L in enumerate(w.lengths.tolist()) if L > factor * mean[int(gof[r])]}
    return pol


def run_scheduler(name: str, w: Workload, num_instances: int, cost: DecodeCostModel, cfg: HistoPipeConfig,
                  seed: int = 0, pr: Optional[LengthPredictor] = None, spec: Optional[SpecProfile] = None) -> SimResult:
    pol = make_policy(name, w, num_instances, cost, cfg, seed=seed, pr=pr)
    tps = extra = None
    if spec is not None:
        tps, extra = spec.per_request(w.lengths)
    return simulate(cost, num_instances, w.lengths, w.prompt_lens(), w.group_of(), pol, tokens_per_step=tps,
                    verify_cost=cost.b if spec is not None else 0.0, draft_tokens=extra,
                    proposer_s=spec.proposer_s_per_request if spec is not None else 0.0)


def lower_bound(w: Workload, num_instances: int, cost: DecodeCostModel) -> float:
    """No schedule beats the longest response running alone, nor perfect work spreading."""
    L = w.lengths.astype(float)
    P = w.prompt_lens().astype(float)
    total = float(np.sum(L * (cost.a / cost.max_batch + cost.b) + cost.c * L * (P + 0.5 * L) + cost.p * P))
    solo = float(np.max(L * (cost.a + cost.b) + cost.c * L * (P + 0.5 * L)))
    return max(total / num_instances, solo)


def _parse_gpus(values: Optional[list[str]]) -> list[int]:
    if not values:
        return list(DEFAULT_GPUS)
    out = []
    for v in values:
        for part in v.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                g = int(part)
            except ValueError:
                raise SystemExit(f"simulate histopipe: --gpus: {part!r} is not an integer") from None
            if g < 1:
                raise SystemExit(f"simulate histopipe: --gpus must be >= 1, got {g}")
            out.append(g)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks simulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", action="append", help="GPU counts, repeatable or comma-separated (default 64,512,4096)")
    ap.add_argument("--tp", type=int, default=4, help="GPUs per rollout instance (default 4)")
    ap.add_argument("--trace", default="synthetic", help="rollout trace JSONL (rhymerl.outputs.traces) or 'synthetic'; "
                    "a trace also gives the projection HistoSpec's speed, replayed on it")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--schedulers", default=",".join(SCHEDULERS), help="comma-separated subset of " + ",".join(SCHEDULERS))
    ap.add_argument("--prompts-per-instance", type=float, default=16.0, help="prompt groups per instance in the step")
    ap.add_argument("--n", type=int, default=16, help="responses per prompt (synthetic)")
    ap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="response length cap (synthetic)")
    ap.add_argument("--corr", type=float, default=0.9, help="epoch-to-epoch correlation of prompt lengths (synthetic)")
    ap.add_argument("--sigma-sample", type=float, default=0.45, help="lognormal spread of lengths inside a group (synthetic)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs in the synthetic trace (last = the simulated step)")
    ap.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN, help="prompt length when the trace has no prompt_token_ids")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shuffle", action="store_true", help="shuffle the step's prompt order (dataset order otherwise)")
    ap.add_argument("--calibration", default=None, help="cost-model calibration JSON (default: the shipped roofline file)")
    ap.add_argument("--no-projection", action="store_true", help="skip the speculation x scheduling projection rows")
    ap.add_argument("--genie", action="store_true", help="also run HistoPipe given the true per-group mean lengths, and "
                    "given which responses run far past their group's mean (stderr): separates predictor error from the "
                    "spread inside a group that no group-level signal reveals")
    return ap


def _shuffled(w: Workload, seed: int) -> Workload:
    perm = np.random.default_rng(seed + 101).permutation(len(w.groups))
    return reorder(w, perm.tolist())


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    gpus = _parse_gpus(args.gpus)
    names = [s.strip() for s in args.schedulers.split(",") if s.strip()]
    for s in names:
        if s not in SCHEDULERS:
            print(f"simulate histopipe: --schedulers: unknown {s!r} (choose from {', '.join(SCHEDULERS)})", file=sys.stderr)
            return 2
    if args.tp < 1:
        print("simulate histopipe: --tp must be >= 1", file=sys.stderr)
        return 2
    for g in gpus:
        if g % args.tp:
            print(f"simulate histopipe: --gpus {g} is not a multiple of --tp {args.tp}", file=sys.stderr)
            return 2
    cfg = HistoPipeConfig()
    try:
        cost, cal_source, cal = calibration.load(args.calibration)
        # A trace's own speculation: HistoSpec replayed on it (history needs a second epoch),
        # drafts priced at this engine's costs; the synthetic workload takes the calibration
        # file's measured profile.
        if args.trace == "synthetic":
            spec = SpecProfile.from_dict(cal["speculation"]) if "speculation" in cal else None
        elif len(by_epoch(read_trace(args.trace))) >= 2:
            spec = spec_profile.measure_for_engine(args.trace, cost, args.prompt_len + args.max_tokens / 2)
        else:
            spec = None
            print(f"simulate histopipe: {args.trace} has one epoch: no speculation profile to project with",
                  file=sys.stderr)
    except (ValueError, TraceError) as e:
        print(f"simulate histopipe: {e}", file=sys.stderr)
        return 2
    base: Optional[Workload] = None
    if args.trace != "synthetic":
        try:
            base = from_trace(args.trace, default_prompt_len=args.prompt_len)
        except TraceError as e:
            print(f"simulate histopipe: {e}", file=sys.stderr)
            return 2

    results = []
    projection = []
    err = sys.stderr
    print(f"HistoPipe cluster simulator: tp={args.tp}, max_batch={cost.max_batch}, kv_capacity={cost.kv_capacity} tokens/instance, "
          f"step_time = {cost.a * 1e3:.2f} ms + {cost.b * 1e6:.1f} us*B + {cost.c * 1e9:.1f} ns*K\n"
          f"calibration: {cal_source}", file=err)
    if spec is not None:
        print(f"speculation profile: {spec.source}; tokens/forward by position "
              + ", ".join(f">={e}: {t:.2f}" for e, t in zip(spec.edges, spec.tokens_per_forward))
              + f"; proposer CPU {1e6 * spec.proposer_s_per_request:.0f} us per request per step", file=err)
    for g in gpus:
        N = g // args.tp
        num_groups = max(1, int(round(args.prompts_per_instance * N)))
        t0 = time.perf_counter()
        if base is None:
            w = synthetic(num_groups, n=args.n, epochs=args.epochs, corr=args.corr, max_tokens=args.max_tokens,
                          sigma_sample=args.sigma_sample, seed=args.seed)
        else:
            w = tile(base, num_groups, seed=args.seed)
        if args.shuffle:
            w = _shuffled(w, args.seed)
        pr = trained_predictor(w, cfg)
        perr = predictor_error(w, predictions(w, pr))
        rows = {}
        extra = {}
        for s in names:
            ts = time.perf_counter()
            rows[s] = run_scheduler(s, w, N, cost, cfg, seed=args.seed, pr=pr)
            extra[s] = time.perf_counter() - ts
        oracle = rows.get("oracle") or run_scheduler("oracle", w, N, cost, cfg)
        lb = lower_bound(w, N, cost)
        print(f"\n== {g} GPUs ({N} instances of {args.tp}), {len(w.groups)} prompts x n, {w.num_requests} responses, "
              f"{w.source}{', shuffled' if args.shuffle else ''}; sim {time.perf_counter() - t0:.1f}s", file=err)
        print(f"   predictor on this step: mean |err|/len {perr['mean_abs_rel_error']:.3f}, median {perr['median_abs_rel_error']:.3f}, "
              f"rank corr {perr['spearman']:.3f}, learnt beta {pr.beta:.2f}; lower bound {lb:.1f}s", file=err)
        print(f"   {'scheduler':<13}{'makespan_s':>11}{'bubble':>8}{'x oracle':>9}{'probes':>8}{'stragglers':>11}"
              f"{'migrated':>9}{'wall_s':>7}", file=err)
        for s in names:
            r = rows[s]
            ratio = r.makespan_s / oracle.makespan_s if oracle.makespan_s > 0 else 1.0
            results.append({"gpus": g, "scheduler": s, "makespan_s": round(r.makespan_s, 3),
                            "bubble_fraction": round(r.bubble_fraction, 4), "ratio_to_oracle": round(ratio, 4),
                            "shuffled": bool(args.shuffle)})
            print(f"   {s:<13}{r.makespan_s:>11.1f}{r.bubble_fraction:>8.3f}{ratio:>9.3f}{r.probes:>8}{r.stragglers:>11}"
                  f"{r.migrated:>9}{extra[s]:>7.1f}", file=err)
        if args.genie:
            true_mean, group_of = w.true_group_mean(), w.group_of()
            sim_args = (cost, N, w.lengths, w.prompt_lens(), group_of)
            gm = HistoPipePolicy.from_config(cfg, [math.log(max(1.0, x)) for x in true_mean.values()], pr, cost,
                                             max_tokens=w.max_tokens)
            res = simulate(*sim_args, gm)
            print(f"   histopipe with true group means: makespan {res.makespan_s:.1f}s, x oracle {res.makespan_s / oracle.makespan_s:.3f}, "
                  f"bubble {res.bubble_fraction:.3f}", file=err)
            # Without probes or estimates: what a perfect group-level signal buys on its own.
            by_mean = PriorityPolicy([true_mean[int(gi)] for gi in group_of], "true group mean")
            res = simulate(*sim_args, by_mean)
            print(f"   longest true group mean first (no probes): x oracle {res.makespan_s / oracle.makespan_s:.3f}, "
                  f"bubble {res.bubble_fraction:.3f}", file=err)
            for factor in GENIE_OUTLIER_FACTORS:
                gp = outlier_genie(w, cost, cfg, pr, factor)
                res = simulate(*sim_args, gp)
                print(f"   histopipe told the {len(gp.known)} responses ({len(gp.known) / max(1, w.num_requests):.1%}) longer than "
                      f"{factor}x their group's mean: x oracle {res.makespan_s / oracle.makespan_s:.3f}", file=err)
        if spec is not None and not args.no_projection:
            base_rows = [("random", None), ("least_loaded", None), ("least_loaded", spec), ("histopipe", None), ("histopipe", spec)]
            labels = ["no speculation + random", "no speculation + least-loaded", "HistoSpec only (least-loaded)",
                      "HistoPipe only", "HistoSpec + HistoPipe"]
            ref = None
            print("   PROJECTION (cost model and speculation profile above, not a measurement): rollout makespan", file=err)
            for label, (s, sp) in zip(labels, base_rows):
                r = rows[s] if sp is None and s in rows else run_scheduler(s, w, N, cost, cfg, seed=args.seed, pr=pr, spec=sp)
                if label == "no speculation + least-loaded":
                    ref = r.makespan_s
                projection.append({"gpus": g, "config": label, "makespan_s": round(r.makespan_s, 3),
                                   "bubble_fraction": round(r.bubble_fraction, 4), "shuffled": bool(args.shuffle)})
            for row in projection[-len(labels):]:
                row["speedup_vs_least_loaded"] = round(ref / row["makespan_s"], 4) if row["makespan_s"] > 0 else 1.0
                print(f"     {row['config']:<32}{row['makespan_s']:>10.1f} s  x{row['speedup_vs_least_loaded']:.2f}", file=err)
    if args.json:
        out = {"results": results, "calibration": cal_source}
        if projection:
            out["projection"] = {"label": "projection from the cost model and speculation profile, not a measurement",
                                 "calibration": cal_source, "speculation": spec.source,
                                 "proposer_s_per_request": spec.proposer_s_per_request, "rows": projection}
        print(json.dumps(out))
    return 0
