"""Live HistoPipe dispatch: every rank replicates the ``Scheduler`` and its events, deciding alike."""

from __future__ import annotations

import logging
import math
import time
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from rhymerl.config import HistoPipeConfig, RolloutConfig
from rhymerl.histopipe import calibration
from rhymerl.histopipe.calibration import StepCostFit
from rhymerl.histopipe.cost import DecodeCostModel
from rhymerl.histopipe.scheduler import HistoPipePolicy, Policy, Scheduler
from rhymerl.rollout.batch import InstanceReport, RolloutBatch, RolloutOutput, Sample
from rhymerl.rollout.engine import SamplingSpec
from rhymerl.rollout.metrics import rollout_metrics
from rhymerl.rollout.planned import observe_lengths

log = logging.getLogger("rhymerl.histopipe.live")

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
    instances: list[InstanceReport] = field(default_factory=list)  # per rank

    @property
    def bubble_fraction(self) -> float:
        n = len(self.busy_s)
        if self.makespan_s <= 0 or n == 0:
            return 0.0
        return max(0.0, 1.0 - sum(self.busy_s) / (n * self.makespan_s))


def continuation_seed(run_seed: int, step: int | str, group: int, sample: int, admission: int) -> int:
    """Seed of one admission of a request, independent of the instance it runs on."""
    return zlib.crc32(f"{run_seed}:{step}:{group}:{sample}:{admission}".encode()) & 0x3FFFFFFF


class LiveDispatch:
    """Runs one batch's requests over ``comm.world_size`` engines (this rank's is ``engine``)."""

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
        gen_here = [0] * R  # tokens each request generated on this rank's engine
        steps_here, idle_here = 0, 0
        fresh = self._fresh = set()  # admitted since the last engine step: prefilled in the next
        vid_of: dict[str, int] = {}  # this rank's vLLM request id -> request
        running: set[int] = set()  # requests on this rank's engine
        busy = 0.0
        samples: list[tuple[int, int, float]] = []
        rounds = 0
        t0 = time.perf_counter()
        self.engine.begin_requests()

        def admit_all() -> None:
            # Every rank computes every instance's admissions, so the replicated state stays identical.
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
                emitted = any(toks for _, toks, _, _, _ in deltas)
                steps_here += emitted
                idle_here += not emitted
                for vid, toks, lp, why, done in deltas:
                    r = vid_of.get(vid)
                    if r is None:
                        continue
                    tokens[r].extend(toks)
                    gen_here[r] += len(toks)
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
        here = [r for r in range(R) if fwd[r]]
        engine_m = self.engine.end_requests([gen_here[r] for r in here], [fwd[r] for r in here], busy, steps_here,
                                          idle_here)
        report = InstanceReport(engine_steps=steps_here, idle_steps=idle_here, busy_s=busy, engine=engine_m)
        busy_all = comm.all_gather_object((mine, report, samples, fwd))
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
        reports = [rep for _, rep, _, _ in busy_all]
        return LiveOutcome(out_t, out_l, out_r, makespan, [rep.busy_s for rep in reports], k.migrated, k.preempted,
                           k.stragglers, k.probes, rounds, all_samples, fwd_all, reports)

    def _submit(self, q: LiveRequest, r: int, tokens, admissions, vid_of, running, sampling, run_seed: int,
                step: int | str, tag: str) -> None:
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


class LiveRollout:
    """``generate(batch)`` through the live scheduler on every rank (all instances' samples on each)."""

    def __init__(self, cfg: HistoPipeConfig, rollout_cfg: RolloutConfig, run_seed: int, comm: Any, engine: Any,
                 predictor: Any, history: Any):
        self.cfg = cfg
        self.rollout_cfg = rollout_cfg
        self.run_seed = run_seed
        self.comm = comm
        self.predictor = predictor
        self.history = history
        prior_cost, _, _ = calibration.load(cfg.calibration or None)
        prior = DecodeCostModel(**{**prior_cost.to_dict(), "max_batch": rollout_cfg.max_num_seqs})
        self.dispatch = LiveDispatch(comm, engine, rollout_cfg.max_num_seqs, cfg.slice_s, prior)

    def generate(self, batch: RolloutBatch) -> RolloutOutput:
        reqs, prior_log = [], []
        for g, (prompt, key) in enumerate(zip(batch.prompts, batch.keys)):
            hist = self.history.lengths(key)  # [] without history: the predictor's prior
            self.predictor.predict(key, hist)  # registers the prediction for the predictor's error accounting
            prior_log.append(self.predictor.predict_log(key, hist))
            reqs.extend(LiveRequest(g, s, prompt, key) for s in range(batch.n))
        max_tokens = self.rollout_cfg.max_tokens
        policy = HistoPipePolicy.from_config(self.cfg, prior_log, self.predictor, self.dispatch.cost,
                                             max_tokens=max_tokens)
        out = self.dispatch.run(reqs, policy, SamplingSpec.from_config(self.rollout_cfg), self.run_seed, batch.tag,
                                "histopipe")
        if self.comm.rank == 0:
            log.info("histopipe live step %s: makespan %.3f s, bubble %.3f, moves %d, preempted %d, stragglers %d, "
                     "probes %d, rounds %d, longest response %d tokens of %d", batch.tag, out.makespan_s,
                     out.bubble_fraction, out.moves, out.preempted, out.stragglers, out.probes, out.rounds,
                     max((len(t) for t in out.token_ids), default=0), sum(len(t) for t in out.token_ids))
        samples = [Sample(group=q.group, sample_idx=q.sample, prompt_ids=q.prompt, token_ids=list(toks),
                          logprobs=list(lp), finish_reason=why or "length")
                   for q, toks, lp, why in zip(reqs, out.token_ids, out.logprobs, out.finish_reason)]
        predicted = {g: math.exp(v) for g, v in enumerate(prior_log)}
        metrics = rollout_metrics(samples, out.instances, out.makespan_s, predicted)
        cost = self.dispatch.cost
        metrics.update({"histopipe/moves": out.moves, "histopipe/preempted": out.preempted,
                        "histopipe/stragglers": out.stragglers, "histopipe/cost_step_a_ms": cost.a * 1e3,
                        "histopipe/cost_step_b_us": cost.b * 1e6})
        observe_lengths(self.predictor, batch, samples)
        return RolloutOutput(samples, metrics)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
