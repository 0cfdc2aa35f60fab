"""Typed run configuration, the single source of defaults; YAML and overrides load strictly."""

from __future__ import annotations

import dataclasses
import getpass
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
    # The run's name (W&B, Slurm job name).
    name: str = "rhymerl"
    # Seeds data order, sampling and initialisation: a run is reproduced from it.
    seed: int = 1234
    # The run folder: metrics, traces, checkpoints, W&B files, error logs.
    output_dir: str = "runs/rhymerl"
    # Stop after this many RL steps (0 = run all epochs).
    max_steps: int = 0
    # Passes over the prompt set (each prompt is revisited once per epoch).
    epochs: int = 2
    # Append every response to <output_dir>/traces.jsonl (rhymerl.outputs.traces format).
    save_traces: bool = True


@dataclass
class ModelConfig:
    # "builtin:smollm2-135m-instruct", "builtin:tiny" (a small random model, for tests), or an HF folder.
    path: str = "builtin:smollm2-135m-instruct"
    # Weights' dtype in training and rollout (training in bfloat16 needs CUDA).
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


@dataclass
class ParallelConfig:
    # Training backend: megatron-core (TP/PP/DP) or DeepSpeed ZeRO (data parallel only).
    backend: Literal["megatron", "deepspeed"] = "megatron"
    # Megatron tensor-parallel ranks per model copy.
    tensor_parallel: int = 1
    # Megatron pipeline stages per model copy.
    pipeline_parallel: int = 1
    # Expected number of ranks, checked against the launcher's; 0 = take it from the launcher.
    world_size: int = 0
    # DeepSpeed backend: the ZeRO stage.
    zero_stage: Literal[0, 1, 2, 3] = 1
    # torch.distributed backend; auto = nccl on CUDA, gloo elsewhere.
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    # Megatron's distributed optimizer: the fp32 optimizer state sharded over data parallel (CUDA only).
    distributed_optimizer: bool = False
    # Megatron's full activation recomputation: only each layer's input is kept for backward.
    recompute_activations: bool = False
    # Megatron's selective recomputation of the RMSNorm outputs (ignored under recompute_activations).
    recompute_norms: bool = False
    # A micro-batch over algo.micro_batch_tokens recomputes its layers in backward (megatron).
    recompute_over_budget: bool = True
    # Megatron's core attention: torch's fused scaled_dot_product_attention, or megatron's own.
    attention: Literal["sdpa", "unfused"] = "sdpa"


@dataclass
class RolloutConfig:
    # Responses sampled per prompt (a GRPO group).
    n: int = 4
    # Sampling temperature (0 = greedy).
    temperature: float = 1.0
    # Nucleus sampling threshold.
    top_p: float = 1.0
    # Top-k sampling (-1 = off).
    top_k: int = -1
    # Longest response, in tokens.
    max_tokens: int = 64
    # Speculative method inside the vLLM engine (ngram and suffix are vLLM's own).
    speculative: Literal["none", "ngram", "suffix", "histospec"] = "histospec"
    # Longest draft a step may verify per request.
    num_speculative_tokens: int = 8
    # Requests an engine runs at once.
    max_num_seqs: int = 64
    # The engine's context length: prompt + response + draft slots.
    max_model_len: int = 1024
    # GPU engines: the device share vLLM takes (weights, activations, CUDA graphs, KV cache).
    gpu_memory_utilization: float = 0.5
    # GPU engines: run without CUDA graphs.
    enforce_eager: bool = True
    # Ranks per rollout engine (consecutive ranks of a node); world_size / this instances.
    tensor_parallel: int = 1
    # Engine sleep while training: 1 offloads its weights to host, 2 discards them, 0 keeps it resident.
    sleep_level: int = 2


@dataclass
class HistoSpecConfig:
    # Past visits (epochs) of each prompt kept as its history draft source.
    epochs_kept: int = 3
    # Most history tokens stored, oldest visits evicted first; 0 = sized from the dataset and memory.
    token_budget: int = 0
    # With token_budget 0: the share of the node's available memory the store may use, over its ranks.
    memory_fraction: float = 0.25
    # Most tokens in the cross-prompt index (other prompts' kept visits, newest first); 0 = none.
    global_token_budget: int = 2_000_000
    # Draft prices: the device kind's step-cost prior (runs and resumes replay exactly), or refitted as the engine runs.
    step_cost: Literal["measured", "prior"] = "prior"
    # A step drafts only if predicted to beat drafting nothing by this relative margin (measured: or the fit's error).
    min_goodput_gain: float = 0.05


