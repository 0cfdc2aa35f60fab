"""The rollout scheduler: one state machine over instances, queued requests and running
requests, driven by real engines (``histopipe.live``) and by the cluster simulator
(``histopipe.engine``) alike.

A driver tells the scheduler what happened (``started``, ``progress``, ``finished``,
``migrated``) and asks it what to do (``next_for``: the request an instance starts when a
batch slot frees; ``moves``: running requests to take off one instance and continue on
another). The decisions come from a policy object:

- ``StaticPolicy``: per-instance queues fixed up front, no runtime correction (random
  dispatch of a shuffled batch, round-robin);
- ``PriorityPolicy``: one central queue, the highest-priority request first, to whichever
  instance frees a slot. With priority = dataset order it is least-loaded dispatch; with
  the true lengths it is the oracle's longest-first; ``HistoPipePolicy`` keys it by
  online length estimates;
- ``HistoPipePolicy``: tier 1 = which instance (central queue: an instance that frees a slot
  takes the next request, so no instance idles while work is queued), tier 2 = order
  (longest-estimated first; one probe sample per group runs first, Seer-style: while it
  runs, that it has not finished yet, and once it finishes, its length, update the group's
  estimate, weighted against history by how well history has predicted so far), and tail
  control: once the queue is empty, a request running past its group's straggler quantile
  migrates to an instance that ran dry when the cost model says the re-prefill pays
  (optionally, stragglers are gathered earlier on lanes: instances that run only stragglers,
  in small batches).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

from rhymerl.histopipe.cost import DecodeCostModel

QUEUED, RUNNING, DONE = 0, 1, 2
# A running probe reports its progress each time it has generated this factor more tokens.
PROBE_RUNG = 1.25


def censored_shift(mean: float, var: float, within_var: float, log_x: float) -> float:
    """How far the posterior mean of a group's log-mean length moves, from ``mean`` (prior
    variance ``var``), on learning that one sample (log length = log-mean + N(0,
    ``within_var``)) is longer than exp(``log_x``): E[mu | y > log_x] - mean =
    var / s * lambda((log_x - mean) / s), s^2 = var + within_var, with lambda the inverse
    Mills ratio of the standard normal."""
    sd = math.sqrt(var + within_var)
    a = (log_x - mean) / sd
    if a > 30.0:
        lam = a + 1.0 / a  # the ratio's asymptote; erfc underflows out here
    else:
        lam = math.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi) / (0.5 * math.erfc(a / math.sqrt(2.0)))
    return var / sd * lam


@dataclass(frozen=True)
class Move:
    """Take running request ``rid`` off instance ``src`` and continue it on ``dst`` (its
    prompt and the tokens generated so far are re-prefilled there); ``dst`` = -1 sends it
    back to the central queue (preemption)."""

    rid: int
    src: int
    dst: int


@dataclass
class Counters:
    starts: int = 0  # admissions (a migrated request counts twice)
    migrated: int = 0
    stragglers: int = 0
    probes: int = 0
    preempted: int = 0  # running requests sent back to the queue to free a straggler lane
    lanes: int = 0  # instances turned into straggler lanes


class Policy:
    """Decides placement (tier 1), order (tier 2) and runtime correction. Subclasses
    override what they use; the base is a central FIFO (least-loaded by count)."""

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

    def admit_cap(self, instance: int) -> int:
        return self.s.max_batch

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

    # ------------------------------------------------------------------ queue
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
        if len(self.running[instance]) >= self.policy.admit_cap(instance):
            return None
        if self._queues is not None:
            q = self._queues[instance]
            return q[0] if q else None
        return self.peek()

    # ------------------------------------------------------------------ events
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
        """The driver took running ``rid`` off its instance with ``generated`` tokens; it
        is queued again and continues (prompt + generated re-prefilled) wherever it starts next."""
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
    """Online-corrected longest-estimated-first with probes and straggler control.

    ``prior_log[g]``: log of the history-based length estimate of group g (from the
    ``LengthPredictor``); ``hist_var``: its error variance in log space (how well history
    has predicted so far: large when the policy changes fast, so observations then
    dominate); ``within_var``: the spread of log lengths inside a group.
    """

    name = "histopipe"

    def __init__(self, prior_log: Sequence[float], hist_var: float, within_var: float, cost: DecodeCostModel,
                 probe: bool = True, straggler_z: float = 2.0, lanes: bool = True, migrate: bool = True,
                 lane_batch: int = 8, lane_fraction: float = 0.1, max_tokens: Optional[int] = None):
        self.prior_log = [float(x) for x in prior_log]
        self.hist_var = max(1e-4, float(hist_var))
        self.within_var = max(1e-4, float(within_var))
        self.cost = cost
        self.probe = probe
        self.z = straggler_z
        self.lanes = lanes
        self.lane_batch = lane_batch
        self.lane_fraction = lane_fraction
        self.migrate = migrate
        self.max_tokens = max_tokens

    @classmethod
    def from_config(cls, cfg, prior_log: Sequence[float], predictor, cost: DecodeCostModel,
                    max_tokens: Optional[int] = None) -> "HistoPipePolicy":
        """From ``HistoPipeConfig`` and a ``LengthPredictor`` (its history error and within-group spread)."""
        rep = predictor.error_report()
        # Before history has been scored, trust it as much as one observed sample.
        hist_var = rep["rmse_log"] ** 2 if rep["groups"] else predictor.within_var
        return cls(prior_log, hist_var, predictor.within_var, cost, probe=cfg.probe, straggler_z=cfg.straggler_z,
                   lanes=cfg.lanes, migrate=cfg.migrate, lane_batch=cfg.lane_batch, lane_fraction=cfg.lane_fraction,
                   max_tokens=max_tokens)

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
        self.lane = [False] * sched.N
        self.open_lanes: list[int] = []
        self._incoming = [0] * sched.N
        self._pending: list[Move] = []
        # Lanes pay only with many instances: a lane takes a whole instance's batch.
        self.max_lanes = int(self.lane_fraction * sched.N)
        sched.counters.probes = sum(1 for p in self.probe_of if p >= 0)

    # -- estimates ----------------------------------------------------------------------
    def _update(self, g: int) -> None:
        """Log-mean estimate of group g: the history prior and the observed log lengths,
        precision-weighted, and, while the group's probe runs, the evidence that the probe is
        longer than what it has generated (a censored sample: the long groups, whose probes
        finish last, are recognised while their siblings can still start early)."""
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
        # Only the probe's length is an unbiased sample: the siblings that finish first are
        # the short ones, and learning from them would push the group's long tail back.
        if rid == self.probe_of[g]:
            self.probe_gen[g] = 0
            self.obs_n[g] += 1
            self.obs_sum[g] += math.log(max(1, length))
            self._update(g)
        if rid in self.straggling:
            self.straggling.discard(rid)
            self._leave(rid, self.s.where[rid])

    # -- stragglers ---------------------------------------------------------------------
    def _threshold(self, rid: int) -> int:
        g = self.s.group_of[rid]
        # A running probe's own length is not evidence that it is long for its group.
        est = self.base_log[g] if rid == self.probe_of[g] else self.est_log[g]
        t = math.exp(est + self.z * math.sqrt(self.within_var))
        if self.max_tokens:
            t = min(t, 0.9 * self.max_tokens)
        return max(1, int(t))

    def _probe_rung(self, g: int) -> int:
        """Tokens at which group g's running probe next counts as evidence: geometric rungs
        from one spread below the group's estimate (below that, having run so far says
        little). Rungs, not every report, so the live driver (which reports every round)
        and the simulator (which reports when asked) run the same policy, and a long probe
        re-sorts its siblings a few dozen times, not once per engine step."""
        lo = math.exp(self.base_log[g] - math.sqrt(self.hist_var + self.within_var))
        return max(int(lo), int(PROBE_RUNG * self.probe_gen[g]) + 1)

    def watch_tokens(self, rid: int) -> Optional[int]:
        g = self.s.group_of[rid]
        gen = self.s.generated[rid]
        due = []
        if rid == self.probe_of[g]:
            # A rung passed unreported (a probe re-admitted after a move) is due at once.
            due.append(max(self._probe_rung(g), gen + 1))
        if (self.lanes or self.migrate) and rid not in self.straggling and (t := self._threshold(rid)) > gen:
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
        # A request running past the quantile is evidence of a longer group: siblings
        # still queued move up (Seer: a group's estimate is at least what it has shown).
        if rid != self.probe_of[g] and generated > math.exp(self.est_log[g]):
            self.obs_n[g] += 1
            self.obs_sum[g] += math.log(generated)
            self._update(g)
        if not self.lanes or self.lane[j] or s.queue_empty():
            return
        # Gather stragglers on lanes: instances that run only stragglers, in small batches
        # (fast steps), while everything else runs at full batch elsewhere.
        for k in self.open_lanes:
            if self.on_inst[k] + self._incoming[k] < self.lane_batch:
                self._pending.append(Move(rid, j, k))
                self._incoming[k] += 1
                return
        if len(self.open_lanes) >= self.max_lanes:
            return
        self.lane[j] = True
        self.open_lanes.append(j)
        s.counters.lanes += 1
        for r in s.running[j]:
            if r not in self.straggling:
                self._pending.append(Move(r, j, -1))

    def admit_cap(self, instance: int) -> int:
        return 0 if self.lane[instance] else self.s.max_batch

    def _leave(self, rid: int, inst: int) -> None:
        self.on_inst[inst] -= 1
        if self.lane[inst] and self.on_inst[inst] + self._incoming[inst] == 0:
            self.lane[inst] = False
            self.open_lanes.remove(inst)

    def moves(self) -> list[Move]:
        s = self.s
        out = [m for m in self._pending if s.state[m.rid] == RUNNING and s.where[m.rid] == m.src
               and (m.dst >= 0 or m.rid not in self.straggling)]
        for m in self._pending:
            if m.dst >= 0 and m not in out:
                self._incoming[m.dst] -= 1
        self._pending = []
        for m in out:
            if m.dst >= 0:
                self._incoming[m.dst] -= 1
                if m.rid in self.straggling:
                    self.on_inst[m.dst] += 1
                    self._leave(m.rid, m.src)
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
