"""Discrete-event simulation of one rollout step on a cluster of continuous-batching
instances, with HistoPipe's runtime correction.

Each instance runs up to ``max_batch`` sequences; every decode step advances all of them by
one token and takes ``a + b*B + c*K`` seconds (``DecodeCostModel``). Between two finishes
the batch is fixed and its context grows by B tokens a step, so the time to the next
finish is a closed-form quadratic in the number of steps: events are finishes (and
migrations), never single tokens, which keeps 4096 GPUs x a few hundred thousand
responses in seconds. A newly admitted request stalls its instance for its prefill.
Admission is gated by free batch slots and by the KV tokens in use (``kv_capacity``);
preemption is not modelled (sequences admitted under the cap may grow past it).

Dispatch modes: per-instance ordered queues (static plans), or one central FIFO queue
that instances pull from when a slot frees (least-loaded by count).

Runtime correction (``Runtime``):
- steal (rebalance): whenever an instance has a free slot it starts the queued-not-started
  request with the highest plan priority on *any* instance (its own on ties; queue
  position breaks ties between equal predictions), so a planned instance that runs behind
  hands its queued work to those ahead;
- migrate: a light instance (empty queue, at most max_batch/8 sequences) takes a
  straggler -- a running request whose group is in its last ``straggler_fraction`` and
  which has generated more than ``straggler_threshold`` x its predicted length -- from a
  busier instance, re-prefilling the prompt and the tokens generated so far, when the
  faster steps there repay the re-prefill; checked every ``tick`` simulated seconds;
- defer (only with ``allow_defer``): such a straggler is instead dropped from this step
  and counted (the trainer would finish it next step, off-policy).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from rhymerl.histopipe.cost import DecodeCostModel


@dataclass
class Runtime:
    # Rebalance queued-not-started requests: an instance with a free slot starts the
    # highest-priority queued request of any instance (its own on ties).
    steal: bool = False
    migrate: bool = False
    allow_defer: bool = False
    straggler_fraction: float = 0.1
    straggler_threshold: float = 1.5


@dataclass
class SimResult:
    makespan_s: float
    busy_s: float  # GPU-instance seconds with a non-empty batch (or prefilling)
    num_instances: int
    finish_s: np.ndarray  # per request; NaN for deferred
    placed_on: np.ndarray  # instance each request finished on (-1 deferred)
    start_s: Optional[np.ndarray] = None  # first admission time per request
    starts: int = 0  # admissions (a migrated request counts twice)
    stolen: int = 0
    migrated: int = 0
    deferred: int = 0
    deferred_ids: list = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        if self.makespan_s <= 0:
            return 0.0
        return max(0.0, 1.0 - self.busy_s / (self.num_instances * self.makespan_s))


def simulate(
    cost: DecodeCostModel,
    num_instances: int,
    lengths: Sequence[int],
    prompt_lens: Sequence[int],
    group_of: Sequence[int],
    queues: Optional[Sequence[Sequence[int]]] = None,
    central: Optional[Sequence[int]] = None,
    predicted: Optional[Sequence[float]] = None,
    runtime: Optional[Runtime] = None,
    priority: Optional[Sequence[float]] = None,
) -> SimResult:
    """Simulate; requests are ids 0..R-1. Exactly one of ``queues`` (per instance, in
    admission order) or ``central`` (one FIFO for all) gives the dispatch."""
    if (queues is None) == (central is None):
        raise ValueError("give exactly one of queues= or central=")
    rt = runtime or Runtime()
    N = num_instances
    R = len(lengths)
    Ls = [int(x) for x in lengths]
    Ps = [int(x) for x in prompt_lens]
    grp = [int(x) for x in group_of]
    pred = [float(x) for x in predicted] if predicted is not None else [float(x) for x in Ls]
    if any(L < 1 for L in Ls):
        raise ValueError("every response length must be >= 1 token")
    a, b, c, p = cost.a, cost.b, cost.c, cost.p
    M, cap = cost.max_batch, cost.kv_capacity

    seen = np.zeros(R, dtype=np.int64)
    if queues is not None:
        if len(queues) != N:
            raise ValueError(f"{len(queues)} queues for {N} instances")
        qs = [deque(int(r) for r in q) for q in queues]
        for q in qs:
            for r in q:
                seen[r] += 1
        cq = None
    else:
        qs = [deque() for _ in range(N)]
        cq = deque(int(r) for r in central)
        for r in cq:
            seen[r] += 1
    if R and (seen.min() != 1 or seen.max() != 1):
        bad = int(np.flatnonzero(seen != 1)[0])
        raise ValueError(f"request {bad} is dispatched {int(seen[bad])} times (must be exactly once)")

    prio = [float(x) for x in priority] if priority is not None else pred
    # Heap of queue fronts (lazy): (-priority, tie-break, queue, request). Equal priorities
    # break by dataset order (request id), so with uninformative predictions rebalancing is
    # exactly a global FIFO, i.e. least-loaded by count.
    fronts: list = []
    pos = range(R)
    if rt.steal:
        for i, q in enumerate(qs):
            if q:
                fronts.append((-prio[q[0]], q[0], i, q[0]))
        heapq.heapify(fronts)

    # Groups: members left unfinished, for the straggler rule.
    n_groups = (max(grp) + 1) if R else 0
    left = [0] * n_groups
    for g in grp:
        left[g] += 1
    gsize = list(left)
    # "In the last straggler_fraction of its group": at most ceil(fraction * n) members left.
    tail_k = [max(1, int(math.ceil(rt.straggler_fraction * s - 1e-9))) for s in gsize]

    S = [0] * N  # decode steps done
    T = [0.0] * N  # instance clock
    B = [0] * N
    Kc = [0] * N  # context sum = Kc + B*S
    run: list[list] = [[] for _ in range(N)]
    ver = [0] * N
    busy = [0.0] * N
    where = [-1] * R
    s0 = [0] * R
    g0 = [0] * R
    finish = np.full(R, np.nan)
    start = np.full(R, np.nan)
    placed = np.full(R, -1, dtype=np.int64)
    events: list = []
    light: set[int] = set()  # instances with an empty queue and few running sequences
    light_b = max(0, M // 8)
    moved = [False] * R  # a request migrates at most once
    tail_running: set[int] = set()  # running requests of groups in their tail
    watch = rt.migrate or rt.allow_defer
    members: list[list[int]] = [[] for _ in range(n_groups)]
    if watch:
        for r, g in enumerate(grp):
            members[g].append(r)
    # Light instances re-check for stragglers this often (simulated seconds).
    tick = 2.0
    ticking = [False]
    st = {"starts": 0, "stolen": 0, "migrated": 0, "deferred": 0}
    deferred_ids: list[int] = []

    def dt_steps(i: int, m: int) -> float:
        Bi = B[i]
        return m * (a + b * Bi + c * (Kc[i] + Bi * S[i])) + c * Bi * m * (m - 1) * 0.5

    def steps_by(i: int, t: float) -> int:
        """Whole decode steps instance i completes by time t (without passing its next finish)."""
        Bi = B[i]
        d = t - T[i]
        if Bi == 0 or d <= 0:
            return 0
        base = a + b * Bi + c * (Kc[i] + Bi * S[i])
        q = 0.5 * c * Bi
        lin = base - q
        m = int((-lin + math.sqrt(lin * lin + 4 * q * d)) / (2 * q)) if q > 0 else int(d / base)
        m = min(m, run[i][0][0] - S[i] - 1) if run[i] else m
        return max(0, m)

    def schedule(i: int) -> None:
        ver[i] += 1
        if run[i]:
            heapq.heappush(events, (T[i] + dt_steps(i, run[i][0][0] - S[i]), ver[i], i))

    def admit(i: int, r: int) -> None:
        ctx0 = Ps[r] + g0[r]
        if g0[r] == 0:
            start[r] = T[i]
        pf = p * ctx0
        T[i] += pf
        busy[i] += pf
        s0[r] = S[i]
        where[r] = i
        B[i] += 1
        Kc[i] += ctx0 - S[i]
        heapq.heappush(run[i], (S[i] + Ls[r] - g0[r], r))
        st["starts"] += 1
        if watch and left[grp[r]] <= tail_k[grp[r]]:
            tail_running.add(r)

    def fits(i: int, r: int) -> bool:
        return B[i] == 0 or Kc[i] + B[i] * S[i] + Ps[r] + g0[r] <= cap

    def best_front() -> Optional[tuple[float, int, int]]:
        """Highest-priority queued-not-started request over all queues: (-priority,
        tie-break, queue)."""
        while fronts:
            negp, k, j, r = fronts[0]
            if qs[j] and qs[j][0] == r:
                return negp, k, j
            heapq.heappop(fronts)
        return None

    def push_front(j: int) -> None:
        if qs[j]:
            r = qs[j][0]
            heapq.heappush(fronts, (-prio[r], pos[r], j, r))

    def fill(i: int, limit: int = 1 << 30) -> None:
        q = qs[i]
        while B[i] < M and limit > 0:
            limit -= 1
            if cq is not None:
                if not cq or not fits(i, cq[0]):
                    return
                admit(i, cq.popleft())
                continue
            j = i
            if rt.steal:
                # Rebalancing at a scheduling point: a queued request that should start
                # sooner (by the plan's priority) than this instance's next one moves here.
                bf = best_front()
                if bf is not None and bf[2] != i and (not q or (bf[0], bf[1]) < (-prio[q[0]], pos[q[0]])):
                    j = bf[2]
            if not qs[j]:
                return
            r = qs[j][0]
            if not fits(i, r):
                return
            qs[j].popleft()
            if j != i:
                st["stolen"] += 1
            if rt.steal:
                push_front(j)
            admit(i, r)

    def remove_running(j: int, r: int, t: float) -> int:
        """Take running request r off instance j at time t; return tokens it generated."""
        sync(j, t)
        gen = g0[r] + S[j] - s0[r]
        B[j] -= 1
        Kc[j] -= Ps[r] + g0[r] - s0[r]
        run[j] = [e for e in run[j] if e[1] != r]
        heapq.heapify(run[j])
        tail_running.discard(r)
        where[r] = -1
        return gen

    def sync(j: int, t: float) -> None:
        """Advance instance j by the whole decode steps it completes by time t."""
        if B[j] == 0:
            T[j] = max(T[j], t)
            return
        m = steps_by(j, t)
        if m:
            d = dt_steps(j, m)
            T[j] += d
            busy[j] += d
            S[j] += m

    def correct(t: float) -> None:
        """Scheduling point at time t: light instances (empty queues, few sequences) take
        stragglers (migrate), or with allow_defer the stragglers leave the step."""
        cands = []
        for r in tail_running:
            j = where[r]
            if j < 0 or moved[r]:
                continue
            gen = g0[r] + S[j] - s0[r]  # as of j's last event: cheap, slightly stale
            if gen <= rt.straggler_threshold * pred[r] or gen >= Ls[r]:
                continue
            cands.append((a + b * B[j] + c * (Kc[j] + B[j] * S[j]), r))
        if not cands:
            return
        cands.sort(reverse=True)  # most slowed-down first
        targets = sorted((k for k in light if B[k] <= light_b), key=lambda k: B[k])
        ci = 0
        for i in targets:
            while ci < len(cands):
                src, r = cands[ci]
                ci += 1
                j = where[r]
                if j < 0 or j == i:
                    continue
                if rt.allow_defer:
                    gen = remove_running(j, r, t)
                    schedule(j)
                    st["deferred"] += 1
                    deferred_ids.append(r)
                    left[grp[r]] -= 1
                    break
                sync(i, t)
                gen = g0[r] + S[j] + steps_by(j, t) - s0[r]
                # Expected tokens left: a straggler's remaining length scales with what it
                # has already produced (long-tailed lengths); half of it is a conservative guess.
                ctx = Ps[r] + gen
                dst = a + b * (B[i] + 1) + c * (Kc[i] + B[i] * S[i] + ctx)
                if 0.5 * gen * (src - dst) <= p * ctx:
                    continue
                gen = remove_running(j, r, t)
                schedule(j)
                g0[r] = gen
                moved[r] = True
                st["migrated"] += 1
                admit(i, r)
                schedule(i)
                break
            if ci >= len(cands):
                return

    # t = 0: fill every instance, one request per instance in turn (a central queue is
    # dealt round-robin; planned queues fill in parallel).
    progress = True
    while progress:
        progress = False
        for i in range(N):
            if B[i] >= M:
                continue
            if cq is not None:
                if cq and fits(i, cq[0]):
                    admit(i, cq.popleft())
                    progress = True
            else:
                before = B[i]
                fill(i, limit=1)
                progress = progress or B[i] > before
    def after_fill(i: int) -> None:
        if watch and not qs[i] and (cq is None or not cq) and B[i] <= light_b:
            light.add(i)
            if not ticking[0]:
                ticking[0] = True
                heapq.heappush(events, (T[i], 0, -1))
        else:
            light.discard(i)

    for i in range(N):
        fill(i)
        schedule(i)
    for i in range(N):
        after_fill(i)

    while events:
        t, v, i = heapq.heappop(events)
        if i < 0:  # scheduling tick: light instances look for stragglers past the threshold
            if light and tail_running:
                correct(t)
                heapq.heappush(events, (t + tick, 0, -1))
            else:
                ticking[0] = False
            continue
        if v != ver[i]:
            continue
        F = run[i][0][0]
        busy[i] += t - T[i]
        T[i] = t
        S[i] = F
        h = run[i]
        while h and h[0][0] == F:
            _, r = heapq.heappop(h)
            B[i] -= 1
            Kc[i] -= Ps[r] + g0[r] - s0[r]
            finish[r] = t
            placed[r] = i
            where[r] = -1
            tail_running.discard(r)
            g = grp[r]
            left[g] -= 1
            if left[g] == tail_k[g] and watch:
                # The group just entered its tail: its running members become candidates.
                tail_running.update(x for x in members[g] if where[x] >= 0)
        fill(i)
        schedule(i)
        after_fill(i)

    busy_total = float(sum(busy))
    makespan = float(np.nanmax(finish)) if R and np.isfinite(finish).any() else 0.0
    return SimResult(makespan, busy_total, N, finish, placed, start, st["starts"], st["stolen"], st["migrated"],
                     st["deferred"], deferred_ids)