@dataclass
class HistoPipeConfig:
    # Schedule requests by their prompts' earlier lengths (live or planned); false: round-robin.
    enabled: bool = True
    # Weight of each older epoch's lengths in a prompt's length estimate.
    decay: float = 0.5
    # Live dispatch: a response past exp(log-mean + z x sigma) tokens is a straggler, movable.
    straggler_z: float = 2.0
    # Live dispatch: seconds each engine steps between two exchanges of progress between ranks.
    slice_s: float = 0.05
    # Live dispatch: the step-cost prior's calibration JSON (empty: the shipped H100 roofline).
    calibration: str = ""


@dataclass
class AlgorithmConfig:
    # GRPO, or DAPO (asymmetric clipping, dynamic sampling, overlong shaping).
    name: Literal["grpo", "dapo"] = "grpo"
    # Adam's learning rate.
    lr: float = 1e-5
    # Adam's weight decay.
    weight_decay: float = 0.0
    # Adam's betas.
    betas: tuple[float, float] = (0.9, 0.999)
    # Adam's epsilon.
    adam_eps: float = 1e-8
    # Gradient norm clip (0 = off).
    grad_clip: float = 1.0
    # PPO clip range below 1.
    eps_low: float = 0.2
    # PPO clip range above 1 (DAPO raises it).
    eps_high: float = 0.2
    # Weight of the KL penalty against the initial policy (0 = no reference model).
    kl_coef: float = 0.0
    # Loss averaged over every token of the batch, or per response then over responses.
    loss_agg: Literal["token", "sequence"] = "token"
    # Divide advantages by the group's std (GRPO); false only centres them (Dr. GRPO).
    scale_by_std: bool = True
    # DAPO: keep only groups whose rewards differ, refilling the batch from further prompts.
    dynamic_sampling: bool = False
    # DAPO: at most this many refill batches per step.
    max_refill_rounds: int = 3
    # DAPO: responses within this many tokens of rollout.max_tokens are penalised (0 = off).
    overlong_buffer: int = 0
    # DAPO: the penalty at rollout.max_tokens.
    overlong_penalty: float = 1.0
    # Tokens per training micro-batch (a longer row trains alone).
    micro_batch_tokens: int = 4096
    # Optimiser steps per rollout batch (1 = strictly on-policy).
    updates_per_step: int = 1
    # Skip rows whose loss and gradient are zero whatever the weights; the update is the same.
    skip_zero_advantage_rows: bool = True
    # Log train/update_gain (the update's move towards the better responses); costs a forward pass.
    log_update_gain: bool = False


@dataclass
class DataConfig:
    # Where prompts come from: reasoning-gym tasks, or a JSONL / Parquet file.
    source: Literal["reasoning_gym", "jsonl", "parquet"] = "reasoning_gym"
    # source=reasoning_gym: the task names.
    tasks: list[str] = field(default_factory=lambda: ["basic_arithmetic"])
    # source=reasoning_gym: each task's arguments, by task name.
    task_args: dict[str, Any] = field(default_factory=dict)
    # source=reasoning_gym: prompts generated.
    size: int = 32
    # source=reasoning_gym: the generator's seed (a fixed prompt set).
    seed: int = 7
    # source=jsonl|parquet: the prompt file.
    path: str = ""
    # Prompts per RL step.
    prompts_per_step: int = 8
    # Shuffle the prompts each epoch (seeded by run.seed).
    shuffle: bool = True
    # Render prompts with the tokenizer's chat template.
    chat_template: bool = True
    # A system message before each prompt.
    system_prompt: str = ""
    # Solved examples from the dataset put before each prompt.
    few_shot: int = 0
    # Longest prompt, in tokens (a longer one is refused at start-up).
    max_prompt_tokens: int = 512
    # What a plain-text prompt asks for: the answer, the work then "Answer: ...", or nothing.
    answer_format: Literal["final_only", "step_by_step", "none"] = "final_only"


@dataclass
class RewardConfig:
    # The verifier: math-verify, exact match, or auto (by the dataset row).
    kind: Literal["auto", "math_verify", "exact"] = "auto"
    # Scoring processes (0 = in the trainer's process).
    workers: int = 2
    # Seconds a response may take to score before it counts as failed.
    timeout_s: float = 5.0
    # A step with more failed items (errors, timeouts) than this fraction stops the run.
    max_error_rate: float = 0.5
    # "package.module:callable" scoring every item instead of the built-in scorers.
    function: str = ""


