"""Megatron-core policy backend: TP/PP/DP training of an HF Llama/Qwen2 model (local, non-TE layer spec)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

import megatron_patches
from rhymerl.algorithms.losses import policy_loss
from rhymerl.config import AlgorithmConfig, ParallelConfig
from rhymerl.distributed.process_groups import ProcessGroups
from rhymerl.resharding.layout import ModelLayout, iter_stage_specs, shard_from_hf
from rhymerl.resharding.stream import HFExportStats, export_hf_buckets
from rhymerl.training.backend_checkpoint import read_backend_meta, save_backend_checkpoint, shield_megatron_writer
from rhymerl.training.base import PolicyBatch, StepMetrics
from rhymerl.training.micro_loss import micro_batch_loss, rows_to_train
from rhymerl.training.microbatch import (left_pad_columns, pad_columns, plan_micro_batches, policy_micro_batches,
                                         rank_slice, split_micro, split_policy_rows, unpermute_rows, unscored_prefix)
from rhymerl.training.sdpa_attention import SdpaDotProductAttention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

LossFn = Callable[..., tuple[torch.Tensor, dict]]


def read_hf_config(model_path: Path) -> dict:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model.path: {model_path} has no config.json")
    return json.loads(path.read_text())


class SafetensorsReader:
    """Lazy access to the tensors of an HF folder (one or many safetensors files)."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self._files = {}
        self._where: dict[str, Path] = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            h = safe_open(str(f), framework="pt")
            self._files[f] = h
            for k in h.keys():
                self._where[k] = f
        if not self._where:
            raise FileNotFoundError(f"model.path: {folder} has no *.safetensors weights")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"weights have no tensor {name!r}")
        return self._files[self._where[name]].get_tensor(name)


