"""Start-up estimate of one device's memory per colocated phase; a plan that does not fit is refused."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rhymerl.resharding.layout import ModelLayout

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Saved activation bytes per token and hidden unit of a 16-bit layer: 10 + 24/t (Korthikanti et al. 2022).
ACT_BYTES_PER_TOKEN_HIDDEN = 10
ACT_BYTES_PER_TOKEN_HIDDEN_TP = 24
# Of those, the two norms' outputs, which parallel.recompute_norms recomputes.
ACT_NORM_OUTPUT_BYTES_PER_TOKEN_HIDDEN = 4
SCORE_BYTES = 6  # per score element: unfused attention keeps 16-bit scores and their fp32 softmax
# Logits of a micro-batch: the vocabulary-parallel logits, their fp32 copy and its gradient.
LOGIT_COPIES_BYTES = 2 + 4 + 4


class MemoryPlanError(ValueError):
    """The plan does not fit; the message names the keys to change."""


def layer_params(m: ModelLayout) -> int:
    h, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if m.qkv_bias else 0)
    return attn + 3 * h * m.ffn_hidden_size + 2 * h


def embedding_params(m: ModelLayout) -> int:
    return m.vocab_size * m.hidden_size * (1 if m.tied else 2)


def model_params(m: ModelLayout) -> int:
    return m.num_layers * layer_params(m) + embedding_params(m) + m.hidden_size


def kv_bytes_per_token(m: ModelLayout, dtype_bytes: int, tp: int) -> float:
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * dtype_bytes / tp


# A sleeping engine keeps its CUDA graphs (vLLM's sleep releases only weights and KV cache) and NCCL buffers.
GRAPH_POOL_BYTES = 2 * GB
ENGINE_NCCL_BYTES = 1 * GB
# The reshard's transient: one bucket of gathered tensors (the trainer's RESHARD_BUCKET_BYTES).
RESHARD_BUCKET_BYTES = 64 << 20


@dataclass
class Phase:
    """One boundary of the timeline: what is resident, and what it may use."""

    name: str
    parts: dict[str, float]
    limit: float
    rule: str = ""

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def headroom(self) -> float:
        return self.limit - self.total


@dataclass
class MemoryPlan:
    """Bytes per device, by phase."""

    device_bytes: float
    reserve_bytes: float
    phases: list[Phase] = field(default_factory=list)
    kv_cache_bytes: float = 0.0
    kv_needed_bytes: float = 0.0

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    @property
    def training(self) -> dict[str, float]:
        return self.phase("training").parts

    @property
    def training_total(self) -> float:
        return self.phase("training").total

    @property
    def rollout_total(self) -> float:
        return self.phase("rollout").total

    def table(self) -> str:
        rows = [f"per-device memory plan (GB = 1e9 bytes; device {self.device_bytes / GB:.1f}, "
                f"reserve {self.reserve_bytes / GB:.1f} in every phase):",
                f"  {'phase':<13}{'resident':>9}{'limit':>8}{'headroom':>10}  what"]
        for p in self.phases:
            what = " + ".join(f"{k} {v / GB:.1f}" for k, v in p.parts.items() if v)
            rows.append(f"  {p.name:<13}{p.total / GB:>9.1f}{p.limit / GB:>8.1f}{p.headroom / GB:>10.1f}  {what}"
                        + (f"  [{p.rule}]" if p.rule else ""))
        rows.append(f"  engine KV cache {self.kv_cache_bytes / GB:.1f} (one max_model_len sequence needs "
                    f"{self.kv_needed_bytes / GB:.2f})")
        return "\n".join(rows)


def estimate(cfg, size: ModelLayout, world_size: int, device_bytes: float) -> MemoryPlan:
    """The plan of one device for ``cfg`` on ``world_size`` ranks of ``device_bytes`` (CUDA's total) each."""
    p, r, a = cfg.parallel, cfg.rollout, cfg.algo
    tp, pp = p.tensor_parallel, p.pipeline_parallel
    dp = max(world_size // (tp * pp), 1)
    wb = DTYPE_BYTES[cfg.model.dtype]
    n = model_params(size)
    # Charge the larger, first-stage share (it holds the embedding).
    shard = size.num_layers / pp * layer_params(size) / tp + embedding_params(size) / tp
    mixed = wb != 4
    # fp32 grads; Adam's two fp32 moments, plus an fp32 master copy in mixed precision.
    opt_per_param = 8 + (4 if mixed else 0)
    opt_share = dp if p.distributed_optimizer else 1
    tokens = max(a.micro_batch_tokens, r.max_model_len)
    h, layers = size.hidden_size, size.num_layers // pp

    def activations_of(n_tok: int, recompute: bool) -> float:
        seq = min(r.max_model_len, n_tok)
        full_layer = n_tok * h * (ACT_BYTES_PER_TOKEN_HIDDEN + ACT_BYTES_PER_TOKEN_HIDDEN_TP / tp) * wb / 2
        kept_layer = full_layer - (n_tok * h * ACT_NORM_OUTPUT_BYTES_PER_TOKEN_HIDDEN * wb / 2
                                   if p.recompute_norms else 0)
        # Fused attention (sdpa) keeps one log-sum-exp per row and head instead.
        scores = n_tok * seq * (size.num_heads / tp) * SCORE_BYTES if p.attention == "unfused" \
            else n_tok * (size.num_heads / tp) * 4
        if recompute:
            # Only each layer's input is kept; backward recomputes one layer at a time.
            return layers * n_tok * h * wb + full_layer + scores
        return layers * (kept_layer + scores)

    if p.recompute_activations:
        activations = activations_of(tokens, True)
    elif (p.recompute_over_budget and p.backend == "megatron" and not p.recompute_norms
          and r.max_model_len > a.micro_batch_tokens):
        activations = max(activations_of(a.micro_batch_tokens, False), activations_of(r.max_model_len, True))
    else:
        activations = activations_of(tokens, False)
    logits = tokens * size.vocab_size / tp * LOGIT_COPIES_BYTES
    reserve = cfg.memory.reserve_gb * GB
    weights = shard * wb
    engine_share = r.gpu_memory_utilization * device_bytes
    engine_weights = n * wb / r.tensor_parallel
    engine_nccl = ENGINE_NCCL_BYTES if r.tensor_parallel > 1 else 0.0
    graphs = 0.0 if r.enforce_eager else GRAPH_POOL_BYTES
    asleep = {"engine graphs": graphs, "engine NCCL": engine_nccl}
    training = {"weights": weights, "grads": shard * 4, "optimizer": shard * opt_per_param / opt_share,
                "activations": activations, "logits": logits}
    if a.kl_coef > 0:
        training["reference"] = weights
    if r.sleep_level == 0:
        training.update({"engine (awake)": engine_share, "engine NCCL": engine_nccl})
    else:
        training.update(asleep)
    # The reshard gathers each full tensor; the largest is the embedding.
    largest = size.vocab_size * size.hidden_size * wb
    phases = [
        Phase("engine build", {"weights": weights, "engine NCCL": engine_nccl, "reserve": reserve},
              device_bytes - engine_share,
              f"vLLM: free >= gpu_memory_utilization {r.gpu_memory_utilization} x {device_bytes / GB:.1f}"),
        Phase("rollout", {"weights": weights, "engine": engine_share, "engine NCCL": engine_nccl, "reserve": reserve},
              device_bytes),
        Phase("training", {**training, "reserve": reserve}, device_bytes),
        Phase("wake", {"weights": weights, "engine weights": engine_weights, **asleep,
                       "reshard": RESHARD_BUCKET_BYTES + largest, "reserve": reserve}, device_bytes)]
    plan = MemoryPlan(device_bytes=device_bytes, reserve_bytes=reserve, phases=phases)
    # vLLM's own activation peak during profiling: one batch of max_num_batched_tokens.
    engine_act = max(r.max_model_len, 2048) * (h * 4 * wb + size.vocab_size * 4 / r.tensor_parallel)
    plan.kv_cache_bytes = engine_share - engine_weights - engine_act - graphs
    plan.kv_needed_bytes = r.max_model_len * kv_bytes_per_token(size, wb, r.tensor_parallel)
    return plan


# What changes each phase's footprint, named in its refusal.
PHASE_KEYS = {
    "engine build": "lower rollout.gpu_memory_utilization (the engine asks for that share of the device free, "
                    "next to the trainer's weights) or raise parallel.tensor_parallel / parallel.pipeline_parallel",
    "rollout": "lower rollout.gpu_memory_utilization (the trainer's weights stay on the device) or raise "
               "parallel.tensor_parallel",
    "training": "raise parallel.tensor_parallel or parallel.pipeline_parallel, set parallel.distributed_optimizer=true "
                "or parallel.recompute_activations=true, lower algo.micro_batch_tokens (or rollout.max_model_len, "
                "the longest sequence), or set rollout.sleep_level to 1 or 2",
    "wake": "raise rollout.tensor_parallel (the engine's weights per device) or parallel.tensor_parallel"}


def check(plan: MemoryPlan) -> None:
    """Raise MemoryPlanError naming each phase that cannot fit, its shortfall and the keys to change."""
    problems = []
    for ph in plan.phases:
        if ph.total > ph.limit:
            problems.append(f"{ph.name} needs {ph.total / GB:.1f} GB where {ph.limit / GB:.1f} GB may be used "
                            f"({(ph.total - ph.limit) / GB:.1f} GB short{'; ' + ph.rule if ph.rule else ''}): "
                            f"{PHASE_KEYS[ph.name]}")
    if plan.kv_cache_bytes < plan.kv_needed_bytes:
        problems.append(
            f"the engine's KV cache ({plan.kv_cache_bytes / GB:.2f} GB after its weights) cannot hold one "
            f"rollout.max_model_len sequence ({plan.kv_needed_bytes / GB:.2f} GB): raise rollout.gpu_memory_utilization "
            "or rollout.tensor_parallel, or lower rollout.max_model_len")
    if problems:
        raise MemoryPlanError("memory plan does not fit one device:\n  " + "\n  ".join(problems) + "\n" + plan.table())


def check_run(cfg, model_path, world_size: int, device) -> "MemoryPlan | None":
    """Estimate the plan for the run's device and refuse it if it cannot fit; None without a device budget."""
    if getattr(device, "type", "cpu") == "cuda":
        cap = float(torch.cuda.get_device_properties(device).total_memory)
    elif cfg.memory.device_gb:
        cap = cfg.memory.device_gb * GB
    else:
        return None
    size = ModelLayout.from_hf_config(json.loads((Path(model_path) / "config.json").read_text()))
    plan = estimate(cfg, size, world_size, cap)
    logging.getLogger("rhymerl.memory").info("%s", plan.table())
    if cfg.memory.check:
        check(plan)
    return plan


def planned_table(cfg, world_size: int) -> str:
    """The plan of ``cfg`` for ``--print-config``, or a line saying what it needs; raises MemoryPlanError."""
    if not cfg.memory.device_gb:
        return "memory plan: set memory.device_gb to plan a GPU device's memory (CPU hosts have no per-device budget)"
    folder = Path(cfg.model.path).expanduser()
    if not (folder / "config.json").is_file():
        return f"memory plan: needs the model's shape ({folder / 'config.json'} is not readable here)"
    size = ModelLayout.from_hf_config(json.loads((folder / "config.json").read_text()))
    plan = estimate(cfg, size, world_size, cfg.memory.device_gb * GB)
    if cfg.memory.check:
        check(plan)
    return plan.table()


KV_BLOCK_TOKENS = 16  # vLLM's KV block size on CPU: a sequence's last block is allocated whole
# vLLM's CPU cache layout costs more per token than K and V alone; below a floor fixed parts dominate.
KV_MARGIN = 1.5
KV_FLOOR_BYTES = 32 << 20


def cpu_kv_cache_bytes(layout: ModelLayout, rollout_cfg, dtype: str, sequences: int, longest_prompt: int) -> int:
    """The KV cache a CPU engine needs for one step, at least one ``max_model_len`` sequence (no more)."""
    r = rollout_cfg
    max_len = min(r.max_model_len, layout.max_position_embeddings)
    per_seq = min(longest_prompt + r.max_tokens + r.num_speculative_tokens + KV_BLOCK_TOKENS, max_len)
    tokens = max(min(r.max_num_seqs, sequences) * per_seq, max_len)
    return max(int(tokens * kv_bytes_per_token(layout, DTYPE_BYTES[dtype], r.tensor_parallel) * KV_MARGIN),
               KV_FLOOR_BYTES)
