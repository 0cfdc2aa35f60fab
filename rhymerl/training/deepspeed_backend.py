"""DeepSpeed ZeRO (stage 0-3) backend for HF ``transformers`` models (plain AdamW: no JIT-built kernels)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from rhymerl.config import AlgorithmConfig, ParallelConfig
from rhymerl.training.base import PolicyBatch, StepMetrics
from rhymerl.training.backend_checkpoint import read_backend_meta, save_backend_checkpoint
from rhymerl.training.megatron_backend import DTYPES, combine_metrics
from rhymerl.training.micro_loss import micro_batch_loss, rows_to_train
from rhymerl.training.microbatch import (left_pad_columns, pad_columns, policy_micro_batches, split_policy_rows,
                                         unpermute_rows, unscored_prefix)
from rhymerl.distributed.process_groups import ProcessGroups


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, T] log p(x_t | x_<t) from the logits [B, K, V] of the last K positions; 0 where nothing was scored."""
    if temperature != 1.0:
        logits = logits / temperature
    T, K = input_ids.shape[1], logits.shape[1]
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, input_ids[:, T - K + 1:, None])[..., 0]
    return left_pad_columns(lp, T)


def deepspeed_config(parallel_cfg: ParallelConfig, algo_cfg: AlgorithmConfig, dtype: str) -> dict:
    # gradient_clipping: DeepSpeed's own default (1.0) would clip even when the user asked for none.
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "gradient_clipping": float(algo_cfg.grad_clip), "zero_optimization": {"stage": int(parallel_cfg.zero_stage)},
           "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    if dtype == "bfloat16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "float16":
        cfg["fp16"] = {"enabled": True}
    return cfg


