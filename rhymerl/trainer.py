"""The synchronous, on-policy RL step loop (every rank): reshard -> rollout -> reward -> advantages -> train."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from transformers import AutoTokenizer

from rhymerl.algorithms import (DynamicSamplingBuffer, group_advantages, logprob_mismatch, shape_overlong, update_gain)
from rhymerl.config import RunConfig, fingerprint, to_dict, validate
from rhymerl.data import EpochSampler, PromptRecord, few_shot_pool, load_records, render_prompt
from rhymerl.distributed.collectives import WorldComm
from rhymerl.distributed.colocation import Colocation
from rhymerl.distributed.devices import free_memory_probe, host_heap_trimmer
from rhymerl.distributed.memory_plan import check_run, cpu_kv_cache_bytes
from rhymerl.histopipe import HistoPipePlanner, LengthPredictor, NoopPlanner
from rhymerl.histopipe.live import LiveRollout
from rhymerl.histospec import HistoryStore, prompt_key
from rhymerl.histospec.budget import available_memory_bytes, plan_token_budget
from rhymerl.models import check_model_use, model_shape, resolve_model
from rhymerl.outputs.progress import PhaseProgress
from rhymerl.resharding.layout import ModelLayout
from rhymerl.rewards import RewardItem, RewardPool
from rhymerl.rewards.pool import RewardErrorRate, RewardSetupError, check_error_rate
from rhymerl.rollout import RolloutEngine
from rhymerl.rollout.batch import RolloutBatch, Sample
from rhymerl.rollout.metrics import merge_round_metrics
from rhymerl.rollout.placement import engine_placement
from rhymerl.rollout.planned import PlannedRollout
from rhymerl.training import build_backend
from rhymerl.training.base import PolicyBatch
from rhymerl.training.micro_loss import engine_mismatch

log = logging.getLogger("rhymerl.trainer")

RESHARD_BUCKET_BYTES = 64 << 20


@dataclass
class StepOutput:
    step: int
    epoch: int  # from 1
    metrics: dict
    samples: list[Sample] = field(default_factory=list)


class Trainer:
    """Holds the run's components; ``run()`` executes steps until the budget is spent."""

    def __init__(self, cfg: RunConfig, comm: WorldComm, groups: Any, backend_checkpoint: Optional[Path] = None):
        """``backend_checkpoint``: a backend folder to resume from, loaded before the engine is built."""
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
        check_run(cfg, self.model_path, comm.world_size, groups.device)

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self.records: list[PromptRecord] = load_records(cfg.data)
        shots = few_shot_pool(self.records, cfg.data.few_shot, cfg.data.seed)
        self.prompt_ids = [render_prompt(r, shots[r.id], self.tokenizer, cfg.data) for r in self.records]
        self.prompt_keys = [prompt_key(p) for p in self.prompt_ids]
        self.sampler = EpochSampler(len(self.records), cfg.data.prompts_per_step, cfg.run.seed, cfg.data.shuffle)

        self.history_budget = _history_budget(cfg, len(self.records))
        # The engine samples from the model's vocabulary, which may be padded past the tokenizer's.
        vocab = max(len(self.tokenizer), shape.vocab_size)
        self.history = HistoryStore(cfg.histospec, vocab_size=vocab, token_budget=self.history_budget)
        self.predictor = LengthPredictor(cfg.histopipe, cfg.rollout.max_tokens)
        self.placement = engine_placement(comm.world_size, comm.rank, int(os.environ.get("LOCAL_RANK", "0")),
                                          cfg.rollout.tensor_parallel, ranks_per_node=_ranks_per_node())

        # Log-probs at the sampling temperature: the distribution the responses came from.
        temp = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.backend = build_backend(cfg.parallel, cfg.algo, self.model_path, groups, dtype=cfg.model.dtype,
                                     seed=cfg.run.seed, temperature=temp)
        if backend_checkpoint is not None:
            self.backend.load_checkpoint(backend_checkpoint)
        self.ref_backend = None
        if cfg.algo.kl_coef > 0:
            # A frozen copy of the initial policy (no optimizer): its log-probs are the KL reference.
            self.ref_backend = build_backend(cfg.parallel, cfg.algo, self.model_path, groups, dtype=cfg.model.dtype,
                                             seed=cfg.run.seed, temperature=temp, train=False)
        self.progress = PhaseProgress(interval_s=cfg.tracking.progress_interval_s,
                                      enabled=comm.rank == 0 and cfg.tracking.console != "none"
                                      and cfg.tracking.progress_interval_s > 0)
        self.backend.progress = self.progress
        train_threads = torch.get_num_threads()
        on_cpu = groups.device.type == "cpu"
        self.colocation = Colocation(self.backend, cfg.rollout.sleep_level, references=[self.ref_backend],
                                     device_free_bytes=free_memory_probe(groups.device),
                                     trim_heap=host_heap_trimmer() if on_cpu else None)
        # What training alone needs leaves the device before vLLM checks its free memory.
        self.colocation.before_engine_build()
        self.engine = RolloutEngine(cfg.rollout, cfg.histospec, self.model_path, seed=cfg.run.seed + self.placement.instance,
                                    progress=self.progress if comm.rank == 0 else None,
                                    history=self.history, dtype=cfg.model.dtype,
                                    cpu_kv_cache_bytes=self._cpu_kv_cache_bytes(), placement=self.placement)
        if on_cpu:  # should the engine ever decode with fewer threads, training gets its own back
            self.colocation.share_cpu_threads(train_threads, self.engine.cpu_threads or train_threads)
        self.colocation.attach_engine(self.engine)
        self.rollout = self._build_rollout()
        self.rewards = self._start_rewards(RewardPool)
        self.ds_buffer = DynamicSamplingBuffer.from_config(cfg.algo, cfg.data.prompts_per_step) \
            if cfg.algo.dynamic_sampling else None
        self.step = 0
        self.last_batch_records: list[PromptRecord] = []

    def _build_rollout(self) -> Any:
        """Live HistoPipe across several one-rank instances; by plan otherwise."""
        cfg, p = self.cfg, self.placement
        if cfg.histopipe.enabled and cfg.rollout.tensor_parallel == 1 and p.num_instances > 1:
            return LiveRollout(cfg.histopipe, cfg.rollout, cfg.run.seed, self.comm, self.engine, self.predictor,
                               self.history)
        planner = HistoPipePlanner(p.num_instances, cfg.rollout.max_num_seqs) if cfg.histopipe.enabled \
            else NoopPlanner(p.num_instances)
        return PlannedRollout(cfg.rollout, cfg.run.seed, self.comm, self.engine, p, planner, self.predictor,
                              self.history)

    def _start_rewards(self, pool_cls):
        """Rank 0's reward pool, started before the first step; a scorer that cannot load stops every rank."""
        pool, err = None, None
        if self.comm.rank == 0:
            try:
                pool = pool_cls(self.cfg.reward)
                pool.wait_ready()
            except RewardSetupError as e:
                err = str(e)
        err = self.comm.broadcast_object(err)
        if err is not None:
            raise RewardSetupError(err)
        return pool

    def _cpu_kv_cache_bytes(self) -> int:
        """What a CPU engine's KV cache needs for one step of this run (its memory is resident)."""
        layout = ModelLayout.from_hf_config(json.loads((Path(self.model_path) / "config.json").read_text()))
        cfg = self.cfg
        return cpu_kv_cache_bytes(layout, cfg.rollout, cfg.model.dtype, cfg.data.prompts_per_step * cfg.rollout.n,
                                  max(len(p) for p in self.prompt_ids))

    def state_blobs(self) -> dict[str, Any]:
        """Everything but the backend's weights/optimizer, for the checkpoint."""
        return {"step": self.step, "sampler": self.sampler.state_dict(), "history": self.history.to_bytes(),
                "predictor": self.predictor.state_dict(), "planner": self.rollout.state_dict(),
                "ds_buffer": self.ds_buffer.state_dict() if self.ds_buffer is not None else None,
                "config": to_dict(self.cfg), "config_fingerprint": fingerprint(self.cfg)}

    def load_state_blobs(self, blobs: dict[str, Any]) -> None:
        self.step = int(blobs["step"])
        self.sampler.load_state_dict(blobs["sampler"])
        self.history = HistoryStore.from_bytes(blobs["history"], self.cfg.histospec, token_budget=self.history_budget)
        self.engine.set_history(self.history)
        self.rollout.history = self.history
        self.predictor.load_state_dict(blobs["predictor"])
        self.rollout.load_state_dict(blobs["planner"])
        if self.ds_buffer is not None and blobs.get("ds_buffer") is not None:
            self.ds_buffer.load_state_dict(blobs["ds_buffer"])

    def _rollout(self, batch_indices: list[int], epoch: int, round_: int = 0) -> tuple[list[Sample], dict]:
        """This batch's decoded responses from every instance; ``round_``: DAPO's refill batch in the step."""
        batch = RolloutBatch(step=self.step, epoch=epoch, prompts=[self.prompt_ids[i] for i in batch_indices],
                             keys=[self.prompt_keys[i] for i in batch_indices], n=self.cfg.rollout.n, round=round_)
        out = self.rollout.generate(batch)
        for s in out.samples:
            s.text = self.tokenizer.decode(s.token_ids, skip_special_tokens=True)
        if self.engine.cpu_threads is not None:
            out.metrics["rollout/cpu_threads"] = self.engine.cpu_threads
        return out.samples, out.metrics

    def _prebuild_next_indexes(self) -> None:
        """Index the next step's prompts in a background thread, overlapping training."""
        if self.cfg.rollout.speculative != "histospec":
            return
        nxt = copy.deepcopy(self.sampler).next_batch().indices
        self.history.prebuild([self.prompt_keys[i] for i in nxt])

    def _record_history(self, samples: list[Sample], batch_indices: list[int], epoch: int) -> None:
        """Every rank adds every group of the step (with rewards), so each engine drafts from whole groups."""
        by_group: dict[int, list[Sample]] = {}
        for s in samples:
            by_group.setdefault(s.group, []).append(s)
        for g, ss in sorted(by_group.items()):
            ss.sort(key=lambda s: s.sample_idx)
            self.history.add_group(self.prompt_keys[batch_indices[g]], epoch, [s.token_ids for s in ss],
                                   [s.reward for s in ss])

    def _score(self, samples: list[Sample], batch_indices: list[int]) -> dict:
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
                "reward/timeouts": sum(s.reward_timeout for s in samples),
                "reward/workers_restarted": self.rewards.last_restarts if self.rewards is not None else 0}

    def _advantages(self, samples: list[Sample]) -> np.ndarray:
        a = self.cfg.algo
        rewards = np.array([s.reward for s in samples])
        if a.overlong_buffer > 0:
            rewards = shape_overlong(rewards, [len(s.token_ids) for s in samples], self.cfg.rollout.max_tokens,
                                     a.overlong_buffer, a.overlong_penalty)
        return group_advantages(rewards, [s.group for s in samples], scale_by_std=a.scale_by_std)

    def _policy_batch(self, samples: list[Sample], adv: np.ndarray) -> PolicyBatch:
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
        # Epochs count from 1 in every output.
        metrics.update({
            "response/len_mean": float(np.mean(lengths)) if lengths else 0.0,
            "response/len_max": int(max(lengths)) if lengths else 0,
            "rollout/tokens_per_s": gen_tokens / metrics["time/rollout_s"] if metrics.get("time/rollout_s") else 0.0,
            "epoch": batch.epoch + 1, "time/step_s": time.perf_counter() - t_step})
        out = StepOutput(step=self.step, epoch=batch.epoch + 1, metrics=metrics, samples=samples)
        self.step += 1
        return out

    def _dynamic_sampling(self, samples: list[Sample], idx: list[int], epoch: int, metrics: dict):
        """DAPO: keep groups with non-constant rewards, refilling from further batches (their figures go
        into ``metrics``). Returns (kept samples renumbered, their prompt indices, all scored, ``dapo/*``)."""
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


def _ranks_per_node() -> Optional[int]:
    """Ranks on this node, from torchrun's or Slurm's environment (None when neither says)."""
    text = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "")
    text = text.split("(")[0]
    return int(text) if text.isdigit() else None


def _history_budget(cfg: RunConfig, num_prompts: int) -> int:
    """histospec.token_budget, or (0) one sized from the dataset and this node's memory."""
    h = cfg.histospec
    if h.token_budget > 0:
        return h.token_budget
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0] or 1)
    plan = plan_token_budget(num_prompts, cfg.rollout.n, cfg.rollout.max_tokens, h.epochs_kept, available_memory_bytes(),
                             ranks_per_node=max(1, ranks), memory_fraction=h.memory_fraction)
    (log.info if plan.covers_dataset else log.warning)("histospec: %s", plan.describe())
    return plan.token_budget
