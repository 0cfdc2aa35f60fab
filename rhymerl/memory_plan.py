"""Start-up estimate of one device's memory in a colocated run, and the fit check.

Each rank holds a training shard and a rollout engine on one device, time-shared
(``rhymerl.colocation``): the engine sleeps while the trainer trains, and the trainer's
gradients and optimizer state leave the device while the engine generates. So the device
must hold the larger of two phases:

- training: weights + gradients + optimizer state (+ master weights in mixed precision)
  + activations and logits of one micro-batch + the frozen reference copy (KL) + what a
  sleeping engine keeps (nothing at sleep levels 1 and 2; everything at 0);
- rollout: the trainer's weights (and reference copy) + the engine's share of the device
  (``rollout.gpu_memory_utilization``: its weights, activations and the KV cache).

plus ``memory.reserve_gb`` (CUDA context, NCCL buffers, allocator fragmentation). A plan that
does not fit is refused before anything is built, naming the keys that change it. The figures
are estimates (formulas below); they are meant to catch plans that are off by tens of GB, not
to predict the allocator to the megabyte.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rhymerl.resharding.layout import ModelLayout

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Saved activations per token per hidden unit of one transformer layer without recomputation,
# in bytes, at 16-bit (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
# Transformer Models": s*b*h*(10 + 24/t), attention scores counted apart).
ACT_BYTES_PER_TOKEN_HIDDEN = 10
ACT_BYTES_PER_TOKEN_HIDDEN_TP = 24
# Of those, the two norms' outputs (the inputs of the QKV and first MLP projections), which
# parallel.recompute_norms drops and recomputes in backward.
ACT_NORM_OUTPUT_BYTES_PER_TOKEN_HIDDEN = 4
# The unfused attention of megatron's local layer spec keeps its scores (16-bit) and the fp32
# softmax of them: bytes per score element.
SCORE_BYTES = 6
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


@dataclass
class MemoryPlan:
    """Bytes per device, by component and phase."""

    device_bytes: float
    reserve_bytes: float
    training: dict[str, float] = field(default_factory=dict)
    rollout: dict[str, float] = field(default_factory=dict)
    kv_cache_bytes: float = 0.0
    kv_needed_bytes: float = 0.0

    @property
    def training_total(self) -> float:
        return sum(self.training.values()) + self.reserve_bytes

    @property
    def rollout_total(self) -> float:
        return sum(self.rollout.values()) + self.reserve_bytes

    def table(self) -> str:
        rows = [f"per-device memory plan (GB; device {self.device_bytes / GB:.1f}, reserve {self.reserve_bytes / GB:.1f}):"]
        for phase, parts, total in (("training", self.training, self.training_total),
                                    ("rollout", self.rollout, self.rollout_total)):
            rows.append(f"  {phase}: {total / GB:.1f} = " + " + ".join(f"{k} {v / GB:.1f}" for k, v in parts.items()))
        rows.append(f"  engine KV cache {self.kv_cache_bytes / GB:.1f} (one max_model_len sequence needs "
                    f"{self.kv_needed_bytes / GB:.2f})")
        return "\n".join(rows)


def estimate(cfg, size: ModelLayout, world_size: int, device_bytes: float) -> MemoryPlan:
    """The plan of one device for ``cfg`` (a RunConfig) on ``world_size`` ranks of ``device_bytes`` each."""
    p, r, a = cfg.parallel, cfg.rollout, cfg.algo
    tp, pp = p.tensor_parallel, p.pipeline_parallel
    dp = max(world_size // (tp * pp), 1)
    wb = DTYPE_BYTES[cfg.model.dtype]
    n = model_params(size)
    # Layers split over pipeline stages and every matrix over TP; the embedding (and an untied
    # head) sit on the first (last) stage: charge the larger, first-stage share.
    shard = size.num_layers / pp * layer_params(size) / tp + embedding_params(size) / tp
    mixed = wb != 4
    # megatron reduces gradients in fp32; Adam keeps two fp32 moments, and mixed precision an
    # fp32 master copy. The distributed optimizer shards the fp32 state over DP.
    opt_per_param = 8 + (4 if mixed else 0)
    opt_share = dp if p.distributed_optimizer else 1
    tokens = max(a.micro_batch_tokens, r.max_model_len)
    h, layers = size.hidden_size, size.num_layers // pp

    def activations_of(n_tok: int, recompute: bool) -> float:
        seq = min(r.max_model_len, n_tok)
        full_layer = n_tok * h * (ACT_BYTES_PER_TOKEN_HIDDEN + ACT_BYTES_PER_TOKEN_HIDDEN_TP / tp) * wb / 2
        kept_layer = full_layer - (n_tok * h * ACT_NORM_OUTPUT_BYTES_PER_TOKEN_HIDDEN * wb / 2
                                   if p.recompute_norms else 0)
        # Fused attention (parallel.attention=sdpa) keeps one log-sum-exp per row and head instead.
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
        # A micro-batch within the budget keeps its activations; a longer row recomputes.
        activations = max(activations_of(a.micro_batch_tokens, False), activations_of(r.max_model_len, True))
    else:
        activations = activations_of(tokens, False)
    logits = tokens * size.vocab_size / tp * LOGIT_COPIES_BYTES
    training = {"weights": shard * wb, "grads": shard * 4, "optimizer": shard * opt_per_param / opt_share,
                "activations": activations, "logits": logits}
    resident = {"weights": shard * wb}
    if a.kl_coef > 0:
        training["reference"] = shard * wb
        resident["reference"] = shard * wb
    engine_share = r.gpu_memory_utilization * device_bytes
    engine_weights = n * wb / r.tensor_parallel
    if r.sleep_level == 0:
        training["engine (awake)"] = engine_share
    plan = MemoryPlan(device_bytes=device_bytes, reserve_bytes=cfg.memory.reserve_gb * GB, training=training,
                      rollout={**resident, "engine": engine_share})
    # vLLM's own activation peak during profiling: one batch of max_num_batched_tokens.
    engine_act = max(r.max_model_len, 2048) * (h * 4 * wb + size.vocab_size * 4 / r.tensor_parallel)
    plan.kv_cache_bytes = engine_share - engine_weights - engine_act
    plan.kv_needed_bytes = r.max_model_len * kv_bytes_per_token(size, wb, r.tensor_parallel)
    return plan


def check(plan: MemoryPlan) -> None:
    """Raise MemoryPlanError naming the keys to change when the plan cannot fit."""
    cap = plan.device_bytes
    problems = []
    if plan.training_total > cap:
        problems.append(
            f"training needs {plan.training_total / GB:.1f} GB of {cap / GB:.1f} GB: raise parallel.tensor_parallel or "
            "parallel.pipeline_parallel, set parallel.distributed_optimizer=true or parallel.recompute_activations=true, "
            "lower algo.micro_batch_tokens (or rollout.max_model_len, the longest sequence), or set rollout.sleep_level=2")
    if plan.rollout_total > cap:
        problems.append(
            f"rollout needs {plan.rollout_total / GB:.1f} GB of {cap / GB:.1f} GB: lower rollout.gpu_memory_utilization "
            "(the trainer's weights stay on the device) or raise parallel.tensor_parallel")
    if plan.kv_cache_bytes < plan.kv_needed_bytes:
        problems.append(
            f"the engine's KV cache ({plan.kv_cache_bytes / GB:.2f} GB after its weights) cannot hold one "
            f"rollout.max_model_len sequence ({plan.kv_needed_bytes / GB:.2f} GB): raise rollout.gpu_memory_utilization "
            "or rollout.tensor_parallel, or lower rollout.max_model_len")
    if problems:
        raise MemoryPlanError("memory plan does not fit one device:\n  " + "\n  ".join(problems) + "\n" + plan.table())


def check_run(cfg, model_path, world_size: int, device) -> "MemoryPlan | None":
    """The start-up check: estimate the plan for the run's device and refuse it if it cannot fit.

    The device's size is ``memory.device_gb`` or, on CUDA, what the device reports; on a CPU host
    without ``memory.device_gb`` there is no per-device budget to hold the plan to (the engine
    takes ``rollout.cpu_kv_cache_gb`` of host memory and never sleeps) and nothing is checked."""
    import json
    import logging
    from pathlib import Path

    if cfg.memory.device_gb:
        cap = cfg.memory.device_gb * GB
    elif getattr(device, "type", "cpu") == "cuda":
        import torch

        cap = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        return None
    size = ModelLayout.from_hf_config(json.loads((Path(model_path) / "config.json").read_text()))
    plan = estimate(cfg, size, world_size, cap)
    logging.getLogger("rhymerl.memory").info("%s", plan.table())
    if cfg.memory.check:
        check(plan)
    return plan


# vLLM's KV block size on CPU: a sequence's last block is allocated whole.
KV_BLOCK_TOKENS = 16
# vLLM's CPU cache layout costs more per token than K and V alone (a Qwen2.5-0.5B-shaped model
# got 896 of 1024 tokens from 1.1x), and below a floor the fixed parts dominate.
KV_MARGIN = 1.5
KV_FLOOR_BYTES = 32 << 20


def cpu_kv_cache_bytes(layout: ModelLayout, rollout_cfg, dtype: str, sequences: int, longest_prompt: int) -> int:
    """The KV cache a CPU engine needs for one step: the step's concurrent sequences at their
    longest (prompt + response + draft slots), and at least one ``max_model_len`` sequence
    (vLLM refuses to start otherwise). A larger cache only holds zeros: on CPU it is resident
    memory taken from the trainer next to it."""
    r = rollout_cfg
    max_len = min(r.max_model_len, layout.max_position_embeddings)
    per_seq = min(longest_prompt + r.max_tokens + r.num_speculative_tokens + KV_BLOCK_TOKENS, max_len)
    tokens = max(min(r.max_num_seqs, sequences) * per_seq, max_len)
    return max(int(tokens * kv_bytes_per_token(layout, DTYPE_BYTES[dtype], r.tensor_parallel) * KV_MARGIN),
               KV_FLOOR_BYTES)