@dataclass
class CheckpointConfig:
    # Checkpoint folder ("" = <run.output_dir>/checkpoints).
    dir: str = ""
    # Save every this many steps (0 = only at the end and on preemption).
    every_steps: int = 0
    # Checkpoints kept (the oldest are deleted).
    keep_last: int = 2
    # "auto" resumes from the newest valid checkpoint in `dir`; "never"; or a path.
    resume: str = "auto"
    # With resume=never: delete the checkpoints another run left in `dir` (refused otherwise).
    overwrite: bool = False


@dataclass
class TrackingConfig:
    # W&B mode (offline files sync later with `wandb sync`).
    wandb: Literal["offline", "online", "disabled"] = "offline"
    # W&B project.
    project: str = "rhymerl"
    # W&B entity ("" = the default of the logged-in account).
    entity: str = ""
    # A table of sample responses every this many steps (0 = never).
    log_samples_every: int = 5
    # Console output of rank 0: a rich table, plain lines, or nothing.
    console: Literal["rich", "plain", "none"] = "plain"
    # Seconds between live progress lines inside a step's rollout and training (0 = off).
    progress_interval_s: float = 10.0


@dataclass
class SlurmConfig:
    # sbatch --partition ("" = the site's default).
    partition: str = ""
    # sbatch --account ("" = the site's default).
    account: str = ""
    # Nodes of the job.
    nodes: int = 1
    # GPUs per node, one task each (0 = CPU tasks with gloo).
    gpus_per_node: int = 0
    # CPU jobs: tasks per node.
    tasks_per_node: int = 1
    # CPUs per task.
    cpus_per_task: int = 1
    # Time limit (Slurm's formats).
    time: str = "01:00:00"
    # Seconds before the time limit the job checkpoints and requeues itself.
    signal_lead_s: int = 120
    # Send Slurm's warning to the batch shell (--signal=B:; a notice rank 0 polls), not the tasks.
    signal_batch: bool = False
    # Requeue the job after a preemption or a time-limit stop.
    requeue: bool = True
    # Folder of the per-job logs.
    log_dir: str = "slurm-logs"
    # Further #SBATCH lines, e.g. "--mem-per-cpu=4G".
    extra_sbatch: list[str] = field(default_factory=list)
    # Shell lines run before srun (module loads, venv activation).
    setup: list[str] = field(default_factory=list)
    # Interpreter on the compute nodes ("" = the one that rendered the script).
    python: str = ""
    # Network interface for gloo/NCCL sockets ("" = the one that routes to MASTER_ADDR, found by each rank).
    socket_ifname: str = ""


@dataclass
class MemoryConfig:
    """The start-up check that the colocated plan fits one device (rhymerl.distributed.memory_plan)."""

    # Refuse at start-up a plan that does not fit (false: only log it).
    check: bool = True
    # One device's total memory in GB, for planning off the device (on CUDA the device's own).
    device_gb: float = 0.0
    # Held back in every phase: CUDA context, the trainer's NCCL buffers, allocator fragmentation.
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
    """Load a YAML file (optional) and ``key.sub=value`` overrides strictly; ``report_unused`` warns of unread keys."""
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
        report_ignored(cfg, user_set_keys(data, overrides))
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


# Fields that name files or folders: "$VAR", "${VAR}" and "~" are expanded at load time.
PATH_FIELDS = ("run.output_dir", "model.path", "data.path", "checkpoint.dir",
               "checkpoint.resume", "slurm.log_dir", "slurm.python")
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    if "USER" not in env:  # unset in some containers and batch environments; the login name is meant

        try:
            env["USER"] = getpass.getuser()
        except Exception:
            pass
    return env


def expand_paths(cfg: RunConfig) -> None:
    """Expand ``$VAR``, ``${VAR}`` and ``~`` in the path fields, in place; an unset variable is an error."""
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
    """Of the dotted keys the user set, those the chosen path does not read, with the reason."""
    return [f"{k}: set but unused because {why}" for k, why in _unused(cfg, given)]


