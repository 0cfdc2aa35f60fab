"""The synchronous, on-policy RL step loop, and nothing else.

plan (HistoPipe) -> rollout (vLLM + HistoSpec) -> reward -> advantages -> train
-> reshard weights into the engine -> log -> checkpoint.

Every rank runs this loop. Each rank owns one colocated rollout engine (a rollout
instance); the step's requests are split across instances by the planner, the
results are all-gathered so that every rank trains on the same full batch (the
backend takes its data-parallel share), and the updated weights are streamed from
the training backend into every engine.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from rhymerl.distributed.collectives import WorldComm
from rhymerl.config import RunConfig, fingerprint, to_dict
from rhymerl.data import EpochSampler, PromptRecord, few_shot_pool, load_records, render_prompt
from rhymerl.histospec.proposer import STAT_COUNTS, add_stat_fractions

log = logging.getLogger("rhymerl.trainer")

RESHARD_BUCKET_BYTES = 64 << 20


@dataclass
class Sample:
    """One response of one prompt group in a step."""

    group: int               # index into the step's prompt list
    sample_idx: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str = ""
    reward: float = 0.0
    correct: bool = False
    reward_error: bool = False
    reward_timeout: bool = False


@dataclass
class StepOutput:
    step: int
    epoch: int
    metrics: dict
    samples: list[Sample] = field(default_factory=list)


def request_seed(run_seed: int, step: int, instance: int, offset: int) -> int:
    """A sampling seed that depends only on (run seed, step, instance): resume replays a step."""
    return zlib.crc32(f"{run_seed}:{step}:{instance}:{offset}".encode()) & 0x3FFFFFFF


class Trainer:
    """Holds the run's components; ``run()`` executes steps until the budget is spent."""

    def __init__(self, cfg: RunConfig, comm: WorldComm, groups: Any, backend_checkpoint: Optional[Path] = None):
        """``backend_checkpoint``: a checkpoint's backend folder to resume the policy from, loaded
        before the engine is built (loading may bring optimizer state back onto the device)."""
        from transformers import AutoTokenizer

        from rhymerl.config import validate
        from rhymerl.histopipe import HistoPipePlanner, LengthPredictor, NoopPlanner
        from rhymerl.histospec import HistoryStore
        from rhymerl.models import check_model_use, model_shape, resolve_model
        from rhymerl.rewards import RewardPool
        from rhymerl.rollout import RolloutEngine
        from rhymerl.training import build_backend

        self.cfg = cfg
        self.comm = comm
        self.groups = groups
        self.run_dir = Path(cfg.run.output_dir)
        self.model_path = resolve_model(cfg.model) if comm.rank == 0 else None
        comm.barrier()
        if self.model_path is None:
            self.model_path = resolve_model(cfg.model)
        shape = model_shape(self.model_path)
        self.dp_size = validate(cfg, shape, world_size=comm.world_size)
        check_model_use(self.model_path, cfg.parallel.backend, cfg.data.chat_template)
        from rhymerl.distributed.memory_plan import check_run

        check_run(cfg, self.model_path, comm.world_size, groups.device)

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self.records: list[PromptRecord] = load_records(cfg.data)
        shots = few_shot_pool(self.records, cfg.data.few_shot, cfg.data.seed)
        self.prompt_ids = [render_prompt(r, shots[r.id], self.tokenizer, cfg.data) for r in self.records]
        from rhymerl.histospec import prompt_key

        self.prompt_keys = [prompt_key(p) for p in self.prompt_ids]
        self.sampler = EpochSampler(len(self.records), cfg.data.prompts_per_step, cfg.run.seed, cfg.data.shuffle)

        self.history_budget = _history_budget(cfg, len(self.records))
        # The engine samples from the model's vocabulary, which may be padded past the tokenizer's.
        vocab = max(len(self.tokenizer), shape.vocab_size)
        self.history = HistoryStore(cfg.histospec, vocab_size=vocab, token_budget=self.history_budget)
        self.predictor = LengthPredictor(cfg.histopipe, cfg.rollout.max_tokens)
        # One rollout instance per rollout.tensor_parallel consecutive ranks (one vLLM engine
        # across them); every rank of an instance runs the same requests.
        from rhymerl.rollout.placement import engine_placement

        rtp = cfg.rollout.tensor_parallel
        self.placement = engine_placement(comm.world_size, comm.rank, int(os.environ.get("LOCAL_RANK", "0")), rtp,
                                    ranks_per_node=_ranks_per_node())
        self.num_instances, self.instance, self.engine_rank = (self.placement.num_instances, self.placement.instance,
                                                               self.placement.engine_rank)
        if cfg.histopipe.enabled:
            self.planner = HistoPipePlanner(cfg.histopipe, self.num_instances, cfg.rollout.max_num_seqs)
        else:
            self.planner = NoopPlanner(self.num_instances)
        from rhymerl.histopipe.live import unused_keys

        # The live driver moves requests between engines, one per rank: with a single instance
        # there is nothing to move, and a TP engine spans ranks; both are dispatched per call.
        self.live_dispatch = (cfg.histopipe.enabled and cfg.histopipe.live and rtp == 1 and self.num_instances > 1)
        for key in unused_keys(cfg.histopipe, self.live_dispatch):
            log.warning("%s is set but not used (histopipe.enabled=%s, live dispatch=%s)", key,
                        cfg.histopipe.enabled, self.live_dispatch)

        # Log-probs at the sampling temperature: the distribution the responses came from.
        temp = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.backend = build_backend(cfg.parallel, cfg.algo, self.model_path, groups, dtype=cfg.model.dtype,
                                     seed=cfg.run.seed, temperature=temp)
        if comm.rank == 0 and cfg.parallel.backend == "megatron" and cfg.parallel.autocast != "none":
            log.info("training: parallel.autocast=%s: the layers' matmuls run in %s%s, weights and optimizer "
                     "in %s", cfg.parallel.autocast, self.backend.matmul_dtype_name,
                     "" if self.backend.autocast_dtype else " (no native bfloat16 matmuls on this host)",
                     cfg.model.dtype)
        if backend_checkpoint is not None:
            self.backend.load_checkpoint(backend_checkpoint)
        self.ref_backend = None
        if cfg.algo.kl_coef > 0:
            # A frozen copy of the initial policy (no optimizer): its log-probs are the KL reference.
            self.ref_backend = build_backend(cfg.parallel, cfg.algo, self.model_path, groups, dtype=cfg.model.dtype,
                                             seed=cfg.run.seed, temperature=temp, train=False)
        from rhymerl.outputs.progress import PhaseProgress

        # Rank 0's live lines inside the long phases; the other ranks keep their logs quiet.
        self.progress = PhaseProgress(interval_s=cfg.tracking.progress_interval_s,
                                      enabled=comm.rank == 0 and cfg.tracking.console != "none"
                                      and cfg.tracking.progress_interval_s > 0)
        self.backend.progress = self.progress
        train_threads = torch.get_num_threads()
        from rhymerl.distributed.colocation import Colocation
        from rhymerl.distributed.devices import free_memory_probe, host_heap_trimmer

        on_cpu = groups.device.type == "cpu"
        self.colocation = Colocation(self.backend, cfg.rollout.sleep_level, references=[self.ref_backend],
                                     device_free_bytes=free_memory_probe(groups.device),
                                     trim_heap=host_heap_trimmer() if on_cpu else None)
        # What training alone needs leaves the device before vLLM checks its free memory.
        self.colocation.before_engine_build()
        self.engine = RolloutEngine(cfg.rollout, cfg.histospec, self.model_path, seed=cfg.run.seed + self.instance,
                                    progress=self.progress if comm.rank == 0 else None,
                                    history=self.history, dtype=cfg.model.dtype,
                                    cpu_kv_cache_bytes=self._cpu_kv_cache_bytes(), placement=self.placement)
        # The engine decodes with the process's threads; were its threads ever fewer, training
        # would get its own back.
        if on_cpu:
            self.colocation.share_cpu_threads(train_threads, self.engine.cpu_threads or train_threads)
        self.colocation.attach_engine(self.engine)
        self.rewards = self._start_rewards(RewardPool)
        from rhymerl.algorithms import DynamicSamplingBuffer

        self.ds_buffer = DynamicSamplingBuffer.from_config(cfg.algo, cfg.data.prompts_per_step) \
            if cfg.algo.dynamic_sampling else None
        self.step = 0
        self.last_batch_records: list[PromptRecord] = []

    def _start_rewards(self, pool_cls):
        """Rank 0's reward pool, its workers started (scorer imports checked) before the first
        step; a scorer that cannot load stops every rank with rank 0's message."""
        from rhymerl.rewards.pool import RewardSetupError

        pool, err = None, None
        if self.comm.rank == 0:
            try:
                pool = pool_cls(self.cfg.reward, start_method=self.cfg.reward.start_method)
                pool.wait_ready()
            except RewardSetupError as e:
                err = str(e)
        err = self.comm.broadcast_object(err)
        if err is not None:
            raise RewardSetupError(err)
        return pool

    def _cpu_kv_cache_bytes(self) -> int:
        """What a CPU engine's KV cache needs for one step of this run (its memory is resident)."""
        import json

        from rhymerl.distributed.memory_plan import cpu_kv_cache_bytes
        from rhymerl.resharding.layout import ModelLayout

        layout = ModelLayout.from_hf_config(json.loads((Path(self.model_path) / "config.json").read_text()))
        cfg = self.cfg
        return cpu_kv_cache_bytes(layout, cfg.rollout, cfg.model.dtype, cfg.data.prompts_per_step * cfg.rollout.n,
                                  max(len(p) for p in self.prompt_ids))

    # ------------------------------------------------------------------ state

    def state_blobs(self) -> dict[str, Any]:
        """Everything but the backend's weights/optimizer, for the checkpoint."""
        return {
            "step": self.step,
            "sampler": self.sampler.state_dict(),
            "history": self.history.to_bytes(),
            "predictor": self.predictor.state_dict(),
            "planner": self.planner.state_dict(),
            "ds_buffer": self.ds_buffer.state_dict() if self.ds_buffer is not None else None,
            "config": to_dict(self.cfg),
            "config_fingerprint": fingerprint(self.cfg),
        }

    def load_state_blobs(self, blobs: dict[str, Any]) -> None:
        from rhymerl.histospec import HistoryStore

        self.step = int(blobs["step"])
        self.sampler.load_state_dict(blobs["sampler"])
        self.history = HistoryStore.from_bytes(blobs["history"], self.cfg.histospec, token_budget=self.history_budget)
        self.engine.set_history(self.history)
        self.predictor.load_state_dict(blobs["predictor"])
        self.planner.load_state_dict(blobs["planner"])
        if self.ds_buffer is not None and blobs.get("ds_buffer") is not None:
            self.ds_buffer.load_state_dict(blobs["ds_buffer"])

    # ------------------------------------------------------------------ phases

    def _rollout(self, batch_indices: list[int], epoch: int, round_: int = 0) -> tuple[list[Sample], dict]:
        """Plan and generate this step's responses on every instance; returns all samples (every rank).

        ``round_`` numbers DAPO's refill batches within the step: each samples with its own seeds
        and sibling-group ids (a refill that draws the same prompts must not replay round 0)."""
        from rhymerl.histopipe import PromptGroup
        from rhymerl.rollout import SamplingSpec

        cfg = self.cfg
        if self.live_dispatch:
            from rhymerl.histopipe.live import trainer_rollout

            return trainer_rollout(self, batch_indices, epoch, round_)
        t0 = time.perf_counter()
        groups = [PromptGroup(key=self.prompt_keys[i], index=g, prompt_len=len(self.prompt_ids[i]), n=cfg.rollout.n)
                  for g, i in enumerate(batch_indices)]
        history_lengths = lambda key: self.history.lengths(key) if self.history.has(key) else None  # noqa: E731
        plan = self.planner.plan(self.step, groups, self.predictor, history_lengths)
        t_plan = time.perf_counter() - t0

        mine = plan.instances[self.instance]
        prompts = [self.prompt_ids[batch_indices[g]] for g, _ in mine]
        # Request j of this instance samples with seed base + j: a resumed step replays exactly.
        spec = SamplingSpec(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                            max_tokens=cfg.rollout.max_tokens,
                            seed=request_seed(cfg.run.seed, self.step, self.instance, round_))
        t1 = time.perf_counter()
        # Siblings of a group share a group id, so HistoSpec can draft from in-flight siblings.
        # An instance without requests does not step: each instance generates on its own.
        gid = f"{self.step}:" if round_ == 0 else f"{self.step}.{round_}:"
        results = self.engine.generate(prompts, 1, spec, group_ids=[f"{gid}{g}" for g, _ in mine], epoch=epoch,
                                       record_history=False, predicted_lengths=self._spec_lengths(plan, mine, batch_indices)
                                       ) if prompts else []
        t_gen = time.perf_counter() - t1
        local = []
        for (g, s), res in zip(mine, results):
            r = res.responses[0]
            local.append(Sample(group=g, sample_idx=s, prompt_ids=self.prompt_ids[batch_indices[g]],
                                token_ids=list(r.token_ids), logprobs=list(r.logprobs), finish_reason=r.finish_reason,
                                text=self.tokenizer.decode(r.token_ids, skip_special_tokens=True)))
        # metrics() describes the engine's last generate() call: an idle instance reports nothing.
        engine_metrics = self.engine.metrics() if prompts else {}
        # Every rank of a TP engine holds the same responses: its first rank speaks for it.
        mine_out = (local, engine_metrics, t_gen) if self.engine_rank == 0 else None
        gathered = [g for g in self.comm.all_gather_object(mine_out) if g is not None]
        samples = sorted((s for part, _, _ in gathered for s in part), key=lambda s: (s.group, s.sample_idx))
        per_instance_s = [t for _, _, t in gathered]

        spec_m = _sum_engine_metrics([m for _, m, _ in gathered])
        actual = {}
        for s in samples:
            actual.setdefault(s.group, []).append(len(s.token_ids))
        pred = np.array([plan.predicted.get(g, np.nan) for g in sorted(actual)], dtype=float)
        act = np.array([np.mean(actual[g]) for g in sorted(actual)], dtype=float)
        ok = ~np.isnan(pred)
        makespan = max(per_instance_s) if per_instance_s else 0.0
        metrics = {
            "time/plan_s": t_plan,
            "time/rollout_s": time.perf_counter() - t1,
            "histopipe/pred_len_mean": float(np.mean(pred[ok])) if ok.any() else float("nan"),
            "histopipe/actual_len_mean": float(np.mean(act)),
            "histopipe/pred_abs_err": float(np.mean(np.abs(pred[ok] - act[ok]))) if ok.any() else float("nan"),
            # Idle instance-seconds over total instance-seconds: the cross-instance bubble.
            "histopipe/bubble_fraction": float(1 - sum(per_instance_s) / (makespan * len(per_instance_s)))
            if makespan > 0 else 0.0,
            **{f"histospec/{k}": v for k, v in spec_m.items()},
            "rollout/responses": len(samples),
            "rollout/generated_tokens": sum(len(s.token_ids) for s in samples),
            # Engines that answered (one per rollout.tensor_parallel ranks).
            "rollout/instances": len(gathered),
        }
        # Each instance steps for its own requests only: its steps and seconds, side by side.
        for i, (_, m, t) in enumerate(gathered):
            metrics[f"rollout/engine_steps/{i}"] = int(m.get("engine_steps", 0))
            metrics[f"rollout/instance_s/{i}"] = t
        if self.engine.cpu_threads is not None:
            # Intra-op threads the CPU engine decoded with (the process's: training's).
            metrics["rollout/cpu_threads"] = self.engine.cpu_threads
        for g in actual:
            self.predictor.observe(self.prompt_keys[batch_indices[g]], actual[g])
        return samples, metrics

    def _prebuild_next_indexes(self) -> None:
        """Index the next step's prompts in a background thread, overlapping training (the
        index of a prompt is otherwise built when its first request starts drafting)."""
        if self.cfg.rollout.speculative != "histospec":
            return
        import copy

        nxt = copy.deepcopy(self.sampler).next_batch().indices
        self.history.prebuild([self.prompt_keys[i] for i in nxt])

    def _spec_lengths(self, plan: Any, mine: list, batch_indices: list[int]) -> list[Optional[float]]:
        """HistoPipe's predicted length per request, where the prompt has history (HistoSpec
        drafts nothing past a response's predicted end); None elsewhere."""
        return [plan.predicted.get(g) if self.history.has(self.prompt_keys[batch_indices[g]]) else None
                for g, _ in mine]

    def _record_history(self, samples: list[Sample], batch_indices: list[int], epoch: int) -> None:
        """Every rank adds every group of the step (all instances' responses, with rewards),
        so each engine's HistoSpec drafts from the whole group next epoch."""
        by_group: dict[int, list[Sample]] = {}
        for s in samples:
            by_group.setdefault(s.group, []).append(s)
        for g, ss in sorted(by_group.items()):
            ss.sort(key=lambda s: s.sample_idx)
            self.history.add_group(self.prompt_keys[batch_indices[g]], epoch, [s.token_ids for s in ss],
                                   [s.reward for s in ss])

    def _score(self, samples: list[Sample], batch_indices: list[int]) -> dict:
        from rhymerl.rewards import RewardItem
        from rhymerl.rewards.pool import RewardErrorRate, check_error_rate

        t0 = time.perf_counter()
        if self.comm.rank == 0:
            items = []
            for s in samples:
                rec = self.records[batch_indices[s.group]]
                kind = "exact" if rec.reward == "reasoning_gym" else (rec.reward or "auto")
                items.append(RewardItem(response_text=s.text, answer=rec.answer, kind=kind,
                                        metadata=rec.metadata.get("entry", {}).get("metadata", rec.metadata)))
            results = self.rewards.score(items)
            scored = [(r.score, r.correct, r.error is not None, r.timed_out) for r in results]
            try:
                check_error_rate(results, self.cfg.reward.max_error_rate)
            except RewardErrorRate as e:
                scored = str(e)
        else:
            scored = None
        scored = self.comm.broadcast_object(scored)
        if isinstance(scored, str):  # every rank stops with rank 0's reason
            raise RewardErrorRate(scored)
        for s, (score, correct, err, to) in zip(samples, scored):
            s.reward, s.correct, s.reward_error, s.reward_timeout = float(score), bool(correct), err, to
        return {"time/reward_s": time.perf_counter() - t0,
                "reward/errors": sum(s.reward_error for s in samples),
                "reward/timeouts": sum(s.reward_timeout for s in samples)}

    def _advantages(self, samples: list[Sample]) -> np.ndarray:
        from rhymerl.algorithms import group_advantages, shape_overlong

        a = self.cfg.algo
        rewards = np.array([s.reward for s in samples])
        if a.overlong_buffer > 0:
            rewards = shape_overlong(rewards, [len(s.token_ids) for s in samples], self.cfg.rollout.max_tokens,
                                     a.overlong_buffer, a.overlong_penalty)
        return group_advantages(rewards, [s.group for s in samples], scale_by_std=a.scale_by_std, eps=a.adv_eps)

    def _policy_batch(self, samples: list[Sample], adv: np.ndarray):
        from rhymerl.training.base import PolicyBatch

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        rows = [s.prompt_ids + s.token_ids for s in samples]
        T = max(len(r) for r in rows)
        ids = torch.full((len(rows), T), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), T))
        eng = torch.zeros((len(rows), T))
        for i, (s, r) in enumerate(zip(samples, rows)):
            ids[i, :len(r)] = torch.tensor(r)
            p = len(s.prompt_ids)
            mask[i, p:len(r)] = 1.0
            eng[i, p:len(r)] = torch.tensor(s.logprobs[:len(s.token_ids)], dtype=torch.float32)
        return PolicyBatch(input_ids=ids, response_mask=mask, advantages=torch.tensor(adv, dtype=torch.float32),
                           engine_logprobs=eng)

    def _train(self, samples: list[Sample], adv: np.ndarray) -> dict:
        from rhymerl.algorithms import logprob_mismatch, update_gain
        from rhymerl.training.micro_loss import engine_mismatch

        t0 = time.perf_counter()
        batch = self._policy_batch(samples, adv)
        # One update per batch is on-policy: the loss's own forward gives the old log-probs.
        on_policy = self.cfg.algo.updates_per_step == 1
        with torch.no_grad():
            if not on_policy:
                batch.old_logprobs = self.backend.compute_logprobs(batch.input_ids, batch.response_mask)
            if self.ref_backend is not None:
                batch.ref_logprobs = self.ref_backend.compute_logprobs(batch.input_ids, batch.response_mask)
            gain_from = None
            if self.cfg.algo.log_update_gain:
                gain_from = batch.old_logprobs if not on_policy else \
                    self.backend.compute_logprobs(batch.input_ids, batch.response_mask)
        if not on_policy:
            mism = logprob_mismatch(batch.engine_logprobs, batch.old_logprobs, batch.response_mask)
        out = {}
        for _ in range(self.cfg.algo.updates_per_step):
            m = self.backend.train_step(batch)
            if on_policy:
                mism = engine_mismatch(m.extra)
            out = {"train/loss": m.loss, "train/grad_norm": m.grad_norm, "train/lr": m.lr,
                   **{f"train/{k}": v for k, v in m.extra.items()}}
        out.update({f"train/logprob_{k}": v for k, v in mism.items()})
        if gain_from is not None:
            with torch.no_grad():
                after = self.backend.compute_logprobs(batch.input_ids, batch.response_mask)
            out["train/update_gain"] = update_gain(batch.advantages, gain_from, after, batch.response_mask)
        out["time/train_s"] = time.perf_counter() - t0
        return out

    def _reshard(self) -> dict:
        t0 = time.perf_counter()
        nbytes = 0

        def stream():
            nonlocal nbytes
            for bucket in self.backend.export_hf_weights(RESHARD_BUCKET_BYTES):
                for name, t in bucket:
                    nbytes += t.numel() * t.element_size()
                    yield name, t

        # One streaming pass: the engine reloads every tensor of a fused layer in the same call.
        self.engine.load_weights(stream())
        dt = time.perf_counter() - t0
        return {"time/reshard_s": dt, "reshard/gb_per_s": nbytes / dt / 1e9 if dt > 0 else 0.0}

    # ------------------------------------------------------------------ step

    def train_step(self) -> StepOutput:
        t_step = time.perf_counter()
        self.progress.context = f"step {self.step}"
        batch = self.sampler.next_batch()
        idx = batch.indices
        reshard_m = self.colocation.before_rollout(self._reshard)
        samples, metrics = self._rollout(idx, batch.epoch)
        metrics.update(reshard_m)
        metrics.update(self._score(samples, idx))
        self._record_history(samples, idx, batch.epoch)
        self._prebuild_next_indexes()
        scored = samples
        if self.ds_buffer is not None:
            samples, idx, scored, ds_m = self._dynamic_sampling(samples, idx, batch.epoch, metrics)
            metrics.update(ds_m)
        # Over every response generated this step (DAPO's refills included), not only those trained on.
        rewards = np.array([s.reward for s in scored])
        metrics.update({"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
                        "reward/accuracy": float(np.mean([s.correct for s in scored]))})
        adv = self._advantages(samples)
        self.last_batch_records = [self.records[i] for i in idx]
        if len(samples):
            self.colocation.before_training()
            metrics.update(self._train(samples, adv))
            self.colocation.after_training()
        metrics.update(self.colocation.step_metrics())
        lengths = [len(s.token_ids) for s in samples]
        gen_tokens = metrics.get("rollout/generated_tokens", sum(lengths))
        metrics.update({
            "response/len_mean": float(np.mean(lengths)) if lengths else 0.0,
            "response/len_max": int(max(lengths)) if lengths else 0,
            "rollout/tokens_per_s": gen_tokens / metrics["time/rollout_s"] if metrics.get("time/rollout_s") else 0.0,
            "epoch": batch.epoch,
            "time/step_s": time.perf_counter() - t_step,
        })
        out = StepOutput(step=self.step, epoch=batch.epoch, metrics=metrics, samples=samples)
        self.step += 1
        return out

    def _dynamic_sampling(self, samples: list[Sample], idx: list[int], epoch: int, metrics: dict):
        """DAPO: keep groups with non-constant rewards, refilling from further batches.

        Returns the kept samples (copies, renumbered to the kept groups), their prompt indices,
        every scored sample of the step and the ``dapo/*`` figures; each refill round's rollout
        and reward figures are added into ``metrics``.
        """
        buf = self.ds_buffer
        buf.begin_step()
        pool_idx: list[int] = []
        pool: dict[int, list[Sample]] = {}
        scored: list[Sample] = []

        def add(ss: list[Sample], ii: list[int]):
            offset = len(pool_idx)
            grouped: dict[int, list[Sample]] = {}
            for s in ss:
                grouped.setdefault(s.group, []).append(s)
            keys = sorted(grouped)
            for g in keys:
                pool[g + offset] = grouped[g]
            pool_idx.extend(ii)
            scored.extend(ss)
            buf.add([g + offset for g in keys], [[s.reward for s in grouped[g]] for g in keys])

        add(samples, idx)
        round_ = 0
        while not buf.ready:
            round_ += 1
            nb = self.sampler.next_batch()
            ss, roll_m = self._rollout(nb.indices, nb.epoch, round_)
            roll_m.update(self._score(ss, nb.indices))
            self._record_history(ss, nb.indices, nb.epoch)
            merge_round_metrics(metrics, roll_m, round_)
            add(ss, nb.indices)
        kept = buf.take()
        out = [dataclasses.replace(s, group=i) for i, g in enumerate(kept) for s in pool[g]]
        new_idx = [pool_idx[g] for g in kept]
        return out, new_idx, scored, {f"dapo/{k}": v for k, v in buf.last_step.items()}

    def close(self) -> None:
        self.engine.shutdown()
        if self.rewards is not None:
            self.rewards.close()


