"""The rollout scheduler: one state machine, driven by real engines and the simulator alike."""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

from rhymerl.histopipe.cost import DecodeCostModel

QUEUED, RUNNING, DONE = 0, 1, 2
PROBE_RUNG = 1.25  # a running probe reports progress each time it has generated this factor more tokens


def censored_shift(mean: float, var: float, within_var: float, log_x: float) -> float:
    """How far a group's posterior log-mean moves on learning that one sample is longer than exp(``log_x``)."""
    sd = math.sqrt(var + within_var)
    a = (log_x - mean) / sd
    if a > 30.0:
        lam = a + 1.0 / a  # the ratio's asymptote; erfc underflows out here
    else:
        lam = math.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi) / (0.5 * math.erfc(a / math.sqrt(2.0)))
    return var / sd * lam


@dataclass(frozen=True)
class Move:
    """Move running ``rid`` from ``src`` to ``dst`` (re-prefilled there); ``dst`` = -1 requeues it."""

    rid: int
    src: int
    dst: int


@dataclass
class Counters:
    starts: int = 0  # admissions (a migrated request counts twice)
    migrated: int = 0
    stragglers: int = 0
    probes: int = 0
    preempted: int = 0  # running requests a policy sent back to the queue


class Policy:
    """Decides placement, order and runtime correction; the base is a central FIFO (least-loaded)."""

    name = "least_loaded"
    central = True

    def bind(self, sched: "Scheduler") -> None:
        self.s = sched

    def initial_queues(self) -> Optional[list[list[int]]]:
        """Per-instance queues for static policies; None = one central queue."""
        return None

    def key(self, rid: int) -> tuple:
        """Central-queue order (smallest first)."""
        return (rid,)

    def on_start(self, rid: int, instance: int) -> None:
        pass

    def on_progress(self, rid: int, generated: int) -> None:
        pass

    def on_finish(self, rid: int, length: int) -> None:
        pass

    def watch_tokens(self, rid: int) -> Optional[int]:
        """Generated-token count at which the driver should report ``progress`` for rid."""
        return None

    def moves(self) -> list[Move]:
        return []


class StaticPolicy(Policy):
    central = False

    def __init__(self, queues: Sequence[Sequence[int]], name: str = "static"):
        self.name = name
        self._queues = [list(q) for q in queues]

    def initial_queues(self) -> list[list[int]]:
        return self._queues


class PriorityPolicy(Policy):
    """Central queue by a fixed per-request priority (higher first, dataset order on ties)."""

    def __init__(self, priority: Sequence[float], name: str = "priority"):
        self.name = name
        self._prio = [float(p) for p in priority]

    def key(self, rid: int) -> tuple:
        return (-self._prio[rid], rid)