def _unused(cfg: RunConfig, given: set[str]) -> list[tuple[str, str]]:
    """(key, why) for each of ``given`` (or a section above one of them) that ``cfg`` does not read."""
    r, h, hp, a, d, p = cfg.rollout, cfg.histospec, cfg.histopipe, cfg.algo, cfg.data, cfg.parallel
    unused: list[tuple[str, str]] = []

    def when(cond: bool, keys, why: str) -> None:
        if cond:
            unused.extend((k, why) for k in ([keys] if isinstance(keys, str) else keys))

    when(d.source == "reasoning_gym", "data.path", "data.source is 'reasoning_gym'")
    when(d.source != "reasoning_gym", ["data.tasks", "data.task_args", "data.size"], f"data.source is {d.source!r}")
    when(r.speculative == "none", "rollout.num_speculative_tokens", "rollout.speculative is 'none'")
    when(r.speculative != "histospec", [f"histospec.{f.name}" for f in dataclasses.fields(HistoSpecConfig)],
         f"rollout.speculative is {r.speculative!r}")
    when(not hp.enabled, [f"histopipe.{f.name}" for f in dataclasses.fields(HistoPipeConfig) if f.name != "enabled"],
         "histopipe.enabled is false")
    when(not a.dynamic_sampling, "algo.max_refill_rounds", "algo.dynamic_sampling is false")
    when(a.overlong_buffer == 0, "algo.overlong_penalty", "algo.overlong_buffer is 0")
    # Every row then carries the KL term's gradient, so none is left out.
    when(a.kl_coef > 0, "algo.skip_zero_advantage_rows", f"algo.kl_coef is {a.kl_coef}")
    when(p.backend == "megatron", "parallel.zero_stage", "parallel.backend is 'megatron'")
    when(p.backend == "deepspeed", ["parallel.distributed_optimizer", "parallel.recompute_activations",
                                    "parallel.recompute_norms", "parallel.recompute_over_budget", "parallel.attention"],
         "parallel.backend is 'deepspeed'")
    when(p.backend == "megatron" and p.recompute_activations, ["parallel.recompute_norms",
                                                                "parallel.recompute_over_budget"],
         "parallel.recompute_activations is true")
    when(p.backend == "megatron" and p.recompute_norms and not p.recompute_activations,
         "parallel.recompute_over_budget", "parallel.recompute_norms is true")
    when(cfg.tracking.wandb == "disabled", ["tracking.project", "tracking.entity"], "tracking.wandb is 'disabled'")
    return [(k, why) for k, why in unused if k in given or any(g.startswith(k + ".") for g in given)]


def user_set_keys(data: dict, overrides: list[str] | tuple[str, ...]) -> set[str]:
    """The keys unused-key warnings are about: every override, and file keys the file itself leaves unused."""
    keys = set(_flat_keys(with_overrides({}, overrides)))
    from_file = set(_flat_keys(data)) - keys
    if not from_file:
        return keys
    try:
        file_cfg = _build(RunConfig, data)
    except ConfigError:
        return keys | from_file  # the file alone does not load: hold all of it against the run
    return keys | {k for k, _ in _unused(file_cfg, from_file)}


def report_ignored(cfg: RunConfig, given: set[str]) -> list[str]:
    """Warn about each set-but-unused key; returns the messages."""
    msgs = ignored_keys(cfg, given)
    for m in msgs:
        logging.getLogger("rhymerl.config").warning("config: %s", m)
    return msgs


def to_dict(cfg: Any) -> dict:
    """Plain data of a config for YAML, checkpoints and W&B, with secrets in ``slurm.setup`` redacted."""
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


# NAME=value where NAME looks like a credential (WANDB_API_KEY, HF_TOKEN...), and `wandb login KEY`.
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


