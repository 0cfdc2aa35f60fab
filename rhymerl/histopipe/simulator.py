"""Cluster simulator: one RL step's rollout on N GPUs under several schedulers.

    python -m rhymerl simulate histopipe --gpus 64,512,4096 --tp 4 --trace synthetic --json

Schedulers, all on the same workload and cost model:
- random: prompt groups shuffled and cut into equal-count chunks, one per instance
  (verl-style dispatch of a shuffled batch);
- round_robin: groups dealt to instances in dataset order (``NoopPlanner``);
- least_loaded: one central queue; an instance pulls the next request whenever a batch
  slot frees (least-loaded by count, dynamic);
- histopipe: ``HistoPipePlanner`` on the ``LengthPredictor``'s estimates (trained online on
  the earlier epochs), plus runtime correction (queue stealing and straggler migration);
- oracle: knows every response's true length: per-request LPT placement by true work,
  longest first, rebalanced by true work at runtime; the practical limit.

``--json`` prints {"results": [{"gpus", "scheduler", "makespan_s", "bubble_fraction",
"ratio_to_oracle"}]} on stdout; tables go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional

import numpy as np

from rhymerl.config import HistoPipeConfig
from rhymerl.histopipe.cost import DecodeCostModel
from rhymerl.histopipe.engine import Runtime, SimResult, simulate
from rhymerl.histopipe.planner import HistoPipePlanner, NoopPlanner, Plan, lpt
from rhymerl.histopipe.predictor import LengthPredictor
from rhymerl.histopipe.workload import Workload, from_trace, synthetic, tile
from rhymerl.traces import TraceError

SCHEDULERS = ("random", "round_robin", "least_loaded", "histopipe", "oracle")
DEFAULT_GPUS = (64, 512, 4096)


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


def run_scheduler(
    name: str,
    w: Workload,
    num_instances: int,
    cost: DecodeCostModel,
    cfg: HistoPipeConfig,
    seed: int = 0,
    pred: Optional[dict[int, float]] = None,
    tier2: Optional[str] = None,
    step: int = 1,
    runtime: Optional[Runtime] = None,
) -> SimResult:
    N = num_instances
    L = w.lengths
    P = w.prompt_lens()
    G = w.group_of()
    if name == "random":
        rng = np.random.default_rng(seed + 17)
        order = rng.permutation(len(w.groups))
        chunks = np.array_split(order, N)
        queues = [[int(r) for g in ch for r in range(w.offsets[g], w.offsets[g + 1])] for ch in chunks]
        return simulate(cost, N, L, P, G, queues=queues)
    if name == "round_robin":
        plan = NoopPlanner(N).plan(step, w.groups)
        return simulate(cost, N, L, P, G, queues=plan_queues(w, plan))
    if name == "least_loaded":
        return simulate(cost, N, L, P, G, central=list(range(w.num_requests)))
    if name == "histopipe":
        if pred is None:
            pred = predictions(w, trained_predictor(w, cfg))
        planner = HistoPipePlanner(cfg, N, cost.max_batch, cost=cost, tier2=tier2)
        plan = planner.plan_lengths(step, w.groups, pred)
        per_req = np.repeat(np.array([pred[g.index] for g in w.groups]), np.diff(w.offsets))
        rt = runtime or Runtime(steal=cfg.rebalance, migrate=cfg.migrate, allow_defer=cfg.allow_defer,
                                straggler_fraction=cfg.straggler_fraction, straggler_threshold=cfg.straggler_threshold)
        prio = -per_req if plan.info.get("ascending") else per_req
        return simulate(cost, N, L, P, G, queues=plan_queues(w, plan), predicted=per_req, runtime=rt, priority=prio)
    if name == "oracle":
        works = [cost.request_work(float(x), float(pl), prefill=True) for x, pl in zip(L.tolist(), P.tolist())]
        where, _ = lpt(works, N)
        queues: list[list[int]] = [[] for _ in range(N)]
        for r in sorted(range(len(works)), key=lambda r: -works[r]):
            queues[where[r]].append(r)
        # Rebalancing by true work on top of the LPT placement absorbs what the work
        # estimate gets wrong about batching; it measured at least as good as static LPT
        # and as one global longest-first queue.
        return simulate(cost, N, L, P, G, queues=queues, predicted=L, priority=works, runtime=Runtime(steal=True))
    raise ValueError(f"unknown scheduler {name!r}; choose from {', '.join(SCHEDULERS)}")


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
    ap = argparse.ArgumentParser(prog="rhymerl simulate histopipe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", action="append", help="GPU counts, repeatable or comma-separated (default 64,512,4096)")
    ap.add_argument("--tp", type=int, default=4, help="GPUs per rollout instance (default 4)")
    ap.add_argument("--trace", default="synthetic", help="rollout trace JSONL (rhymerl.traces) or 'synthetic'")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--schedulers", default=",".join(SCHEDULERS), help="comma-separated subset of " + ",".join(SCHEDULERS))
    ap.add_argument("--prompts-per-instance", type=float, default=16.0, help="prompt groups per instance in the step")
    ap.add_argument("--n", type=int, default=16, help="responses per prompt (synthetic)")
    ap.add_argument("--max-tokens", type=int, default=16384, help="response length cap (synthetic)")
    ap.add_argument("--corr", type=float, default=0.9, help="epoch-to-epoch correlation of prompt lengths (synthetic)")
    ap.add_argument("--sigma-sample", type=float, default=0.45, help="lognormal spread of lengths inside a group (synthetic)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs in the synthetic trace (last = the simulated step)")
    ap.add_argument("--max-batch", type=int, default=64, help="per-instance max running sequences")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt length when the trace has no prompt_token_ids")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tier2", choices=["lpf", "paper"], default=None, help="HistoPipe tier-2 variant (default: histopipe.tier2 or lpf)")
    ap.add_argument("--tier2-compare", action="store_true", help="also measure tier-2 'paper' vs 'lpf' on an odd and an even step (stderr)")
    ap.add_argument("--genie", action="store_true", help="also run HistoPipe given the true per-group mean lengths (stderr): "
                    "separates predictor error from the unpredictable spread inside a group")
    ap.add_argument("--allow-defer", action="store_true", help="let HistoPipe defer stragglers to the next step (off-policy; counted)")
    return ap


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
    cfg = HistoPipeConfig(allow_defer=args.allow_defer)
    if args.tier2:
        cfg_tier2 = args.tier2
    else:
        cfg_tier2 = getattr(cfg, "tier2", "lpf")
    cost = DecodeCostModel.for_instance(tp=args.tp, max_batch=args.max_batch)
    base: Optional[Workload] = None
    if args.trace != "synthetic":
        try:
            base = from_trace(args.trace, default_prompt_len=args.prompt_len)
        except TraceError as e:
            print(f"simulate histopipe: {e}", file=sys.stderr)
            return 2

    results = []
    err = sys.stderr
    print(f"HistoPipe cluster simulator: tp={args.tp}, max_batch={args.max_batch}, kv_capacity={cost.kv_capacity} tokens/instance, "
          f"step_time = {cost.a * 1e3:.2f} ms + {cost.b * 1e6:.1f} us*B + {cost.c * 1e9:.1f} ns*K", file=err)
    for g in gpus:
        N = g // args.tp
        num_groups = max(1, int(round(args.prompts_per_instance * N)))
        t0 = time.perf_counter()
        if base is None:
            w = synthetic(num_groups, n=args.n, epochs=args.epochs, corr=args.corr, max_tokens=args.max_tokens,
                          sigma_sample=args.sigma_sample, seed=args.seed)
        else:
            w = tile(base, num_groups)
        pr = trained_predictor(w, cfg)
        pred = predictions(w, pr)
        perr = predictor_error(w, pred)
        rows = {}
        extra = {}
        for s in names:
            ts = time.perf_counter()
            res = run_scheduler(s, w, N, cost, cfg, seed=args.seed, pred=pred if s == "histopipe" else None, tier2=cfg_tier2)
            rows[s] = res
            extra[s] = time.perf_counter() - ts
        oracle = rows.get("oracle")
        if oracle is None:
            oracle = run_scheduler("oracle", w, N, cost, cfg)
        lb = lower_bound(w, N, cost)
        print(f"\n== {g} GPUs ({N} instances of {args.tp}), {len(w.groups)} prompts x n, {w.num_requests} responses, "
              f"{w.source}; sim {time.perf_counter() - t0:.1f}s", file=err)
        print(f"   predictor on this step: mean |err|/len {perr['mean_abs_rel_error']:.3f}, median {perr['median_abs_rel_error']:.3f}, "
              f"rank corr {perr['spearman']:.3f}, learnt beta {pr.beta:.2f}; lower bound {lb:.1f}s", file=err)
        print(f"   {'scheduler':<13}{'makespan_s':>11}{'bubble':>8}{'x oracle':>9}{'stolen':>8}{'migrated':>9}{'deferred':>9}{'wall_s':>7}", file=err)
        for s in names:
            r = rows[s]
            ratio = r.makespan_s / oracle.makespan_s if oracle.makespan_s > 0 else 1.0
            results.append({"gpus": g, "scheduler": s, "makespan_s": round(r.makespan_s, 3),
                            "bubble_fraction": round(r.bubble_fraction, 4), "ratio_to_oracle": round(ratio, 4)})
            print(f"   {s:<13}{r.makespan_s:>11.1f}{r.bubble_fraction:>8.3f}{ratio:>9.3f}{r.stolen:>8}{r.migrated:>9}{r.deferred:>9}{extra[s]:>7.1f}", file=err)
        if args.genie:
            gm = run_scheduler("histopipe", w, N, cost, cfg, pred=w.true_group_mean(), tier2=cfg_tier2)
            print(f"   histopipe with true group means: makespan {gm.makespan_s:.1f}s, x oracle {gm.makespan_s / oracle.makespan_s:.3f}, "
                  f"bubble {gm.bubble_fraction:.3f}", file=err)
        if args.tier2_compare:
            print("   tier 2 (histopipe planner, same runtime correction): makespan_s on an odd / even step", file=err)
            for variant in ("lpf", "paper"):
                ms = [run_scheduler("histopipe", w, N, cost, cfg, pred=pred, tier2=variant, step=st).makespan_s for st in (1, 2)]
                print(f"     {variant:<6} odd {ms[0]:8.1f}  even {ms[1]:8.1f}  sum {sum(ms):8.1f}  x oracle {sum(ms) / (2 * oracle.makespan_s):.3f}", file=err)
    if args.json:
        print(json.dumps({"results": results}))
    return 0