class Scheduler:
    """State of one rollout step: requests 0..R-1 (grouped), ``num_instances`` instances."""

    def __init__(self, num_instances: int, max_batch: int, group_of: Sequence[int], prompt_lens: Sequence[int],
                 policy: Policy):
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.N = num_instances
        self.max_batch = max_batch
        self.group_of = [int(g) for g in group_of]
        self.prompt_lens = [int(p) for p in prompt_lens]
        R = len(self.group_of)
        self.R = R
        ng = (max(self.group_of) + 1) if R else 0
        self.members: list[list[int]] = [[] for _ in range(ng)]
        for r, g in enumerate(self.group_of):
            self.members[g].append(r)
        self.state = [QUEUED] * R
        self.where = [-1] * R  # instance running rid
        self.generated = [0] * R  # last reported progress (tokens)
        self.length = [0] * R  # final length once done
        self.running: list[set[int]] = [set() for _ in range(self.N)]
        self.left = R  # requests not finished
        self.counters = Counters()
        self.policy = policy
        policy.bind(self)
        qs = policy.initial_queues()
        self._queues: Optional[list[deque]] = None
        self._heap: list = []
        self._ver = [0] * R
        if qs is not None:
            if len(qs) != self.N:
                raise ValueError(f"{len(qs)} queues for {self.N} instances")
            seen = [0] * R
            for q in qs:
                for r in q:
                    seen[r] += 1
            bad = next((r for r in range(R) if seen[r] != 1), None)
            if bad is not None:
                raise ValueError(f"request {bad} is dispatched {seen[bad]} times (must be exactly once)")
            self._queues = [deque(q) for q in qs]
            self.queued = R
        else:
            self._heap = [(policy.key(r), r, 0) for r in range(R)]
            heapq.heapify(self._heap)
            self.queued = R

    def requeue_keys(self, rids: Sequence[int]) -> None:
        """Priorities of these queued requests changed (central queue only)."""
        if self._queues is not None:
            return
        for r in rids:
            if self.state[r] == QUEUED:
                self._ver[r] += 1
                heapq.heappush(self._heap, (self.policy.key(r), r, self._ver[r]))

    def peek(self) -> Optional[int]:
        h = self._heap
        while h:
            _, r, v = h[0]
            if self.state[r] == QUEUED and v == self._ver[r]:
                return r
            heapq.heappop(h)
        return None

    def next_for(self, instance: int) -> Optional[int]:
        """The request ``instance`` starts now (it has a free batch slot), or None."""
        if len(self.running[instance]) >= self.max_batch:
            return None
        if self._queues is not None:
            q = self._queues[instance]
            return q[0] if q else None
        return self.peek()

    def started(self, rid: int, instance: int) -> None:
        if self.state[rid] != QUEUED:
            raise ValueError(f"request {rid} started twice")
        self.policy.on_start(rid, instance)
        if self._queues is not None:
            q = self._queues[instance]
            if not q or q[0] != rid:
                raise ValueError(f"request {rid} is not at the front of instance {instance}'s queue")
            q.popleft()
        self.state[rid] = RUNNING
        self.where[rid] = instance
        self.running[instance].add(rid)
        self.queued -= 1
        self.counters.starts += 1

    def progress(self, rid: int, generated: int) -> None:
        if self.state[rid] == RUNNING:
            self.generated[rid] = generated
            self.policy.on_progress(rid, generated)

    def finished(self, rid: int, length: int) -> None:
        if self.state[rid] != RUNNING:
            raise ValueError(f"request {rid} finished but is not running")
        self.running[self.where[rid]].discard(rid)
        self.state[rid] = DONE
        self.length[rid] = length
        self.generated[rid] = length
        self.left -= 1
        self.policy.on_finish(rid, length)

    def migrated(self, move: Move, generated: int) -> None:
        """The driver carried out ``move``: rid left ``src`` with ``generated`` tokens and runs on ``dst``."""
        r = move.rid
        if self.state[r] != RUNNING or self.where[r] != move.src:
            raise ValueError(f"request {r} is not running on instance {move.src}")
        self.running[move.src].discard(r)
        self.running[move.dst].add(r)
        self.where[r] = move.dst
        self.generated[r] = generated
        self.counters.migrated += 1
        self.counters.starts += 1

    def preempted(self, rid: int, generated: int) -> None:
        """The driver took running ``rid`` off its instance with ``generated`` tokens; it is queued again."""
        if self.state[rid] != RUNNING:
            raise ValueError(f"request {rid} is not running")
        if self._queues is not None:
            raise ValueError("static per-instance queues cannot take a preempted request back")
        self.running[self.where[rid]].discard(rid)
        self.where[rid] = -1
        self.state[rid] = QUEUED
        self.generated[rid] = generated
        self.queued += 1
        self.counters.preempted += 1
        self._ver[rid] += 1
        heapq.heappush(self._heap, (self.policy.key(rid), rid, self._ver[rid]))

    def watch_tokens(self, rid: int) -> Optional[int]:
        return self.policy.watch_tokens(rid)

    def moves(self) -> list[Move]:
        """Runtime correction at a scheduling point (after the driver reported progress)."""
        return self.policy.moves()

    def queue_empty(self) -> bool:
        return self.queued == 0


