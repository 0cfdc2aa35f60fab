"""Runtime side of a HistoPipe plan for the rollout dispatcher: which request an instance
starts next when a batch slot frees, and which running request counts as a straggler.

The simulator's engine applies the same rules (``engine.simulate`` with ``Runtime``);
this class is the trainer-facing form, driven by real completion events.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Optional

from rhymerl.config import HistoPipeConfig
from rhymerl.histopipe.planner import Plan


class PlanDispatcher:
    """Hands out a plan's requests one at a time, each exactly once.

    ``next_for(i)`` returns instance i's own next request, unless a request queued on
    another instance has a higher priority (its predicted length, negated on ascending
    steps of the paper's tier 2); ties go to the own queue, then to dataset order. This is
    the "rebalance queued-not-started requests at each scheduling point" rule: an instance
    that runs behind its plan hands its queued work to the ones ahead.
    """

    def __init__(self, plan: Plan, rebalance: bool = True, ascending: Optional[bool] = None):
        asc = plan.info.get("ascending", False) if ascending is None else ascending
        sign = -1.0 if asc else 1.0
        self._prio = {g: sign * p for g, p in plan.predicted.items()}
        self._queues = [deque(inst) for inst in plan.instances]
        seen = set()
        for q in self._queues:
            for r in q:
                if r in seen:
                    raise ValueError(f"request {r} appears twice in the plan")
                seen.add(r)
        self._left = len(seen)
        self.rebalance = rebalance
        self.moved = 0
        self._fronts: list = []
        for i, q in enumerate(self._queues):
            self._push(i)

    def _key(self, r: tuple[int, int]) -> tuple[float, int, int]:
        return (-self._prio.get(r[0], 0.0), r[0], r[1])

    def _push(self, i: int) -> None:
        if self._queues[i]:
            r = self._queues[i][0]
            heapq.heappush(self._fronts, (self._key(r), i, r))

    def _best(self):
        while self._fronts:
            key, i, r = self._fronts[0]
            if self._queues[i] and self._queues[i][0] == r:
                return key, i
            heapq.heappop(self._fronts)
        return None

    def next_for(self, instance: int) -> Optional[tuple[int, int]]:
        if not 0 <= instance < len(self._queues):
            raise ValueError(f"instance {instance} is not in the plan (0..{len(self._queues) - 1})")
        own = self._queues[instance]
        j = instance
        if self.rebalance:
            best = self._best()
            if best is not None and best[1] != instance and (not own or best[0][0] < self._key(own[0])[0]):
                j = best[1]
        if not self._queues[j]:
            return None
        r = self._queues[j].popleft()
        if j != instance:
            self.moved += 1
        self._push(j)
        self._left -= 1
        return r

    def pending(self) -> int:
        return self._left


def is_straggler(cfg: HistoPipeConfig, generated: int, predicted: float, group_left: int, group_n: int) -> bool:
    """A running response is a straggler when its group is in its last
    ``straggler_fraction`` (at most ceil(fraction * n) members unfinished) and it has
    generated more than ``straggler_threshold`` x its predicted length."""
    tail = max(1, math.ceil(cfg.straggler_fraction * group_n - 1e-9))
    return group_left <= tail and generated > cfg.straggler_threshold * predicted
