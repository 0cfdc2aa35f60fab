"""Two-tier rollout planner: which instance runs which request (tier 1), in which order
(tier 2).

Tier 1 balances *predicted instance time* (the decode cost model, not token counts)
with longest-processing-time-first list scheduling. A GRPO group is one unit when that
balances well enough (its n samples then share one prompt prefill through prefix
caching); groups too big for one instance's share are split into chunks. With
``split_groups="auto"`` both plans are costed and the cheaper one is kept.

Tier 2 has two variants (``tier2``):
- ``"lpf"`` (default, the measured winner): longest-predicted-first admission on every
  instance, so the longest responses start at t=0 and the batch is refilled with ever
  shorter ones until the end.
- ``"paper"``: RhymeRL's scheme. Prompts are ranked by predicted length into
  ``num_groups`` length groups; each length group gets its own set of instances, sized by
  binary search over the groups' time curves so that their finish times line up (long
  groups get more instances); inside an instance requests run in ascending length order on
  odd steps and descending on even steps.
The trainer dispatches this plan statically; the simulator schedules with
``scheduler.HistoPipePolicy`` (live dispatch through it is not wired into the trainer yet).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from rhymerl.config import HistoPipeConfig
from rhymerl.histopipe.cost import DecodeCostModel

TIER2_VARIANTS = ("lpf", "paper")


@dataclass(frozen=True)
class PromptGroup:
    key: int  # history-store key of the prompt
    index: int  # position in the step's batch
    prompt_len: int
    n: int  # responses to sample


@dataclass
class Plan:
    # Per instance, the ordered (group index, sample idx) requests it runs.
    instances: list[list[tuple[int, int]]]
    # Predicted per-response length of each group, by group index.
    predicted: dict[int, float]
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
    def __init__(
        self,
        cfg: HistoPipeConfig,
        num_instances: int,
        max_batch: int,
        cost: Optional[DecodeCostModel] = None,
        tier2: Optional[str] = None,
    ):
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        if cfg.num_groups < 1:
            raise ValueError(f"histopipe.num_groups must be >= 1, got {cfg.num_groups}")
        self.cfg = cfg
        self.num_instances = num_instances
        self.cost = cost or DecodeCostModel.for_instance(max_batch=max_batch)
        if self.cost.max_batch != max_batch:
            self.cost = DecodeCostModel(**{**self.cost.to_dict(), "max_batch": max_batch})
        self.tier2 = tier2 or getattr(cfg, "tier2", "lpf")
        if self.tier2 not in TIER2_VARIANTS:
            raise ValueError(f"histopipe.tier2 must be one of {TIER2_VARIANTS}, got {self.tier2!r}")
        self.last_step: Optional[int] = None
        self.plans_made = 0
        self.splits = 0

    # ------------------------------------------------------------------ entry points
    def plan(
        self,
        step: int,
        groups: Sequence[PromptGroup],
        predictor,
        history: Callable[[int], Optional[list[list[int]]]],
    ) -> Plan:
        check_groups(groups)
        predicted = {g.index: predictor.predict(g.key, history(g.key)) for g in groups}
        return self.plan_lengths(step, groups, predicted)

    def plan_lengths(self, step: int, groups: Sequence[PromptGroup], predicted: dict[int, float]) -> Plan:
        """Plan from given per-group predicted lengths (the simulator's oracle passes truths)."""
        check_groups(groups)
        self.last_step = step
        self.plans_made += 1
        if self.tier2 == "paper":
            instances, info = self._plan_paper(step, groups, predicted)
        else:
            instances, info = self._plan_lpf(groups, predicted)
        info["tier2"] = self.tier2
        return Plan(instances, dict(predicted), info)

    # ------------------------------------------------------------------ tier 1
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
        mode = self.cfg.split_groups
        candidates = []
        if mode in ("auto", "never"):
            candidates.append(("keep", self._units(groups, predicted, bins, split=False)))
        if mode in ("auto", "always"):
            candidates.append(("split", self._units(groups, predicted, bins, split=True)))
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

    # ------------------------------------------------------------------ tier 2
    @staticmethod
    def _order(per_bin_units, predicted, descending: bool) -> list[list[tuple[int, int]]]:
        out = []
        for units in per_bin_units:
            units = sorted(units, key=lambda u: (predicted[u[0].index], -u[0].index), reverse=descending)
            out.append([(u[0].index, s) for u in units for s in u[1]])
        return out

    def _plan_lpf(self, groups, predicted):
        _, per_bin, info = self._assign(groups, predicted, self.num_instances)
        return self._order(per_bin, predicted, descending=True), info

    def group_time(self, lengths: Sequence[float], prompt_lens: Sequence[float], n_each: Sequence[int], workers: int) -> float:
        """Profiled time curve of one length group on ``workers`` instances: its work split
        evenly, bounded below by its longest response's span."""
        cm = self.cost
        total_req = sum(n_each)
        occ = min(cm.max_batch, max(1.0, total_req / workers))
        work = sum(n * cm.request_work(L, P, occ) for L, P, n in zip(lengths, prompt_lens, n_each))
        i = max(range(len(lengths)), key=lambda j: lengths[j])
        mean_ctx = sum(n * (P + 0.5 * L) for L, P, n in zip(lengths, prompt_lens, n_each)) / total_req
        return max(work / workers, cm.solo_time(lengths[i], prompt_lens[i], occ, mean_ctx))

    def allocate_workers(self, length_groups: list[list[PromptGroup]], predicted) -> list[int]:
        """Instances per length group: the smallest common finish time T (binary search)
        such that every group meets T with the instances it needs, summing to at most N."""
        N = self.num_instances
        G = len(length_groups)
        curves = []
        for lg in length_groups:
            args = ([predicted[g.index] for g in lg], [g.prompt_len for g in lg], [g.n for g in lg])
            curves.append(lambda w, a=args: self.group_time(*a, w))

        def need(T: float) -> Optional[list[int]]:
            ws = []
            for f in curves:
                lo, hi = 1, N
                if f(hi) > T:
                    return None
                while lo < hi:  # time curves are non-increasing in workers
                    mid = (lo + hi) // 2
                    if f(mid) <= T:
                        hi = mid
                    else:
                        lo = mid + 1
                ws.append(lo)
            return ws if sum(ws) <= N else None

        lo = max(f(N) for f in curves)
        hi = max(f(max(1, N // G)) for f in curves)
        if need(hi) is None:
            hi = max(f(1) for f in curves)
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            if need(mid) is None:
                lo = mid
            else:
                hi = mid
        ws = need(hi) or [max(1, N // G)] * G
        # Spare instances go, one at a time, to the group that then finishes last.
        while sum(ws) < N:
            j = max(range(G), key=lambda k: curves[k](ws[k]))
            ws[j] += 1
        while sum(ws) > N:  # only reachable with G > N, which _plan_paper prevents
            j = max(range(G), key=lambda k: ws[k])
            ws[j] -= 1
        return ws

    def _plan_paper(self, step, groups, predicted):
        N = self.num_instances
        G = max(1, min(self.cfg.num_groups, N, len(groups)))
        ranked = sorted(groups, key=lambda g: (predicted[g.index], g.index))
        bounds = [round(j * len(ranked) / G) for j in range(G + 1)]
        length_groups = [ranked[bounds[j]:bounds[j + 1]] for j in range(G)]
        ws = self.allocate_workers(length_groups, predicted) if G > 1 else [N]
        per_bin: list[list[tuple]] = []
        for lg, w in zip(length_groups, ws):
            _, bins, _ = self._assign(lg, predicted, w)
            per_bin.extend(bins)
        # Odd steps short-to-long, even steps long-to-short: one step's long tail meets the
        # next step's short head.
        descending = step % 2 == 0
        return self._order(per_bin, predicted, descending), {"workers_per_length_group": ws, "ascending": not descending}

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        return {"last_step": self.last_step, "plans_made": self.plans_made, "splits": self.splits, "tier2": self.tier2}

    def load_state_dict(self, d: dict) -> None:
        self.last_step = d.get("last_step")
        self.plans_made = int(d.get("plans_made", 0))
        self.splits = int(d.get("splits", 0))
