"""The live driver of the ``Scheduler``: one rollout step across the ranks' engines.

Every rank holds an identical copy of the scheduler and applies the same events in the
same order, so all ranks reach the same decisions without a coordinator. The step runs
in time slices: each rank admits what the scheduler gives its instance, steps its engine
for ``slice_s`` seconds, then all ranks exchange what happened (progress, finishes) in
one all-gather. Moves the policy then decides are carried out the same way on every
rank: the source engine aborts the request and its tokens so far travel in a second
all-gather; the request continues wherever it starts next, its prompt plus its generated
tokens re-prefilled, with a fresh seed derived from (step, group, sample, admission).
Each token is still drawn from the policy given everything before it, so a moved
response is a valid sample of the policy (not the same sample it would have been).

A rank with nothing to run waits in the all-gather: that wait is the bubble, measured
as 1 - busy / (ranks x makespan) with busy = time spent in engine steps.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from rhymerl.histopipe.calibration import StepCostFit
from rhymerl.histopipe.cost import DecodeCostModel
from rhymerl.histopipe.scheduler import HistoPipePolicy, Policy, Scheduler, StaticPolicy

log = logging.getLogger("rhymerl.histopipe.live")

LIVE_POLICIES = ("histopipe", "least_loaded", "random")


@dataclass
class LiveRequest:
    group: int
    sample: int
    prompt: list[int]
    key: int  # history key of the prompt


@dataclass
class LiveOutcome:
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reason: list[Optional[str]]
    makespan_s: float
    busy_s: list[float]  # per rank
    moves: int
    preempted: int
    stragglers: int
    probes: int
    rounds: int
    step_samples: list = field(default_factory=list)  # (B, K, seconds, prefill tokens) from every rank
    forwards: list[int] = field(default_factory=list)  # per request: engine steps that emitted its tokens

    @property
    def bubble_fraction(self) -> float:
        n = len(self.busy_s)
        if self.makespan_s <= 0 or n == 0:
            return 0.0
        return max(0.0, 1.0 - sum(self.busy_s) / (n * self.makespan_s))


# Keys only one dispatch mode reads: the planner's (static plan) and the live scheduler's.
PLANNER_KEYS = ("num_groups", "split_groups", "tier2")
SCHEDULER_KEYS = ("probe", "straggler_z", "lanes", "lane_batch", "lane_fraction", "migrate", "live_policy",
                  "compare_baselines", "slice_s", "calibration")
# Read only with histopipe.lanes on.
LANE_KEYS = ("lane_batch", "lane_fraction")


def unused_keys(cfg: Any, live: Optional[bool] = None) -> list[str]:
    """``histopipe.*`` keys set away from their defaults that the dispatch mode in use (``live``,
    default ``cfg.live``) does not read (the trainer reports them at start-up instead of
    ignoring them silently)."""
    from dataclasses import fields

    if not cfg.enabled:
        return [f"histopipe.{f.name}" for f in fields(cfg) if f.name != "enabled" and getattr(cfg, f.name) != f.default]
    idle = PLANNER_KEYS if (cfg.live if live is None else live) else SCHEDULER_KEYS
    if not cfg.lanes:
        idle = tuple(dict.fromkeys(idle + LANE_KEYS))
    defaults = {f.name: f.default for f in fields(cfg)}
    return [f"histopipe.{k}" for k in idle if getattr(cfg, k) != defaults[k]]


def continuation_seed(run_seed: int, step: int | str, group: int, sample: int, admission: int) -> int:
    """Seed of one admission of a request: independent of the instance it runs on, so the
    same request draws the same tokens under any placement until it is moved."""
    return zlib.crc32(f"{run_seed}:{step}:{group}:{sample}:{admission}".encode()) & 0x3FFFFFFF


def make_live_policy(name: str, groups: Sequence[int], num_instances: int, step: int, prior_log: Sequence[float],
                     predictor: Any, cost: DecodeCostModel, cfg: Any, max_tokens: int) -> Policy:
    if name == "least_loaded":
        return Policy()
    if name == "random":
        rng = np.random.default_rng(step + 17)
        ng = (max(groups) + 1) if len(groups) else 0
        members: list[list[int]] = [[] for _ in range(ng)]
        for r, g in enumerate(groups):
            members[g].append(r)
        chunks = np.array_split(rng.permutation(ng), num_instances)
        return StaticPolicy([[r for g in ch for r in members[int(g)]] for ch in chunks], "random")
    if name == "histopipe":
        return HistoPipePolicy.from_config(cfg, prior_log, predictor, cost, max_tokens=max_tokens)
    raise ValueError(f"unknown live policy {name!r}; choose from {', '.join(LIVE_POLICIES)}")


class LiveRollout:
    """Runs one step's requests over ``comm.world_size`` engines (this rank's is ``engine``)."""

    def __init__(self, comm: Any, engine: Any, max_batch: int, slice_s: float, cost: DecodeCostModel):
        self.comm = comm
        self.engine = engine
        self.max_batch = max_batch
        self.slice_s = slice_s
        self.fit = StepCostFit(cost)

    @property
    def cost(self) -> DecodeCostModel:
        return self.fit.fit()

    def run(self, reqs: Sequence[LiveRequest], policy: Policy, sampling: Any, run_seed: int, step: int | str,
            tag: str) -> LiveOutcome:
        comm = self.comm
        me, N = comm.rank, comm.world_size
        R = len(reqs)
        sched = Scheduler(N, self.max_batch, [q.group for q in reqs], [len(q.prompt) for q in reqs], policy)
        tokens: list[list[int]] = [[] for _ in range(R)]
        lps: list[list[float]] = [[] for _ in range(R)]
        reason: list[Optional[str]] = [None] * R
        admissions = [0] * R
        fwd = [0] * R
        fresh = self._fresh = set()  # admitted since the last engine step: prefilled in the next
        vid_of: dict[str, int] = {}  # this rank's vLLM request id -> request
        running: set[int] = set()  # requests on this rank's engine
        busy = 0.0
        samples: list[tuple[int, int, float]] = []
        rounds = 0
        t0 = time.perf_counter()

        def admit_all() -> None:
            # Every rank computes every instance's admissions (one per instance in turn, as the
            # simulator deals them): the replicated state stays identical.
            more = True
            while more:
                more = False
                for i in range(N):
                    r = sched.next_for(i)
                    if r is None:
                        continue
                    more = True
                    sched.started(r, i)
                    if i == me:
                        self._submit(reqs[r], r, tokens, admissions, vid_of, running, sampling, run_seed, step, tag)

        admit_all()
        progress = getattr(self.engine, "progress", None)
        n_done, n_tokens = 0, 0
        if progress is not None:
            progress.start(f"rollout (instance {me} of {N})", total=R, unit="responses of the step")
        while sched.left > 0:
            rounds += 1
            t_round = time.perf_counter()
            finished_here: list[tuple[int, int, Optional[str]]] = []
            while running and time.perf_counter() - t_round < self.slice_s:
                B = len(running)
                K = sum(len(reqs[r].prompt) + len(tokens[r]) for r in running)
                F = sum(len(reqs[r].prompt) + len(tokens[r]) for r in running if r in fresh)
                fresh.clear()
                ts = time.perf_counter()
                deltas = self.engine.step_deltas()
                dt = time.perf_counter() - ts
                busy += dt
                if len(samples) < 4096:
                    samples.append((B, K, dt, F))
                for vid, toks, lp, why, done in deltas:
                    r = vid_of.get(vid)
                    if r is None:
                        continue
                    tokens[r].extend(toks)
                    n_tokens += len(toks)
                    lps[r].extend(lp)
                    if toks:
                        fwd[r] += 1
                    if done:
                        reason[r] = why
                        running.discard(r)
                        del vid_of[vid]
                        finished_here.append((r, len(tokens[r]), why))
            progress_here = [(r, len(tokens[r])) for r in sorted(running)]
            gathered = comm.all_gather_object((finished_here, progress_here))
            for fin, prog in gathered:
                for r, n, _ in fin:
                    sched.finished(r, n)
                for r, n in prog:
                    sched.progress(r, n)
            if progress is not None:
                n_done += sum(len(fin) for fin, _ in gathered)
                progress.update(n_done, tokens_here=n_tokens)
            moves = sched.moves()
            if moves:
                mine_out = {}
                for mv in moves:
                    if mv.src == me:
                        vid = next(v for v, x in vid_of.items() if x == mv.rid)
                        self.engine.abort(vid)
                        del vid_of[vid]
                        running.discard(mv.rid)
                        mine_out[mv.rid] = (tokens[mv.rid], lps[mv.rid])
                parts = comm.all_gather_object(mine_out)
                for part in parts:
                    for r, (tk, lp) in part.items():
                        tokens[r], lps[r] = list(tk), list(lp)
                for mv in moves:
                    n = len(tokens[mv.rid])
                    if mv.dst < 0:
                        sched.preempted(mv.rid, n)
                        continue
                    sched.migrated(mv, n)
                    if mv.dst == me:
                        self._submit(reqs[mv.rid], mv.rid, tokens, admissions, vid_of, running, sampling, run_seed,
                                     step, tag)
                if me == 0:
                    log.info("histopipe live [%s]: round %d: %d move(s): %s", tag, rounds, len(moves),
                             ", ".join(f"req {m.rid} {m.src}->{'queue' if m.dst < 0 else m.dst} at "
                                       f"{len(tokens[m.rid])} tok" for m in moves))
            admit_all()
        makespan = time.perf_counter() - t0
        if progress is not None:
            progress.finish()
        # Finished responses are complete on the rank that finished them; share them.
        mine = {r: (tokens[r], lps[r], reason[r]) for r in range(R) if reason[r] is not None}
        busy_all = comm.all_gather_object((mine, busy, samples, fwd))
        out_t: list[list[int]] = [[] for _ in range(R)]
        out_l: list[list[float]] = [[] for _ in range(R)]
        out_r: list[Optional[str]] = [None] * R
        all_samples = []
        fwd_all = [0] * R
        for part, _, smp, fw in busy_all:
            all_samples.extend(smp)
            fwd_all = [a + b for a, b in zip(fwd_all, fw)]
            for r, (tk, lp, why) in part.items():
                out_t[r], out_l[r], out_r[r] = list(tk), list(lp), why
        for B, K, dt, F in all_samples:
            self.fit.add(B, K, dt, F)
        k = sched.counters
        return LiveOutcome(out_t, out_l, out_r, makespan, [b for _, b, _, _ in busy_all], k.migrated, k.preempted,
                           k.stragglers, k.probes, rounds, all_samples, fwd_all)

    def _submit(self, q: LiveRequest, r: int, tokens, admissions, vid_of, running, sampling, run_seed: int,
                step: int | str, tag: str) -> None:
        from dataclasses import replace

        prefix = tokens[r]
        k = admissions[r]
        admissions[r] += 1
        vid = f"{tag}:{step}:{r}:{k}"
        spec = replace(sampling, max_tokens=max(1, sampling.max_tokens - len(prefix)))
        self.engine.submit(vid, list(q.prompt) + list(prefix), spec,
                           continuation_seed(run_seed, step, q.group, q.sample, k), q.key, f"{tag}:{step}:{q.group}")
        vid_of[vid] = r
        running.add(r)
        self._fresh.add(r)


def trainer_rollout(tr: Any, batch_indices: list[int], epoch: int, round_: int = 0) -> tuple[list, dict]:
    """The trainer's rollout phase through the live scheduler: returns (samples, metrics)
    like ``Trainer._rollout``. With ``histopipe.compare_baselines`` the same requests are
    also run under the baseline policies first (their responses are discarded) so that
    the bubble of every policy is measured in the same run on the same prompts."""
    import math

    from rhymerl.rollout import SamplingSpec
    from rhymerl.trainer import Sample

    cfg = tr.cfg
    hp = cfg.histopipe
    if getattr(tr, "_live", None) is None:
        from rhymerl.histopipe import calibration

        prior_cost, _, _ = calibration.load(hp.calibration or None)
        prior = DecodeCostModel(**{**prior_cost.to_dict(), "max_batch": cfg.rollout.max_num_seqs})
        tr._live = LiveRollout(tr.comm, tr.engine, cfg.rollout.max_num_seqs, hp.slice_s, prior)
    live: LiveRollout = tr._live
    reqs = []
    prior_log = []
    for g, i in enumerate(batch_indices):
        key = tr.prompt_keys[i]
        hist = tr.history.lengths(key) if tr.history.has(key) else None
        tr.predictor.predict(key, hist)  # registers the prediction for the predictor's error accounting
        prior_log.append(tr.predictor.predict_log(key, hist))
        for s in range(cfg.rollout.n):
            reqs.append(LiveRequest(g, s, tr.prompt_ids[i], key))
    groups = [q.group for q in reqs]
    spec = SamplingSpec(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                        max_tokens=cfg.rollout.max_tokens)
    metrics: dict = {}
    names = [hp.live_policy]
    if hp.compare_baselines:
        # Rotated each step so that no policy always runs first (cold caches) or last.
        names = [LIVE_POLICIES[(tr.step + j) % len(LIVE_POLICIES)] for j in range(len(LIVE_POLICIES))]
    kept = None
    for name in names:
        pol = make_live_policy(name, groups, tr.comm.world_size, tr.step, prior_log, tr.predictor, live.cost, hp,
                               cfg.rollout.max_tokens)
        # Each policy starts from the same engine state: no prompt KV cached by an earlier run.
        tr.engine.llm.reset_prefix_cache()
        tr.engine.start_rollout()
        d0 = tr.engine.drafter_counts()
        # DAPO's refill rounds of a step sample with their own seeds and sibling-group ids.
        res = live.run(reqs, pol, spec, cfg.run.seed, tr.step if round_ == 0 else f"{tr.step}.{round_}", name)
        d1 = tr.engine.drafter_counts()
        if name == hp.live_policy:
            kept, drafted = res, d1[0] - d0[0]
        out = res
        metrics[f"histopipe/bubble_{name}"] = res.bubble_fraction
        metrics[f"histopipe/makespan_{name}_s"] = res.makespan_s
        if tr.comm.rank == 0:
            # The responses differ between policies (drafts and batches change what sampling
            # draws), so the makespan is read beside the longest response each policy drew.
            log.info("histopipe live step %d policy %s: makespan %.3f s, bubble %.3f, moves %d, preempted %d, "
                     "stragglers %d, probes %d, rounds %d, longest response %d tokens of %d", tr.step, name,
                     res.makespan_s, res.bubble_fraction, res.moves, res.preempted, res.stragglers, res.probes,
                     res.rounds, max((len(t) for t in res.token_ids), default=0), sum(len(t) for t in res.token_ids))
    out = kept
    cost = live.cost
    gen = sum(len(t) for t in out.token_ids)
    fwd = sum(out.forwards)
    proposed = tr.comm.all_gather_object(drafted)
    lens: dict[int, list[int]] = {}
    samples = []
    for q, toks, lp, why in zip(reqs, out.token_ids, out.logprobs, out.finish_reason):
        lens.setdefault(q.group, []).append(len(toks))
        samples.append(Sample(group=q.group, sample_idx=q.sample, prompt_ids=q.prompt, token_ids=list(toks),
                              logprobs=list(lp), finish_reason=why or "length",
                              text=tr.tokenizer.decode(toks, skip_special_tokens=True)))
    pred = np.array([math.exp(prior_log[g]) for g in sorted(lens)])
    act = np.array([float(np.mean(lens[g])) for g in sorted(lens)])
    metrics.update({
        "time/rollout_s": out.makespan_s,
        "histopipe/bubble_fraction": out.bubble_fraction,
        "histopipe/moves": out.moves,
        "histopipe/preempted": out.preempted,
        "histopipe/stragglers": out.stragglers,
        "histopipe/pred_len_mean": float(pred.mean()) if len(pred) else float("nan"),
        "histopipe/actual_len_mean": float(act.mean()) if len(act) else float("nan"),
        "histopipe/pred_abs_err": float(np.mean(np.abs(pred - act))) if len(pred) else float("nan"),
        "histopipe/cost_step_a_ms": cost.a * 1e3,
        "histopipe/cost_step_b_us": cost.b * 1e6,
        "histospec/generated_tokens": float(gen),
        "histospec/target_forwards": float(fwd),
        "histospec/draft_accepted": float(gen - fwd),
        "histospec/draft_proposed": float(sum(proposed)),
        "histospec/acceptance": (gen - fwd) / sum(proposed) if sum(proposed) else 0.0,
        "histospec/tokens_per_forward": gen / fwd if fwd else 1.0,
    })
    for g, ls in lens.items():
        tr.predictor.observe(tr.prompt_keys[batch_indices[g]], ls)
    return samples, metrics