def _require(cond: bool, path: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{path}: {msg}")


def check_static(cfg: RunConfig) -> None:
    """Checks that need nothing but the config itself."""
    p, r, h, a, d = cfg.parallel, cfg.rollout, cfg.histospec, cfg.algo, cfg.data
    _require(p.tensor_parallel >= 1, "parallel.tensor_parallel", "must be >= 1")
    _require(p.pipeline_parallel >= 1, "parallel.pipeline_parallel", "must be >= 1")
    _require(p.world_size >= 0, "parallel.world_size", "must be >= 0 (0 = from the launcher)")
    _require(cfg.tracking.progress_interval_s >= 0, "tracking.progress_interval_s", "must be >= 0 (0 = off)")
    if p.backend == "deepspeed":
        _require(p.tensor_parallel == 1 and p.pipeline_parallel == 1, "parallel.backend",
                 "deepspeed shards with ZeRO only; set parallel.tensor_parallel=1 and parallel.pipeline_parallel=1")
    if p.world_size:
        mp = p.tensor_parallel * p.pipeline_parallel
        _require(p.world_size % mp == 0, "parallel.world_size",
                 f"{p.world_size} is not divisible by tensor_parallel*pipeline_parallel={mp}")
    _require(r.n >= 1, "rollout.n", "must be >= 1")
    # Group-relative advantages: with one response per prompt the run would train on nothing.
    _require(r.n >= 2, "rollout.n", f"is {r.n}, but algo.name={a.name!r} compares each response with the other "
             "responses to its prompt (group-relative advantages): with one per prompt every advantage, loss "
             "and gradient is 0; set rollout.n >= 2")
    _require(r.temperature >= 0, "rollout.temperature", "must be >= 0")
    _require(0 < r.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
    _require(r.max_tokens >= 1, "rollout.max_tokens", "must be >= 1")
    _check_lengths(r, d)
    _require(r.num_speculative_tokens >= 1, "rollout.num_speculative_tokens", "must be >= 1")
    _require(r.sleep_level in (0, 1, 2), "rollout.sleep_level", "allowed values: 0, 1, 2")
    _require(h.epochs_kept >= 1, "histospec.epochs_kept", "must be >= 1")
    _require(h.global_token_budget >= 0, "histospec.global_token_budget", "must be >= 0 (0 = no cross-prompt drafts)")
    _require(h.token_budget >= 0, "histospec.token_budget", "must be >= 0 (0 = sized from the dataset and memory)")
    _require(0 < h.memory_fraction <= 1, "histospec.memory_fraction", "must be in (0, 1]")
    _require(h.min_goodput_gain >= 0, "histospec.min_goodput_gain", "must be >= 0")
    _require(cfg.histopipe.straggler_z > 0, "histopipe.straggler_z", "must be > 0")
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
    max_position_embeddings: Optional[int] = None  # None: the model does not say (unchecked)


def validate(cfg: RunConfig, shape: Optional[ModelShape] = None, world_size: Optional[int] = None) -> int:
    """Full start-up validation against the launcher's ``world_size`` and the model's ``shape``; returns DP size."""
    check_static(cfg)
    p = cfg.parallel
    tp, pp = p.tensor_parallel, p.pipeline_parallel
    ws = world_size if world_size is not None else (p.world_size or tp * pp)
    if p.world_size and world_size is not None and p.world_size != world_size:
        raise ConfigError(f"parallel.world_size: config says {p.world_size} but the launcher started {world_size} ranks")
    _require(ws % (tp * pp) == 0, "parallel.tensor_parallel",
             f"world size {ws} is not divisible by tensor_parallel*pipeline_parallel={tp * pp}")
    dp = ws // (tp * pp)
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
    _require(rtp >= 1 and ws % rtp == 0, "rollout.tensor_parallel", f"{rtp} does not divide the world size {ws}")
    if shape is not None:
        _require(shape.num_attention_heads % rtp == 0 and shape.num_key_value_heads % rtp == 0,
                 "rollout.tensor_parallel", f"{rtp} does not divide the model's attention/key-value heads")
    _require(cfg.data.prompts_per_step % dp == 0 or cfg.data.prompts_per_step >= dp, "data.prompts_per_step",
             f"{cfg.data.prompts_per_step} prompts cannot feed {dp} data-parallel ranks")
    if shape is not None and shape.max_position_embeddings:
        _check_positions(cfg.rollout, cfg.data, shape.max_position_embeddings)
    return dp


def _check_positions(r: RolloutConfig, d: DataConfig, positions: int) -> None:
    # The engine caps its context at the model's positions: longer responses would be cut silently.
    _require(r.max_tokens < positions, "rollout.max_tokens",
             f"{r.max_tokens} leaves no room for a prompt in the model's {positions} positions "
             "(max_position_embeddings); lower it")
    _require(d.max_prompt_tokens + r.max_tokens <= positions, "rollout.max_tokens",
             f"data.max_prompt_tokens ({d.max_prompt_tokens}) + rollout.max_tokens ({r.max_tokens}) = "
             f"{d.max_prompt_tokens + r.max_tokens} tokens exceed the model's {positions} positions "
             "(max_position_embeddings); lower one of them, or responses to long prompts are cut short")