class DeepSpeedBackend:
    """``TrainingBackend`` on DeepSpeed ZeRO. Construct through ``rhymerl.training.build_backend``."""

    progress = None  # a PhaseProgress (rank 0's console) or None; set by the trainer

    def __init__(self, parallel_cfg: ParallelConfig, algo_cfg: AlgorithmConfig, model_path: Path,
                 groups: ProcessGroups, dtype: str = "float32", seed: int = 0, *, temperature: float = 1.0,
                 loss_fn=None, train: bool = True):
        import deepspeed
        from transformers import AutoModelForCausalLM

        if parallel_cfg.tensor_parallel != 1 or parallel_cfg.pipeline_parallel != 1:
            raise ValueError("parallel.backend: deepspeed shards with ZeRO only; set tensor_parallel=1 and pipeline_parallel=1")
        if dtype not in DTYPES:
            raise ValueError(f"model.dtype: {dtype!r} not allowed; allowed: {', '.join(DTYPES)}")
        self.parallel_cfg, self.algo_cfg, self.groups = parallel_cfg, algo_cfg, groups
        self.model_path, self.dtype_name = Path(model_path), dtype
        self.temperature = float(temperature)
        self._loss_fn = loss_fn
        self.steps = 0
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(str(self.model_path), dtype=DTYPES[dtype])
        model.to(groups.device)
        if not train:
            # A frozen model (the KL reference): no optimizer state, no ZeRO engine, no gradients.
            self.engine, self.optimizer = model.requires_grad_(False).eval(), None
            self.module = model
            return
        # deepspeed.initialize insists on LOCAL_RANK, which a single-process run lacks.
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
        a = algo_cfg
        optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=tuple(a.betas), eps=a.adam_eps,
                                      weight_decay=a.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=deepspeed_config(parallel_cfg, algo_cfg, dtype),
            dist_init_required=False)
        self.module = self.engine.module

    def _forward_lp(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # Logits only where they score a response token (see ``unscored_prefix``).
        keep = ids.shape[1] - unscored_prefix(mask)
        logits = self.engine(input_ids=ids.to(self.groups.device), logits_to_keep=keep).logits
        return token_logprobs(logits, ids.to(logits.device), self.temperature)

    def _gather_dp(self, local: torch.Tensor, rows_per_rank: int) -> torch.Tensor:
        g = self.groups
        parts = [local]
        if g.dp_size > 1:
            local = local.to(g.collective_device(g.dp)).contiguous()
            parts = [torch.empty_like(local) for _ in range(g.dp_size)]
            dist.all_gather(parts, local, group=g.dp)
        return torch.cat([p.cpu()[:rows_per_rank] for p in parts], dim=0)

    def compute_logprobs(self, input_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        g = self.groups
        B, T = input_ids.shape
        plan, perm, micro = split_policy_rows({"input_ids": input_ids.long(), "mask": response_mask.float()},
                                              response_mask, g.dp_size, g.dp_rank,
                                              self.algo_cfg.micro_batch_tokens, fixed_shape=False)
        self.engine.eval()
        with torch.no_grad():
            local = torch.cat([pad_columns(self._forward_lp(m["input_ids"], m["mask"]), T) for m in micro])
        if self.optimizer is not None:
            self.engine.train()
        full = unpermute_rows(self._gather_dp(local.float(), plan.rows_per_rank), perm)
        return full[:B] * response_mask.to(full.dtype)

    def train_step(self, batch: PolicyBatch) -> StepMetrics:
        if self._loss_fn is None:
            from rhymerl.algorithms.losses import policy_loss as loss_fn
        else:
            loss_fn = self._loss_fn
        if self.optimizer is None:
            raise RuntimeError("this backend was built with train=False")
        g = self.groups
        B = batch.input_ids.shape[0]
        num_tokens = float(batch.response_mask.sum().clamp_min(1.0))
        batch, skipped = rows_to_train(batch, self.algo_cfg, loss_fn)
        plan, micro = policy_micro_batches(batch, g.dp_size, g.dp_rank, self.algo_cfg.micro_batch_tokens,
                                           fixed_shape=False)
        self.engine.train()
        per_micro, loss_total = [], 0.0
        progress = self.progress
        if progress is not None:
            progress.start("training", total=len(micro), unit="micro-batches")
        tokens_seen = 0
        for i, mb in enumerate(micro):
            if progress is not None:
                progress.update(i, tokens=tokens_seen)
            tokens_seen += int(mb["input_ids"].numel())
            lp = self._forward_lp(mb["input_ids"], mb["mask"])
            loss, metrics = micro_batch_loss(loss_fn, lp, mb, self.algo_cfg, num_tokens, float(B))
            self.engine.set_gradient_accumulation_boundary(i == plan.num_micro - 1)
            # DeepSpeed averages gradients over DP ranks; the loss is already this shard's share.
            self.engine.backward(loss * g.dp_size, scale_wrt_gas=False)
            loss_total += float(loss.detach())
            per_micro.append(metrics)
        if progress is not None:
            progress.finish()
        self.engine.step()
        self.steps += 1
        if g.dp_size > 1:
            parts = [None] * g.dp_size
            dist.all_gather_object(parts, (loss_total, per_micro), group=g.dp)
        else:
            parts = [(loss_total, per_micro)]
        extra = combine_metrics([m for _, ms in parts for m in ms])
        extra["rows_skipped"] = float(skipped)
        grad_norm = self.engine.get_global_grad_norm()
        return StepMetrics(loss=sum(l for l, _ in parts), grad_norm=float(grad_norm or 0.0),
                           lr=float(self.optimizer.param_groups[0]["lr"]), extra=extra)

    def export_hf_weights(self, bucket_bytes: int, stats=None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named tensors in buckets; under ZeRO-3 each parameter is gathered, copied and released."""
        import deepspeed

        zero3 = self.parallel_cfg.zero_stage == 3 and self.optimizer is not None
        bucket, used = [], 0
        for name, p in self.module.named_parameters():
            size = p.ds_numel * p.element_size() if zero3 else p.numel() * p.element_size()
            if bucket and used + size > bucket_bytes:
                yield bucket
                bucket, used = [], 0
            if zero3:
                with deepspeed.zero.GatheredParameters([p]):
                    t = p.detach().clone()
            else:
                t = p.detach()
            bucket.append((name, t))
            used += t.numel() * t.element_size()
        if bucket:
            yield bucket

    def save_checkpoint(self, folder: Path) -> None:
        if self.optimizer is None:
            raise RuntimeError("this backend was built with train=False: it holds the initial weights only")
        meta = {"kind": "deepspeed", "steps": self.steps, "dtype": self.dtype_name,
                "zero_stage": self.parallel_cfg.zero_stage, "data_parallel": self.groups.dp_size}
        save_backend_checkpoint(folder, self.model_path, meta,
                                lambda tmp: self.engine.save_checkpoint(str(tmp), tag="state"))

    def load_checkpoint(self, folder: Path, load_optimizer: bool = True) -> None:
        folder = Path(folder)
        meta = read_backend_meta(folder, "deepspeed")
        path, _ = self.engine.load_checkpoint(str(folder), tag="state", load_optimizer_states=load_optimizer,
                                              load_lr_scheduler_states=load_optimizer)
        if path is None:
            raise FileNotFoundError(f"deepspeed found no checkpoint state in {folder}")
        self.steps = int(meta.get("steps", 0))