# Figures of one rollout batch that add up over DAPO's refill rounds; ratios are recomputed.
_ADDITIVE_PREFIXES = ("time/", "reward/errors", "reward/timeouts", "rollout/responses", "rollout/generated_tokens",
                      "rollout/engine_steps/", "rollout/instance_s/", "histospec/source/")
_ADDITIVE_SPEC = ("draft_proposed", "draft_accepted", "target_forwards", "generated_tokens", "draft_time_s",
                  *STAT_COUNTS)


def merge_round_metrics(into: dict, extra: dict, rounds: int) -> None:
    """Add a refill round's rollout/reward figures into the step's, which hold ``rounds`` batches
    so far (sums; ratios recomputed; per-batch HistoPipe figures averaged over the rounds)."""
    for k, v in extra.items():
        if k.startswith(_ADDITIVE_PREFIXES) or k.removeprefix("histospec/") in _ADDITIVE_SPEC:
            into[k] = into.get(k, 0) + v
        elif k.startswith("histopipe/") and k in into:
            into[k] = (into[k] * rounds + v) / (rounds + 1)
        else:
            into.setdefault(k, v)
    spec = _sum_engine_metrics([{k: into.get(f"histospec/{k}", 0) for k in _ADDITIVE_SPEC}])
    for k in ("acceptance", "tokens_per_forward", "history_served_fraction", "steps_without_drafts_fraction",
              "searches_skipped_fraction"):
        if f"histospec/{k}" in into:
            into[f"histospec/{k}"] = spec[k]


