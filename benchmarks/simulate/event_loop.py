"""Discrete-event simulation of one rollout step on a cluster of continuous-batching
instances: the simulator's driver of the ``Scheduler``.

Each instance runs up to ``max_batch`` sequences; every decode step advances all of them by
one token and takes ``a + b*B + c*K`` seconds (``DecodeCostModel``). Between two
events the batch is fixed and its context grows by B tokens a step, so the time to the
next event is a closed-form quadratic in the number of steps: events are finishes and
progress reports the scheduler asked for (``watch_tokens``), never single tokens, which
keeps 4096 GPUs x a few hundred thousand responses in seconds. A newly admitted request
stalls its instance for its prefill (a migrated one for its prompt and generated tokens).
Admission is gated by the policy's batch cap and by the KV tokens in use
(``kv_capacity``); preemption is not modelled.

Speculative decoding (HistoSpec) is modelled per request: ``tpf[r]`` tokens per target
forward, so a request of length L needs ceil(L / tpf) steps, and each step costs the
verification of its draft tokens (``verify_cost`` each) and the proposer's time for each
speculating request in the batch (``proposer_s``).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from rhymerl.histopipe.cost import DecodeCostModel
from rhymerl.histopipe.scheduler import Policy, Scheduler


@dataclass
class SimResult:
    makespan_s: float
    busy_s: float  # instance-seconds with a non-empty batch (or prefilling)
    num_instances: int
    finish_s: np.ndarray  # per request
    placed_on: np.ndarray  # instance each request finished on
    start_s: np.ndarray  # first admission time per request
    starts: int = 0  # admissions (a migrated request counts twice)
    migrated: int = 0
    stragglers: int = 0
    probes: int = 0

    @property
    def bubble_fraction(self) -> float:
        if self.makespan_s <= 0:
            return 0.0
        return max(0.0, 1.0 - self.busy_s / (self.num_instances * self.makespan_s))


def simulate(cost: DecodeCostModel, num_instances: int, lengths: Sequence[int], prompt_lens: Sequence[int],
             group_of: Sequence[int], policy: Policy, tokens_per_step: Optional[Sequence[float]] = None,
             verify_cost: float = 0.0, draft_tokens: Optional[Sequence[float]] = None,
             proposer_s: float = 0.0) -> SimResult:
    """Run one step under ``policy``. ``tokens_per_step[r]``: tokens request r emits per
    decode step (1 without speculation); ``draft_tokens[r]``: draft tokens it has verified
    per step, each costing ``verify_cost`` seconds more per step (the step-cost model of
    speculation), and each speculating request adds ``proposer_s`` of drafting to every
    step it is in."""
    N = num_instances
    Ls = [int(x) for x in lengths]
    Ps = [int(x) for x in prompt_lens]
    R = len(Ls)
    if any(L < 1 for L in Ls):
        raise ValueError("every response length must be >= 1 token")
    tps = [1.0] * R if tokens_per_step is None else [max(1.0, float(x)) for x in tokens_per_step]
    # The per-step verify and drafting overhead each request adds to its batch.
    extra = [0.0] * R if draft_tokens is None else [verify_cost * float(d) + proposer_s for d in draft_tokens]
    sched = Scheduler(N, cost.max_batch, group_of, prompt_lens, policy)
    a, b, c, p = cost.a, cost.b, cost.c, cost.p
    cap = cost.kv_capacity

    S = [0] * N  # decode steps done
    T = [0.0] * N
    B = [0] * N
    X = [0.0] * N  # summed per-step verify overhead of the batch
    Kc = [0.0] * N  # context = Kc + Kr*S   (each sequence grows by tps tokens a step)
    Kr = [0.0] * N
    run: list[list] = [[] for _ in range(N)]  # heap (finish step, rid)
    watch: list[list] = [[] for _ in range(N)]  # heap (report step, rid)
    ver = [0] * N
    busy = [0.0] * N
    s0 = [0] * R  # instance step at admission
    g0 = [0] * R  # tokens generated before this admission (migration)
    finish = np.full(R, np.nan)
    start = np.full(R, np.nan)
    placed = np.full(R, -1, dtype=np.int64)
    events: list = []

    def base(i: int) -> float:
        return a + b * B[i] + X[i] + c * (Kc[i] + Kr[i] * S[i])

    def dt_steps(i: int, m: int) -> float:
        return m * base(i) + c * Kr[i] * m * (m - 1) * 0.5

    def steps_by(i: int, t: float, limit: int) -> int:
        d = t - T[i]
        if B[i] == 0 or d <= 0:
            return 0
        q = 0.5 * c * Kr[i]
        lin = base(i) - q
        m = int((-lin + math.sqrt(lin * lin + 4 * q * d)) / (2 * q)) if q > 0 else int(d / base(i))
        return max(0, min(m, limit))

    def gen_of(r: int, i: int) -> int:
        return min(Ls[r], g0[r] + int((S[i] - s0[r]) * tps[r]))

    def next_step(i: int) -> int:
        F = run[i][0][0]
        return min(F, watch[i][0][0]) if watch[i] else F

    def schedule(i: int) -> None:
        ver[i] += 1
        if run[i]:
            heapq.heappush(events, (T[i] + dt_steps(i, next_step(i) - S[i]), ver[i], i))

    def admit(i: int, r: int) -> None:
        ctx0 = Ps[r] + g0[r]
        if g0[r] == 0:
            start[r] = T[i]
        pf = p * ctx0
        T[i] += pf
        busy[i] += pf
        s0[r] = S[i]
        B[i] += 1
        X[i] += extra[r]
        Kc[i] += ctx0 - tps[r] * S[i]
        Kr[i] += tps[r]
        left_steps = max(1, math.ceil((Ls[r] - g0[r]) / tps[r]))
        heapq.heappush(run[i], (S[i] + left_steps, r))
        watch_at(i, r)

    def watch_at(i: int, r: int) -> None:
        """Queue the progress report the policy asks for (a token count) as an instance step."""
        w = sched.watch_tokens(r)
        if w is not None and w < Ls[r]:
            gen = gen_of(r, i)
            if w > gen:
                heapq.heappush(watch[i], (S[i] + max(1, math.ceil((w - gen) / tps[r])), r))

    def fits(i: int, r: int) -> bool:
        return B[i] == 0 or Kc[i] + Kr[i] * S[i] + Ps[r] + g0[r] <= cap

    def fill(i: int) -> bool:
        got = False
        while B[i] < cost.max_batch:
            r = sched.next_for(i)
            if r is None or not fits(i, r):
                break
            sched.started(r, i)
            admit(i, r)
            got = True
        return got

    def remove(j: int, r: int) -> int:
        gen = gen_of(r, j)
        B[j] -= 1
        X[j] -= extra[r]
        Kc[j] -= Ps[r] + g0[r] - tps[r] * s0[r]
        Kr[j] -= tps[r]
        run[j] = [e for e in run[j] if e[1] != r]
        heapq.heapify(run[j])
        watch[j] = [e for e in watch[j] if e[1] != r]
        heapq.heapify(watch[j])
        return gen

    def sync(j: int, t: float) -> None:
        """Advance instance j by the whole decode steps it completes by time t."""
        if B[j] == 0:
            T[j] = max(T[j], t)
            return
        m = steps_by(j, t, next_step(j) - S[j] - 1)
        if m:
            d = dt_steps(j, m)
            T[j] += d
            busy[j] += d
            S[j] += m
        T[j] = max(T[j], t)

    def apply_moves(t: float) -> None:
        mvs = sched.moves()
        if not mvs:
            return
        touched = set()
        for mv in mvs:
            sync(mv.src, t)
            gen = remove(mv.src, mv.rid)
            g0[mv.rid] = gen
            touched.add(mv.src)
            if mv.dst < 0:
                sched.preempted(mv.rid, gen)
                continue
            sync(mv.dst, t)
            sched.migrated(mv, gen)
            admit(mv.dst, mv.rid)
            touched.add(mv.dst)
        for j in touched:
            if B[j] == 0:
                Kc[j], Kr[j], X[j] = 0.0, 0.0, 0.0
            schedule(j)
        # Preempted requests are queued again: instances with free slots take them now.
        for j in range(N) if any(mv.dst < 0 for mv in mvs) else ():
            if B[j] < cost.max_batch and fill(j):
                schedule(j)

    # t = 0: one request per instance in turn, so a central queue is dealt round-robin.
    progress = True
    while progress:
        progress = False
        for i in range(N):
            if B[i] < cost.max_batch:
                r = sched.next_for(i)
                if r is not None and fits(i, r):
                    sched.started(r, i)
                    admit(i, r)
                    progress = True
    for i in range(N):
        schedule(i)
    apply_moves(0.0)

    while events:
        t, v, i = heapq.heappop(events)
        if v != ver[i]:
            continue
        F = next_step(i)
        busy[i] += t - T[i]
        T[i] = t
        S[i] = F
        w = watch[i]
        rearm = []
        while w and w[0][0] <= F:
            _, r = heapq.heappop(w)
            sched.progress(r, gen_of(r, i))
            rearm.append(r)
        h = run[i]
        while h and h[0][0] == F:
            _, r = heapq.heappop(h)
            B[i] -= 1
            X[i] -= extra[r]
            Kc[i] -= Ps[r] + g0[r] - tps[r] * s0[r]
            Kr[i] -= tps[r]
            finish[r] = t
            placed[r] = i
            sched.finished(r, Ls[r])
        for r in rearm:
            if math.isnan(finish[r]):  # still running here: the policy may want a later report
                watch_at(i, r)
        if B[i] == 0:
            Kc[i], Kr[i], X[i] = 0.0, 0.0, 0.0  # no float drift across batches
        fill(i)
        schedule(i)
        apply_moves(t)

    if sched.left:
        raise RuntimeError(f"simulation ended with {sched.left} requests unfinished (a policy starved them)")
    makespan = float(np.nanmax(finish)) if R else 0.0
    k = sched.counters
    return SimResult(makespan, float(sum(busy)), N, finish, placed, start, k.starts, k.migrated, k.stragglers, k.probes)
