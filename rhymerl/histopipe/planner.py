"""Two-tier rollout planner: LPT balancing of predicted instance time, then longest-predicted first."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from rhymerl.histopipe.cost import DecodeCostModel

@dataclass(frozen=True)
class PromptGroup:
    key: int  # history-store key of the prompt
    index: int  # position in the step's batch
    prompt_len: int
    n: int  # responses to sample


@dataclass
class Plan:
    instances: list[list[tuple[int, int]]]  # per instance, ordered (group index, sample idx)
    predicted: dict[int, float]  # per-response length by group index
    info: dict = field(default_factory=dict)

    def requests(self) -> list[tuple[int, int]]:
        return [r for inst in self.instances for r in inst]


def check_groups(groups: Sequence[PromptGroup]) -> None:
    seen = set()
    for g in groups:
        if g.n < 1:
            raise ValueError(f"prompt group {g.index} (key {g.key}) has n={g.n}; n must be >= 1")
        if g.index in seen:
            raise ValueError(f"prompt group index {g.index} appears twice in the step")
        seen.add(g.index)


class NoopPlanner:
    """Baseline: groups dealt round-robin to instances in dataset order, samples together."""

    def __init__(self, num_instances: int, *_args, **_kwargs):
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        self.num_instances = num_instances

    def plan(self, step: int, groups: Sequence[PromptGroup], predictor=None, history=None) -> Plan:
        check_groups(groups)
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.num_instances)]
        for i, g in enumerate(groups):
            out[i % self.num_instances].extend((g.index, s) for s in range(g.n))
        return Plan(out, {}, {"planner": "noop"})

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass


def lpt(works: Sequence[float], bins: int, base: Optional[Sequence[float]] = None) -> tuple[list[int], list[float]]:
    """Longest-processing-time-first: unit -> bin, and the bins' loads."""
    order = sorted(range(len(works)), key=lambda u: -works[u])
    loads = list(base) if base is not None else [0.0] * bins
    heap = [(loads[b], b) for b in range(bins)]
    heapq.heapify(heap)
    where = [0] * len(works)
    for u in order:
        load, b = heapq.heappop(heap)
        load += works[u]
        loads[b] = load
        where[u] = b
        heapq.heappush(heap, (load, b))
    return where, loads


class HistoPipePlanner:
    def __init__(self, num_instances: int, max_batch: int, cost: Optional[DecodeCostModel] = None):
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        self.num_instances = num_instances
        self.cost = cost or DecodeCostModel.for_instance(max_batch=max_batch)
        if self.cost.max_batch != max_batch:
            self.cost = DecodeCostModel(**{**self.cost.to_dict(), "max_batch": max_batch})
        self.last_step: Optional[int] = None
        self.plans_made = 0
        self.splits = 0

    def plan(self, step: int, groups: Sequence[PromptGroup], predictor,
             history: Callable[[int], Optional[list[list[int]]]]) -> Plan:
        check_groups(groups)
        predicted = {g.index: predictor.predict(g.key, history(g.key)) for g in groups}
        return self.plan_lengths(step, groups, predicted)

    def plan_lengths(self, step: int, groups: Sequence[PromptGroup], predicted: dict[int, float]) -> Plan:
        """Plan from given per-group predicted lengths (the simulator's oracle passes truths)."""
        check_groups(groups)
        self.last_step = step
        self.plans_made += 1
        _, per_bin, info = self._assign(groups, predicted, self.num_instances)
        return Plan(self._order(per_bin, predicted), dict(predicted), info)

    def _units(self, groups: Sequence[PromptGroup], predicted: dict[int, float], bins: int, split: bool):
        """Work units: (group, samples, work). Split only groups above half a bin's share."""
        cm = self.cost
        per_req = {g.index: cm.request_work(predicted[g.index], g.prompt_len, prefill=False) for g in groups}
        units = []
        if split:
            total = sum(per_req[g.index] * g.n for g in groups)
            share = total / bins
        for g in groups:
            w = per_req[g.index]
            pre = cm.prefill_time(g.prompt_len)
            k = 1
            if split and g.n > 1 and w * g.n > 0.5 * share:
                k = min(g.n, max(2, math.ceil(w * g.n / (0.25 * share))))
            bounds = [round(j * g.n / k) for j in range(k + 1)]
            for j in range(k):
                samples = range(bounds[j], bounds[j + 1])
                units.append((g, samples, w * len(samples) + pre))
        return units

    def _assign(self, groups, predicted, bins: int) -> tuple[list, list[list[tuple]], dict]:
        """Tier-1 assignment of ``groups`` to ``bins`` instances: per bin, a list of units."""
        candidates = [("keep", self._units(groups, predicted, bins, split=False)),
                      ("split", self._units(groups, predicted, bins, split=True))]
        best = None
        for name, units in candidates:
            where, loads = lpt([u[2] for u in units], bins)
            score = max(loads) if loads else 0.0
            # "split" must win clearly: keeping a group costs nothing at runtime.
            if best is None or score < best[0] * (0.99 if name == "split" else 1.0):
                best = (score, name, units, where, loads)
        score, name, units, where, loads = best
        per_bin: list[list[tuple]] = [[] for _ in range(bins)]
        for u, b in zip(units, where):
            per_bin[b].append(u)
        if name == "split" and len(units) > len(groups):
            self.splits += len(units) - len(groups)
        return loads, per_bin, {"grouping": name, "units": len(units), "predicted_max_load_s": score}

    @staticmethod
    def _order(per_bin_units, predicted) -> list[list[tuple[int, int]]]:
        """Longest predicted first on every instance."""
        out = []
        for units in per_bin_units:
            units = sorted(units, key=lambda u: (predicted[u[0].index], -u[0].index), reverse=True)
            out.append([(u[0].index, s) for u in units for s in u[1]])
        return out

    def state_dict(self) -> dict:
        return {"last_step": self.last_step, "plans_made": self.plans_made, "splits": self.splits}

    def load_state_dict(self, d: dict) -> None:
        self.last_step = d.get("last_step")
        self.plans_made = int(d.get("plans_made", 0))
        self.splits = int(d.get("splits", 0))