class HistoPipePolicy(Policy):
    """Online-corrected longest-estimated-first with probes and straggler control. ``prior_log[g]``: group
    g's log history estimate, ``hist_var`` its error variance; ``within_var``: log-length spread in a group."""

    name = "histopipe"

    def __init__(self, prior_log: Sequence[float], hist_var: float, within_var: float, cost: DecodeCostModel,
                 probe: bool = True, straggler_z: float = 2.0, migrate: bool = True, max_tokens: Optional[int] = None):
        self.prior_log = [float(x) for x in prior_log]
        self.hist_var = max(1e-4, float(hist_var))
        self.within_var = max(1e-4, float(within_var))
        self.cost = cost
        self.probe = probe
        self.z = straggler_z
        self.migrate = migrate
        self.max_tokens = max_tokens

    @classmethod
    def from_config(cls, cfg, prior_log: Sequence[float], predictor, cost: DecodeCostModel,
                    max_tokens: Optional[int] = None) -> "HistoPipePolicy":
        """From ``HistoPipeConfig`` and a ``LengthPredictor`` (its history error and within-group spread)."""
        rep = predictor.error_report()
        # Before history has been scored, trust it as much as one observed sample.
        hist_var = rep["rmse_log"] ** 2 if rep["groups"] else predictor.within_var
        return cls(prior_log, hist_var, predictor.within_var, cost, straggler_z=cfg.straggler_z, max_tokens=max_tokens)

    def bind(self, sched: Scheduler) -> None:
        super().bind(sched)
        ng = len(sched.members)
        self.obs_n = [0] * ng
        self.obs_sum = [0.0] * ng
        self.est_log = list(self.prior_log[:ng])
        self.base_log = list(self.est_log)  # without the running probe's censored evidence
        self.probe_gen = [0] * ng  # tokens the group's running probe has generated
        self.probe_of = [m[0] if (self.probe and len(m) > 1) else -1 for m in sched.members]
        self.straggling: set[int] = set()  # running requests past their straggler quantile
        self.on_inst = [0] * sched.N  # stragglers per instance
        sched.counters.probes = sum(1 for p in self.probe_of if p >= 0)

    def _update(self, g: int) -> None:
        """Group g's log-mean: prior and observations precision-weighted, plus a running probe's censored evidence."""
        prec = 1.0 / self.hist_var + self.obs_n[g] / self.within_var
        mean = (self.prior_log[g] / self.hist_var + self.obs_sum[g] / self.within_var) / prec
        self.base_log[g] = mean
        x = self.probe_gen[g]
        if x > 0:
            mean += censored_shift(mean, 1.0 / prec, self.within_var, math.log(x))
        if abs(mean - self.est_log[g]) > 1e-3:
            self.est_log[g] = mean
            self.s.requeue_keys(self.s.members[g])

    def estimate(self, g: int) -> float:
        """Expected per-response length of group g now (tokens)."""
        return math.exp(self.est_log[g] + 0.5 * self.within_var)

    def key(self, rid: int) -> tuple:
        g = self.s.group_of[rid]
        # Preempted requests resume first (their tokens are sunk cost), then probes.
        if self.s.generated[rid] > 0:
            return (0, -self.s.generated[rid], g, rid)
        return (1 if rid == self.probe_of[g] else 2, -self.est_log[g], g, rid)

    def on_finish(self, rid: int, length: int) -> None:
        g = self.s.group_of[rid]
        # Only the probe's length is unbiased: the siblings that finish first are the short ones.
        if rid == self.probe_of[g]:
            self.probe_gen[g] = 0
            self.obs_n[g] += 1
            self.obs_sum[g] += math.log(max(1, length))
            self._update(g)
        if rid in self.straggling:
            self.straggling.discard(rid)
            self._leave(rid, self.s.where[rid])

    def _threshold(self, rid: int) -> int:
        g = self.s.group_of[rid]
        # A running probe's own length is not evidence that it is long for its group.
        est = self.base_log[g] if rid == self.probe_of[g] else self.est_log[g]
        t = math.exp(est + self.z * math.sqrt(self.within_var))
        if self.max_tokens:
            t = min(t, 0.9 * self.max_tokens)
        return max(1, int(t))

    def _probe_rung(self, g: int) -> int:
        """Tokens at which group g's probe next counts as evidence (geometric rungs: drivers agree, few re-sorts)."""
        lo = math.exp(self.base_log[g] - math.sqrt(self.hist_var + self.within_var))
        return max(int(lo), int(PROBE_RUNG * self.probe_gen[g]) + 1)

    def watch_tokens(self, rid: int) -> Optional[int]:
        g = self.s.group_of[rid]
        gen = self.s.generated[rid]
        due = []
        if rid == self.probe_of[g]:
            # A rung passed unreported (a probe re-admitted after a move) is due at once.
            due.append(max(self._probe_rung(g), gen + 1))
        if self.migrate and rid not in self.straggling and (t := self._threshold(rid)) > gen:
            due.append(t)
        return min(due) if due else None

    def on_progress(self, rid: int, generated: int) -> None:
        g = self.s.group_of[rid]
        if rid == self.probe_of[g] and generated >= self._probe_rung(g):
            self.probe_gen[g] = generated
            self._update(g)
        if rid in self.straggling or generated < self._threshold(rid):
            return
        s = self.s
        self.straggling.add(rid)
        j = s.where[rid]
        self.on_inst[j] += 1
        s.counters.stragglers += 1
        # A straggler is evidence of a longer group: queued siblings move up.
        if rid != self.probe_of[g] and generated > math.exp(self.est_log[g]):
            self.obs_n[g] += 1
            self.obs_sum[g] += math.log(generated)
            self._update(g)

    def _leave(self, rid: int, inst: int) -> None:
        self.on_inst[inst] -= 1

    def moves(self) -> list[Move]:
        s = self.s
        out: list[Move] = []
        if not self.migrate or not s.queue_empty() or not self.straggling:
            return out
        # Queue empty: stragglers in busy batches move to instances that ran dry.
        c = self.cost
        idle = [i for i in range(s.N) if not s.running[i]]
        if not idle:
            return out
        leaving = [0] * s.N  # moved off each instance by this call (the driver has not yet)
        for r in sorted(self.straggling, key=lambda r: -len(s.running[s.where[r]])):
            if not idle:
                break
            src = s.where[r]
            B = len(s.running[src]) - leaving[src]
            if B <= 1:
                continue  # alone already: nothing to gain
            ctx = s.prompt_lens[r] + s.generated[r]
            others = sum(s.prompt_lens[x] + s.generated[x] for x in s.running[src]) - ctx
            # Remaining tokens of a straggler: about what it has generated (long tails); half is conservative.
            gain = 0.5 * s.generated[r] * (c.b * (B - 1) + c.c * others)
            if gain <= c.prefill_time(ctx):
                continue
            dst = idle.pop()
            leaving[src] += 1
            out.append(Move(r, src, dst))
            self.on_inst[dst] += 1
            self._leave(r, src)
        return out
