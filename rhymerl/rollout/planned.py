"""Rollout by plan: the planner deals the requests up front and each instance generates its share in one call."""

from __future__ import annotations

import time
from typing import Any, Optional

from rhymerl.config import RolloutConfig
from rhymerl.histopipe.planner import Plan, PromptGroup
from rhymerl.rollout.batch import InstanceReport, RolloutBatch, RolloutOutput, Sample, request_seed
from rhymerl.rollout.engine import SamplingSpec
from rhymerl.rollout.metrics import rollout_metrics


class PlannedRollout:
    """``generate(batch)`` on every rank: all instances' samples, the same on every rank."""

    def __init__(self, cfg: RolloutConfig, run_seed: int, comm: Any, engine: Any, placement: Any, planner: Any,
                 predictor: Any, history: Any):
        self.cfg = cfg
        self.run_seed = run_seed
        self.comm = comm
        self.engine = engine
        self.placement = placement
        self.planner = planner
        self.predictor = predictor
        self.history = history

    def generate(self, batch: RolloutBatch) -> RolloutOutput:
        t0 = time.perf_counter()
        groups = [PromptGroup(key=k, index=g, prompt_len=len(p), n=batch.n)
                  for g, (p, k) in enumerate(zip(batch.prompts, batch.keys))]
        plan = self.planner.plan(batch.step, groups, self.predictor, self.history.lengths)
        t_plan = time.perf_counter() - t0
        instance = self.placement.instance
        mine = plan.instances[instance]
        prompts = [batch.prompts[g] for g, _ in mine]
        # Request j of this instance samples with seed base + j: a resumed step replays exactly.
        spec = SamplingSpec.from_config(self.cfg, seed=request_seed(self.run_seed, batch.step, instance, batch.round))
        t1 = time.perf_counter()
        # Siblings share a group id, so HistoSpec drafts from in-flight siblings.
        results = self.engine.generate(prompts, 1, spec, group_ids=[f"{batch.tag}:{g}" for g, _ in mine],
                                       epoch=batch.epoch, record_history=False,
                                       predicted_lengths=self._spec_lengths(plan, mine, batch)) if prompts else []
        t_gen = time.perf_counter() - t1
        local = []
        for (g, s), res in zip(mine, results):
            r = res.responses[0]
            local.append(Sample(group=g, sample_idx=s, prompt_ids=batch.prompts[g], token_ids=list(r.token_ids),
                                logprobs=list(r.logprobs), finish_reason=r.finish_reason))
        # metrics() describes the engine's last batch: an idle instance reports nothing.
        engine_m = self.engine.metrics() if prompts else {}
        report = InstanceReport(engine_steps=int(engine_m.get("engine_steps", 0)),
                                idle_steps=int(engine_m.get("idle_steps", 0)), busy_s=t_gen, engine=engine_m)
        # Every rank of a TP engine holds the same responses: its first rank speaks for it.
        mine_out = (local, report) if self.placement.engine_rank == 0 else None
        gathered = [g for g in self.comm.all_gather_object(mine_out) if g is not None]
        samples = sorted((s for part, _ in gathered for s in part), key=lambda s: (s.group, s.sample_idx))
        reports = [r for _, r in gathered]
        metrics = rollout_metrics(samples, reports, max((r.busy_s for r in reports), default=0.0), plan.predicted)
        metrics["time/plan_s"] = t_plan
        observe_lengths(self.predictor, batch, samples)
        return RolloutOutput(samples, metrics)

    def _spec_lengths(self, plan: Plan, mine: list, batch: RolloutBatch) -> list[Optional[float]]:
        """HistoPipe's predicted length per request where the prompt has history; None elsewhere."""
        return [plan.predicted.get(g) if self.history.has(batch.keys[g]) else None for g, _ in mine]

    def state_dict(self) -> dict:
        return self.planner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.planner.load_state_dict(state)


def observe_lengths(predictor: Any, batch: RolloutBatch, samples: list[Sample]) -> None:
    """The lengths each group drew, into HistoPipe's length predictor."""
    lengths: dict[int, list[int]] = {}
    for s in samples:
        lengths.setdefault(s.group, []).append(len(s.token_ids))
    for g, ls in lengths.items():
        predictor.observe(batch.keys[g], ls)