def transformer_config(layout: ModelLayout, tp: int, pp: int, dtype: torch.dtype, recompute: bool = False,
                       recompute_norms: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    # Full recomputation, one layer per checkpoint, as memory_plan counts activations.
    if recompute:
        recompute_kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute_norms:
        recompute_kw = dict(recompute_granularity="selective", recompute_modules=["layernorm"])
    else:
        recompute_kw = {}
    return TransformerConfig(
        **recompute_kw,
        num_layers=layout.num_layers, hidden_size=layout.hidden_size, num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_kv_heads, kv_channels=layout.head_dim, ffn_hidden_size=layout.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=layout.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=layout.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,
        # The fused kernels below are CUDA/apex/TE-only; the unfused paths are exact.
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False, attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=False,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        # Weights come from the HF folder: skip megatron's random init.
        use_cpu_initialization=True, perform_initialization=False)


def combine_metrics(per_micro: list[dict]) -> dict:
    """Merge micro-batch metrics: ``*_max``/``*_min`` by max/min, ``tokens`` summed, the rest token-weighted."""
    out: dict = {}
    tokens = sum(m.get("tokens", 0.0) for m in per_micro)
    for key in (per_micro[0] if per_micro else {}):
        vals = [(m[key], m.get("tokens", 0.0)) for m in per_micro if m.get("tokens", 0.0) > 0 or key == "tokens"]
        if not vals:
            continue
        if key == "tokens":
            out[key] = tokens
        elif key.endswith("_max"):
            out[key] = max(v for v, _ in vals)
        elif key.endswith("_min"):
            out[key] = min(v for v, _ in vals)
        else:
            out[key] = sum(v * n for v, n in vals) / max(tokens, 1.0)
    return out


def layer_spec(attention: str):
    """megatron's local (non-TE) layer spec, its core attention chosen by ``parallel.attention``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SdpaDotProductAttention
    elif attention != "unfused":
        raise ValueError(f"parallel.attention: {attention!r} not allowed; allowed: sdpa, unfused")
    return spec


class MegatronBackend:
    """``TrainingBackend`` on megatron-core. Construct through ``rhymerl.training.build_backend``."""

    progress = None  # a PhaseProgress (rank 0's console) or None; set by the trainer

    def __init__(self, parallel_cfg: ParallelConfig, algo_cfg: AlgorithmConfig, model_path: Path,
                 groups: ProcessGroups, dtype: str = "float32", seed: int = 0, *, temperature: float = 1.0,
                 loss_fn: Optional[LossFn] = None, train: bool = True, load_weights: bool = True):
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt import GPTModel

        if groups.device.type == "cpu" and not megatron_patches.applied():
            raise RuntimeError("megatron-core on a CPU host needs megatron_patches.apply_all('cpu') first "
                               "(init_process_groups does it)")
        if parallel_cfg.recompute_norms and train and groups.device.type != "cpu":
            from megatron.core.tensor_parallel.random import HAVE_TE

            if not HAVE_TE:  # CPU hosts got it with the rest
                megatron_patches.apply("checkpoint_without_output_te")
        if dtype not in DTYPES:
            raise ValueError(f"model.dtype: {dtype!r} not allowed; allowed: {', '.join(DTYPES)}")
        if train and dtype != "float32" and groups.device.type != "cuda":
            raise ValueError(f"model.dtype: {dtype} training with megatron-core needs CUDA (its mixed-precision "
                             "optimizer only wraps torch.cuda tensors); use float32 on CPU hosts "
                             "(inference and export work in any dtype)")
        if parallel_cfg.distributed_optimizer and groups.device.type != "cuda":
            raise ValueError("parallel.distributed_optimizer: megatron-core's distributed optimizer needs CUDA "
                             "tensors; set it to false on CPU hosts")
        self.parallel_cfg, self.algo_cfg, self.groups = parallel_cfg, algo_cfg, groups
        self.model_path = Path(model_path)
        self.dtype_name, self.dtype = dtype, DTYPES[dtype]
        self.temperature = float(temperature)
        self.hf_config = read_hf_config(self.model_path)
        self.layout = ModelLayout.from_hf_config(self.hf_config, where=str(self.model_path / "config.json"))
        self.layout.check_parallel(groups.tp_size, groups.pp_size)
        self.steps = 0
        self.recomputed_micro_batches = 0  # this rank's, in the last train_step
        self._loss_fn = loss_fn
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)

        self.config = transformer_config(self.layout, groups.tp_size, groups.pp_size, self.dtype,
                                         recompute=parallel_cfg.recompute_activations and train,
                                         recompute_norms=parallel_cfg.recompute_norms and train)
        model = GPTModel(
            config=self.config, transformer_layer_spec=layer_spec(parallel_cfg.attention),
            vocab_size=self.layout.vocab_size, max_sequence_length=self.layout.max_position_embeddings,
            pre_process=groups.is_first_stage, post_process=groups.is_last_stage,
            share_embeddings_and_output_weights=self.layout.tied, position_embedding_type="rope",
            rotary_base=int(self.layout.rope_theta), parallel_output=True).to(groups.device)
        # load_weights=False leaves the weights uninitialised for a checkpoint load to fill.
        self._load_hf_weights(model, SafetensorsReader(self.model_path) if load_weights else None)
        self._unscored_prefix = 0  # positions the output layer skips in the current forward
        if groups.is_last_stage:
            model.output_layer.register_forward_pre_hook(self._output_layer_input, with_kwargs=True)
        self.module = model
        self.model = model
        self.optimizer = None
        if train:
            self._setup_training()

    def _load_hf_weights(self, model: torch.nn.Module, reader: Optional[SafetensorsReader]) -> None:
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        g = self.groups
        params = dict(model.named_parameters())
        seen = set()
        with torch.no_grad():
            for spec in iter_stage_specs(self.layout, g.pp_size, g.pp_rank):
                name = spec.local_name(self.layout, g.pp_size)
                if name not in params:
                    raise RuntimeError(f"megatron model on stage {g.pp_rank} has no parameter {name}")
                if reader is not None:
                    shard = shard_from_hf(spec, self.layout, reader.get, g.tp_size, g.tp_rank)
                    if tuple(shard.shape) != tuple(params[name].shape):
                        raise RuntimeError(f"{name}: HF gives shape {tuple(shard.shape)}, megatron expects {tuple(params[name].shape)}")
                    params[name].copy_(shard)
                # Set only by megatron's (skipped) init; else the grad norm counts TP shards once.
                if spec.tp_dim is not None and not hasattr(params[name], "tensor_model_parallel"):
                    set_tensor_model_parallel_attributes(params[name], True, spec.tp_dim, 1)
                seen.add(name)
        missing = sorted(set(params) - seen)
        if missing:
            raise RuntimeError(f"no HF weights mapped to megatron parameters {missing}")

    def _setup_training(self) -> None:
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        a = self.algo_cfg
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=self.parallel_cfg.distributed_optimizer)
        self.model = DistributedDataParallel(config=self.config, ddp_config=ddp_cfg, module=self.module)
        self.config.finalize_model_grads_func = finalize_model_grads
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=a.lr, min_lr=a.lr, weight_decay=a.weight_decay, adam_beta1=a.betas[0],
            adam_beta2=a.betas[1], adam_eps=a.adam_eps, clip_grad=a.grad_clip, bf16=self.dtype == torch.bfloat16,
            fp16=self.dtype == torch.float16, params_dtype=self.dtype,
            use_distributed_optimizer=self.parallel_cfg.distributed_optimizer)
        self.optimizer = get_megatron_optimizer(opt_cfg, [self.model])

    def _output_layer_input(self, module, args, kwargs):
        # Prompt positions predict nothing scored, yet the output layer is costly: cut them off.
        h = args[0]
        if self._unscored_prefix:
            h = h[self._unscored_prefix:]
        # logits / T == (hidden / T) @ W; megatron's loss path never hands the logits back to us.
        if self.temperature != 1.0:
            h = h / self.temperature
        return (h,) + tuple(args[1:]), kwargs

    @staticmethod
    def _next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
        # Every position is scored (the last one against a dummy target, dropped afterwards).
        return torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)

    @staticmethod
    def _token_logprobs(nll: torch.Tensor, width: int) -> torch.Tensor:
        """[B, width] log p(x_t | x_<t) from megatron's cross entropy; 0 where nothing was scored."""
        return left_pad_columns(-nll[:, :-1], width)

    def _recompute_over(self, tokens: int) -> bool:
        """Whether a micro-batch of ``tokens`` over the budget recomputes its layers (if not already)."""
        return (self.parallel_cfg.recompute_over_budget and self.config.recompute_granularity is None
                and tokens > self.algo_cfg.micro_batch_tokens)

    @contextmanager
    def _full_recompute(self):
        # Read at each forward, and checkpoints carry their recomputation: one forward's switch suffices.
        c = self.config
        saved = c.recompute_granularity, c.recompute_method, c.recompute_num_layers
        c.recompute_granularity, c.recompute_method, c.recompute_num_layers = "full", "uniform", 1
        try:
            yield
        finally:
            c.recompute_granularity, c.recompute_method, c.recompute_num_layers = saved

    def _run(self, micro: list[dict], loss_func: Callable, forward_only: bool, with_labels: bool = True) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        g = self.groups
        rows, seq = micro[0]["input_ids"].shape
        progress = self.progress
        seen = tokens_seen = 0
        if progress is not None:
            progress.start("log-probs" if forward_only else "training", total=len(micro), unit="micro-batches")

        def forward_step(data_iterator, model):
            nonlocal seen, tokens_seen
            mb = next(data_iterator)
            if progress is not None:
                progress.update(seen, tokens=tokens_seen)
            seen += 1
            tokens_seen += int(mb["input_ids"].numel())
            ids = mb["input_ids"].to(g.device)
            pos = torch.arange(ids.shape[1], device=g.device).unsqueeze(0).expand(ids.shape[0], -1)
            # With labels the cross entropy runs in place; without, megatron returns a [b, s, V] copy.
            labels = None
            if with_labels:
                self._unscored_prefix = unscored_prefix(mb["mask"])
                labels = self._next_token_targets(ids)[:, self._unscored_prefix:]
            try:
                if forward_only or not self._recompute_over(ids.numel()):
                    out = model(ids, pos, None, labels=labels)
                else:
                    self.recomputed_micro_batches += 1
                    with self._full_recompute():
                        out = model(ids, pos, None, labels=labels)
            finally:
                self._unscored_prefix = 0
            return out, partial(loss_func, mb)

        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro), model=[self.model],
            num_microbatches=len(micro), seq_length=seq, micro_batch_size=rows, forward_only=forward_only)
        if progress is not None:
            progress.finish()
        return out

    def _broadcast_from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        g = self.groups
        if g.pp_size > 1:
            t = t.to(g.collective_device(g.pp))
            dist.broadcast(t, src=g.pp_global_rank(g.pp_size - 1), group=g.pp)
        return t

    def compute_logprobs(self, input_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        g = self.groups
        B, T = input_ids.shape
        plan, perm, micro = split_policy_rows({"input_ids": input_ids.long(), "mask": response_mask.float()},
                                              response_mask, g.dp_size, g.dp_rank,
                                              self.algo_cfg.micro_batch_tokens, fixed_shape=g.pp_size > 1)

        def loss_func(mb, nll):
            lp = self._token_logprobs(nll, mb["input_ids"].shape[1])
            return lp.sum() * 0.0, {"logprobs": pad_columns(lp.detach().float().cpu(), T)}

        self.model.eval()
        with torch.no_grad():
            out = self._run(micro, loss_func, forward_only=True)
        self.model.train()
        local = torch.zeros(plan.rows_per_micro * plan.num_micro, T, dtype=torch.float32)
        if g.is_last_stage:
            local = torch.cat([o["logprobs"] for o in out], dim=0)
        full = unpermute_rows(self._gather_dp(self._broadcast_from_last_stage(local), plan), perm)
        return full[:B] * response_mask.to(full.dtype)

    def _gather_dp(self, local: torch.Tensor, plan) -> torch.Tensor:
        g = self.groups
        if g.dp_size > 1:
            local = local.to(g.collective_device(g.dp)).contiguous()
            parts = [torch.empty_like(local) for _ in range(g.dp_size)]
            dist.all_gather(parts, local, group=g.dp)
        else:
            parts = [local]
        return torch.cat([p.cpu()[: plan.rows_per_rank] for p in parts], dim=0)

    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits / temperature [B, T, V] on every rank (parity tests and debugging only)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        g = self.groups
        B, T = input_ids.shape
        plan = plan_micro_batches(B, T, g.dp_size, self.algo_cfg.micro_batch_tokens)
        micro = [{"input_ids": m} for m in split_micro(rank_slice(input_ids.long(), plan, g.dp_rank), plan)]

        def loss_func(mb, logits):
            full = gather_from_tensor_model_parallel_region(logits)
            return logits.sum() * 0.0, {"logits": full.detach().float()}

        self.model.eval()
        with torch.no_grad():
            out = self._run(micro, loss_func, forward_only=True, with_labels=False)
        self.model.train()
        local = torch.zeros(plan.rows_per_micro * plan.num_micro, T, self.layout.vocab_size, dtype=torch.float32,
                            device=g.device)
        if g.is_last_stage:
            local = torch.cat([o["logits"] for o in out], dim=0)
        return self._gather_dp(self._broadcast_from_last_stage(local), plan)[:B]

    def _policy_loss(self) -> LossFn:
        if self._loss_fn is not None:
            return self._loss_fn
        return policy_loss

    def train_step(self, batch: PolicyBatch) -> StepMetrics:
        if self.optimizer is None:
            raise RuntimeError("this backend was built with train=False")
        g = self.groups
        B = batch.input_ids.shape[0]
        num_tokens = float(batch.response_mask.sum().clamp_min(1.0))
        loss_fn = self._policy_loss()
        batch, skipped = rows_to_train(batch, self.algo_cfg, loss_fn)
        plan, micro = policy_micro_batches(batch, g.dp_size, g.dp_rank, self.algo_cfg.micro_batch_tokens,
                                           fixed_shape=g.pp_size > 1)
        # Undo the schedule's and DDP's averaging: the loss is already this shard's share.
        scale = plan.num_micro * g.dp_size

        def loss_func(mb, nll):
            lp = self._token_logprobs(nll, mb["input_ids"].shape[1])
            loss, metrics = micro_batch_loss(loss_fn, lp, mb, self.algo_cfg, num_tokens, float(B))
            metrics["loss_share"] = float(loss.detach())
            return loss * scale, metrics

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.recomputed_micro_batches = 0
        out = self._run(micro, loss_func, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        self.steps += 1
        summary: list = []
        if g.is_last_stage:
            summary = [dict(o) for o in out]
        if g.pp_size > 1:
            box = [summary]
            dist.broadcast_object_list(box, src=g.pp_global_rank(g.pp_size - 1), group=g.pp)
            summary = box[0]
        if g.dp_size > 1:
            parts = [None] * g.dp_size
            dist.all_gather_object(parts, summary, group=g.dp)
            summary = [m for p in parts for m in p]
        loss = sum(m.pop("loss_share") for m in summary)
        extra = combine_metrics(summary)
        tokens = extra.get("tokens", 0.0)
        extra["tokens"] = tokens
        extra["update_successful"] = bool(ok)
        extra["recomputed_micro_batches"] = float(self.recomputed_micro_batches)
        extra["rows_skipped"] = float(skipped)
        return StepMetrics(loss=float(loss), grad_norm=float(grad_norm or 0.0),
                           lr=float(self.optimizer.param_groups[0]["lr"]), extra=extra)

    def offload_training_state(self) -> None:
        """Free gradient buffers; on CUDA move the optimizer state (or a frozen copy's weights) to host."""
        cuda = self.groups.device.type == "cuda"
        if self.optimizer is None:
            if cuda:
                self._move_frozen_weights(torch.device("cpu"))
            return
        self.model.offload_grad_buffers(synchronize=cuda, empty_cache=cuda)
        if cuda:
            self.optimizer.offload_to_cpu()

    def onload_training_state(self) -> None:
        cuda = self.groups.device.type == "cuda"
        if self.optimizer is None:
            if cuda:
                self._move_frozen_weights(self.groups.device)
            return
        self.model.restore_grad_buffers(synchronize=cuda)
        if cuda:
            self.optimizer.restore_from_cpu()

    def _move_frozen_weights(self, device: torch.device) -> None:
        """A model without an optimizer: its parameters and buffers to ``device`` (host copies pinned)."""
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                if t.device != device:
                    t.data = t.data.to(device, non_blocking=True) if device.type != "cpu" \
                        else t.data.to(device).pin_memory()
        if device.type == "cpu":
            torch.cuda.empty_cache()

    def export_hf_weights(self, bucket_bytes: int, stats: Optional[HFExportStats] = None
                          ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return export_hf_buckets(self.module, self.layout, self.groups, bucket_bytes, stats=stats)

    def _sharded_state(self, is_loading: bool, with_optimizer: bool) -> dict:
        model_sd = self.module.sharded_state_dict()
        state = {"model": model_sd}
        if with_optimizer and self.optimizer is not None:
            state["optimizer"] = self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
        return state

    def save_checkpoint(self, folder: Path) -> None:
        from megatron.core import dist_checkpointing

        meta = {"kind": "megatron", "steps": self.steps, "dtype": self.dtype_name,
                "tensor_parallel": self.groups.tp_size, "pipeline_parallel": self.groups.pp_size,
                "data_parallel": self.groups.dp_size, "has_optimizer": self.optimizer is not None}
        shield_megatron_writer()
        save_backend_checkpoint(folder, self.model_path, meta,
                                lambda tmp: dist_checkpointing.save(self._sharded_state(False, True), str(tmp)))

    def load_checkpoint(self, folder: Path, load_optimizer: bool = True) -> None:
        from megatron.core import dist_checkpointing

        folder = Path(folder)
        meta = read_backend_meta(folder, "megatron")
        with_opt = load_optimizer and self.optimizer is not None and meta.get("has_optimizer", False)
        state = dist_checkpointing.load(self._sharded_state(True, with_opt), str(folder))
        self.module.load_state_dict(state["model"])
        if with_opt:
            self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(meta.get("steps", 0))