def _sum_engine_metrics(ms: list[dict]) -> dict:
    keys = _ADDITIVE_SPEC
    tot = {k: float(sum(m.get(k, 0) for m in ms)) for k in keys}
    out = add_stat_fractions(dict(tot))
    # Drafts, proposed and accepted tokens by draft source, summed over instances.
    for k in sorted({k for m in ms for k in m if k.startswith("source/")}):
        out[k] = float(sum(m.get(k, 0) for m in ms))
    # The fitted engine step-cost model (goodput draft lengths) and the priced chain search,
    # averaged over instances.
    for k in ("step_cost/fixed_ms", "step_cost/per_request_ms", "step_cost/per_token_ms",
              "step_cost/per_drafting_request_ms", "search_us_per_request"):
        vals = [m[k] for m in ms if k in m]
        if vals:
            out[k] = float(sum(vals) / len(vals))
    out["acceptance"] = tot["draft_accepted"] / tot["draft_proposed"] if tot["draft_proposed"] else 0.0
    out["tokens_per_forward"] = tot["generated_tokens"] / tot["target_forwards"] if tot["target_forwards"] else 1.0
    return out


def _ranks_per_node() -> Optional[int]:
    """Ranks on this node, from torchrun's or Slurm's environment (None when neither says)."""
    text = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "")
    text = text.split("(")[0]
    return int(text) if text.isdigit() else None


def _history_budget(cfg: RunConfig, num_prompts: int) -> int:
    """histospec.token_budget, or (0) one sized from the dataset and this node's memory."""
    from rhymerl.histospec.budget import available_memory_bytes, plan_token_budget

    h = cfg.histospec
    if h.token_budget > 0:
        return h.token_budget
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0] or 1)
    plan = plan_token_budget(num_prompts, cfg.rollout.n, cfg.rollout.max_tokens, h.epochs_kept, available_memory_bytes(),
                             ranks_per_node=max(1, ranks), memory_fraction=h.memory_fraction)
    (log.info if plan.covers_dataset else log.warning)("histospec: %s", plan.describe())
    return plan.token_budget
