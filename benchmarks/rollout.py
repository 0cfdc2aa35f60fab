"""vLLM rollout benchmark: no speculation vs ngram vs suffix vs HistoSpec, side by side in one process.

Two workloads:

* ``--config CFG`` (default ``configs/tiny-cpu.yaml``): the run's own prompts, sampling
  and policy inside the RL loop. The config's RL loop (without speculation) trains for
  ``--train-epochs`` epochs, recording its responses in the history store as a run does;
  then every method gets an engine with the trained weights (and HistoSpec a copy of the
  run's history) and generates the next epoch's steps, timed. vLLM's ``suffix`` keeps its
  own cache of recent responses, so it first runs one untimed pass over the same prompts
  (a cache from the current policy: if anything, this favours it).
  ``--train-epochs 0`` skips training: the base policy, the history from an untimed pass.
* ``--model M`` without a config: the built-in chat questions (the older workload).

Each method runs ``--repeats`` times (3), interleaved with the others, the order rotating,
each repeat from the same drafter state (HistoSpec the run's history afresh, ``suffix`` an
empty cache and its untimed pass); a method's figures are its median-wall run's.

``--sweep`` times none and HistoSpec over temperature {0, 0.7, 1.0} x concurrent requests
{1, 8, 32, 64} with the same history and prints HistoSpec's wall-time ratio to none in every
cell (``--sweep-temperatures`` / ``--sweep-concurrency`` pick a subset). A cell writes at
least ``--sweep-min-requests`` responses (8: two groups) in closed batches of its concurrency,
so the 1-request cell times eight responses one after another, not one. Each cell runs
``--repeats`` times per method, interleaved, and keeps the median (``ratio_per_token``
divides out the lengths that sampled variants happen to write); ``--quick`` caps the
tokens (and skips training) so a sweep takes minutes. Sampled runs write different lengths,
and a closed batch pays per step for its longest response, so each cell also gives
``ratio_equal_lengths``: none's time for the HistoSpec run's own responses (none's runs of the
sweep fit wall = c0 x batches + per_step x each batch's longest + per_token x tokens) over its
time, the median over the repeats (with an even count the mean of the middle two, not the
better draw). ``--variants`` times several HistoSpec settings against the same none runs, e.g.
``--variants histospec,histospec@histospec.step_cost=measured``.
Ratios are against ``none`` measured in this run; ``tokens_per_forward`` (tokens emitted per
target forward pass of a sequence) does not depend on the hardware.

    python -m benchmarks rollout --json
    python -m benchmarks rollout --sweep --quick
    python -m benchmarks rollout --model builtin:smollm2-135m-instruct --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Iterator, Optional, Sequence

METHODS = ("none", "ngram", "suffix", "histospec")
SWEEP_TEMPERATURES = (0.0, 0.7, 1.0)
SWEEP_CONCURRENCY = (1, 8, 32, 64)
# Responses a sweep cell writes at least: two GRPO groups, so a cell of one request in flight
# is not one sampled length's lottery.
SWEEP_MIN_REQUESTS = 8

QUESTIONS = [
    "What is 17 + 25? Explain step by step.",
    "A train travels 60 km in 1.5 hours. What is its average speed?",
    "List the first ten prime numbers.",
    "What is the capital of France, and what river flows through it?",
    "If x + 3 = 10, what is x? Show your work.",
    "Write a short poem about the sea.",
    "How many minutes are there in a day?",
    "Explain what photosynthesis is in two sentences.",
    "What is 12 times 13?",
    "Name three colors of the rainbow.",
    "Sort these numbers: 5, 2, 9, 1, 7.",
    "What is the square root of 144?",
]


def split_method(spec: str) -> tuple[str, list[str]]:
    """``method@key=value@...`` -> (method, [key=value, ...])."""
    name, *overrides = spec.split("@")
    return name.strip(), [o.strip() for o in overrides if o.strip()]


def _thread_count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 1, or 0 for the process's own (got {n})")
    return n


def add_threads_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=_thread_count, default=0,
                   help="intra-op threads of the engines (default 0: the process's own, all its cores unless "
                        "OMP_NUM_THREADS says otherwise, as the trainer's engine decodes with)")


def engine_threads(n: int) -> int:
    """Pin the engines' intra-op threads to ``n`` (0: leave the process's own, which is what
    the trainer's in-process engine decodes with) before any engine is built; returns the count."""
    from rhymerl.distributed.devices import get_cpu_threads, set_cpu_threads

    if n:
        set_cpu_threads(n)
    return get_cpu_threads()


def _prompts(model_dir, count: int, distinct: bool = False) -> list[list[int]]:
    """``count`` chat prompts of the built-in questions, repeating them past the first dozen
    (``distinct``: each repeat marked as a variant, so no two prompts are the same)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for i, q in enumerate((QUESTIONS * (count // len(QUESTIONS) + 1))[:count]):
        if distinct and i >= len(QUESTIONS):
            q = f"{q} (Variant {i // len(QUESTIONS) + 1}.)"
        if tok.chat_template:
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tok(q)["input_ids"]
        out.append([int(t) for t in ids])
    return out


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Send everything written to file descriptor 1 (vLLM's and Megatron's logs) to stderr, so that
    stdout carries only the benchmark's one JSON object."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


class Workload:
    """Prompts, sampling and policy weights every method is measured on."""

    def __init__(self, model_dir, prompts: list[list[int]], rollout_cfg, histospec_cfg, seed: int,
                 prompts_per_step: int, history: Any = None, trainer: Any = None, dtype: str = "float32"):
        self.model_dir = model_dir
        self.prompts = prompts
        self.rollout = rollout_cfg
        self.histospec = histospec_cfg
        self.seed = seed
        self.prompts_per_step = max(1, prompts_per_step)
        self.history = history
        self.trainer = trainer
        self.dtype = dtype

    def history_copy(self, vocab_size: int, histospec_cfg: Any = None):
        from rhymerl.histospec import HistoryStore

        h = histospec_cfg or self.histospec
        if self.history is None:
            return HistoryStore(h, vocab_size=vocab_size)
        return HistoryStore.from_bytes(self.history.to_bytes(), h)

    def variant(self, overrides: list[str]) -> tuple[Any, Any]:
        """(rollout, histospec) configs with ``rollout.*`` / ``histospec.*`` overrides applied,
        checked as a run's config is (unknown or ill-typed keys fail with their path)."""
        from rhymerl.config import ConfigError, RunConfig, from_dict, to_dict, with_overrides

        bad = [o for o in overrides if not o.split("=", 1)[0].strip().startswith(("rollout.", "histospec."))]
        if bad:
            raise ConfigError(f"sweep variant overrides may set rollout.* and histospec.* keys only: {bad}")
        d = to_dict(RunConfig())
        d["rollout"], d["histospec"] = to_dict(self.rollout), to_dict(self.histospec)
        cfg = from_dict(with_overrides(d, overrides))
        return cfg.rollout, cfg.histospec

    def engine(self, method: str, max_num_seqs: int, overrides: Optional[list[str]] = None):
        from rhymerl.rollout import RolloutEngine

        rollout, histospec = self.variant(overrides) if overrides else (self.rollout, self.histospec)
        cfg = replace(rollout, speculative=method, max_num_seqs=max(max_num_seqs, rollout.max_num_seqs))
        eng = RolloutEngine(cfg, histospec, self.model_dir, seed=self.seed, dtype=self.dtype)
        eng.set_history(self.history_copy(eng.vocab_size, histospec))
        if self.trainer is not None:
            from rhymerl.trainer import RESHARD_BUCKET_BYTES

            eng.load_weights(t for bucket in self.trainer.backend.export_hf_weights(RESHARD_BUCKET_BYTES) for t in bucket)
        return eng


def _config_workload(args) -> Workload:
    from rhymerl.config import load_config

    cfg = load_config(args.config, args.overrides)
    rollout = cfg.rollout
    if args.max_tokens:
        rollout = replace(rollout, max_tokens=args.max_tokens)
    if args.temperature is not None:
        rollout = replace(rollout, temperature=args.temperature)
    trainer = None
    if args.train_epochs > 0:
        from rhymerl.distributed.collectives import WorldComm
        from rhymerl.config import from_dict, to_dict
        from rhymerl.trainer import Trainer
        from rhymerl.distributed.process_groups import init_process_groups

        d = to_dict(cfg)
        d["run"]["output_dir"] = args.out
        d["run"]["epochs"] = args.train_epochs
        d["run"]["max_steps"] = 0
        d["rollout"]["speculative"] = "none"
        d["histopipe"]["enabled"] = False
        tcfg = from_dict(d)
        trainer = Trainer(tcfg, WorldComm(), init_process_groups(tcfg.parallel, 1, 0))
        total = args.train_epochs * trainer.sampler.steps_per_epoch
        t0 = time.perf_counter()
        while trainer.step < total:
            o = trainer.train_step()
            print(f"[bench rollout] training step {o.step} epoch {o.epoch} reward {o.metrics['reward/mean']:.3f} "
                  f"len {o.metrics['response/len_mean']:.0f}", file=sys.stderr)
        print(f"[bench rollout] trained {args.train_epochs} epoch(s) in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        return Workload(trainer.model_path, trainer.prompt_ids, rollout, cfg.histospec, cfg.run.seed,
                        cfg.data.prompts_per_step, history=trainer.history, trainer=trainer, dtype=cfg.model.dtype)
    from transformers import AutoTokenizer

    from rhymerl.data import few_shot_pool, load_records, render_prompt
    from rhymerl.models import resolve_model

    model_dir = resolve_model(cfg.model)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    records = load_records(cfg.data)
    shots = few_shot_pool(records, cfg.data.few_shot, cfg.data.seed)
    prompts = [render_prompt(r, shots[r.id], tok, cfg.data) for r in records]
    return Workload(model_dir, prompts, rollout, cfg.histospec, cfg.run.seed, cfg.data.prompts_per_step,
                    dtype=cfg.model.dtype)


def _model_workload(args) -> Workload:
    from rhymerl.config import HistoSpecConfig, ModelConfig, RolloutConfig
    from rhymerl.models import resolve_model

    if args.model == "builtin:tiny":
        from rhymerl.models.tiny import TinyShape

        # vLLM's CPU attention has no head size 16 (the default tiny shape): use 2 heads of 32.
        model_dir = resolve_model(ModelConfig(path=args.model), TinyShape(num_attention_heads=2, num_key_value_heads=1))
    else:
        model_dir = resolve_model(ModelConfig(path=args.model))
    prompts = _prompts(model_dir, args.prompts)
    cfg = RolloutConfig(n=args.n, temperature=1.0 if args.temperature is None else args.temperature,
                        max_tokens=args.max_tokens or 64, num_speculative_tokens=args.k,
                        max_num_seqs=max(64, args.n * len(prompts)), max_model_len=1024)
    return Workload(model_dir, prompts, cfg, HistoSpecConfig(), args.seed, len(prompts))


def _epoch(eng, w: Workload, temperature: float, seed_offset: int, record: bool = False) -> dict:
    """One epoch of the workload's steps (prompts_per_step prompts x n each); summed engine figures."""
    from rhymerl.rollout import SamplingSpec

    tot: dict = {}
    for s, i in enumerate(range(0, len(w.prompts), w.prompts_per_step)):
        chunk = w.prompts[i:i + w.prompts_per_step]
        sp = SamplingSpec(temperature=temperature, top_p=w.rollout.top_p, top_k=w.rollout.top_k,
                          max_tokens=w.rollout.max_tokens, seed=w.seed + seed_offset + 100_000 * s)
        eng.generate(chunk, w.rollout.n, sp, group_ids=[f"{s}:{g}" for g in range(len(chunk))], epoch=1,
                     record_history=record)
        accumulate(tot, eng.metrics())
    return _derived(tot)


# Per-call engine figures that add up over calls; every other number (fractions, the fitted
# step-cost model, thread counts) is a state or a ratio: the last call's stands, and the
# ratios are recomputed from the sums (``_derived``).
_ADDITIVE = frozenset(("responses", "generated_tokens", "draft_proposed", "draft_accepted", "drafts", "target_forwards",
                       "engine_steps", "wall_s", "draft_time_s", "drafter_calls"))


def accumulate(tot: dict, metrics: dict) -> dict:
    """Add one generate() call's ``metrics`` into ``tot``: counts and times summed, the rest
    (fractions, fitted costs) replaced by the latest call's."""
    from rhymerl.histospec.proposer import STAT_COUNTS

    for k, v in metrics.items():
        if not isinstance(v, (int, float)):
            continue
        if k in _ADDITIVE or k in STAT_COUNTS or (k.startswith("source/") and k.rsplit("/", 1)[-1] in ("drafts", "proposed", "accepted")):
            tot[k] = tot.get(k, 0) + v
        else:
            tot[k] = v
    return tot


def _derived(t: dict) -> dict:
    from rhymerl.histospec.proposer import add_stat_fractions

    add_stat_fractions(t)
    fwd, gen, prop = t.get("target_forwards", 0), t.get("generated_tokens", 0), t.get("draft_proposed", 0)
    t["tokens_per_forward"] = gen / fwd if fwd else 0.0
    t["acceptance_rate"] = t.get("draft_accepted", 0) / prop if prop else 0.0
    t["mean_accepted_len"] = t.get("draft_accepted", 0) / t["drafts"] if t.get("drafts") else 0.0
    t["tokens_per_s"] = gen / t["wall_s"] if t.get("wall_s") else 0.0
    t["s_per_engine_step"] = t["wall_s"] / max(1, t.get("engine_steps", 0))
    # Tokens the target model scored (1 + drafts per sequence-step): CPU cost is ~linear in them.
    t["scored_tokens"] = fwd + prop
    t["ms_per_scored_token"] = 1e3 * t["wall_s"] / max(1, fwd + prop)
    return t


def _warm(eng, w: Workload, temperature: float) -> None:
    from rhymerl.rollout import SamplingSpec

    eng.generate(w.prompts[:1], 1, SamplingSpec(temperature=temperature, max_tokens=8), record_history=False)


def _fill_history(w: Workload) -> None:
    """No run behind the workload: one untimed pass of the base policy becomes the history."""
    eng = w.engine("none", len(w.prompts) * w.rollout.n)
    try:
        _warm(eng, w, w.rollout.temperature)
        w.history = eng.history
        _epoch(eng, w, w.rollout.temperature, seed_offset=1, record=True)
    finally:
        eng.shutdown()


def run(args) -> dict:
    """Every method over the workload's next epoch, ``args.repeats`` times, interleaved (the order
    rotating), each repeat from the same drafter state; a method's figures are its median-wall run's."""
    from rhymerl.distributed.devices import get_cpu_threads
    from rhymerl.rollout import RolloutError

    from benchmarks.suffix_cache import refill_suffix_cache

    w = _config_workload(args) if args.config else _model_workload(args)
    temp = w.rollout.temperature
    if w.history is None and "histospec" in args.methods:
        _fill_history(w)
    results: dict = {}
    engines: dict = {}
    try:
        for method in args.methods:
            t0 = time.perf_counter()
            try:
                engines[method] = w.engine(method, len(w.prompts) * w.rollout.n)
            except RolloutError as e:
                results[method] = {"error": str(e)}
                print(f"[{method}] skipped: {e}", file=sys.stderr)
                continue
            results[method] = {"startup_s": time.perf_counter() - t0}
            _warm(engines[method], w, temp)
        runs: dict = {m: [] for m in engines}
        names = list(engines)
        for rep in range(args.repeats):
            for method in rotated(names, rep):
                eng = engines[method]
                # Nothing a drafter learnt in the warm-up or an earlier repeat carries over.
                if method == "histospec":
                    eng.set_history(w.history_copy(eng.vocab_size))
                elif method == "suffix":
                    refill_suffix_cache(eng)
                    _epoch(eng, w, temp, seed_offset=1)  # fills suffix decoding's own response cache
                r = _epoch(eng, w, temp, seed_offset=0)
                runs[method].append(r)
                print(f"[{method}] repeat {rep + 1}/{args.repeats}: {r['wall_s']:.2f}s {r['tokens_per_s']:.0f} tok/s "
                      f"tok/fwd {r['tokens_per_forward']:.2f} acc {r['acceptance_rate']:.2f}", file=sys.stderr)
    finally:
        for eng in reversed(list(engines.values())):
            eng.shutdown()
    for method, rs in runs.items():
        results[method] = {**median_run(rs, key=lambda r: r["wall_s"]), **results[method],
                           "wall_s_repeats": [round(r["wall_s"], 3) for r in rs],
                           "tokens_per_forward_repeats": [round(r["tokens_per_forward"], 4) for r in rs]}
    base = results.get("none", {}).get("wall_s")
    for r in results.values():
        if "wall_s" in r:
            r["speedup_vs_none"] = base / r["wall_s"] if base else None
    out = {"workload": args.config or args.model, "temperature": temp, "n": w.rollout.n, "prompts": len(w.prompts),
           "max_tokens": w.rollout.max_tokens, "num_speculative_tokens": w.rollout.num_speculative_tokens,
           "trained_epochs": args.train_epochs if args.config else 0, "threads": get_cpu_threads(),
           "repeats": args.repeats, "methods": results}
    if w.trainer is not None:
        w.trainer.close()
    return out


def _cell_requests(w: Workload, c: int) -> list[tuple[int, list[int]]]:
    """``c`` concurrent requests: prompts in order, n samples each (group index, prompt)."""
    n = w.rollout.n
    return [(j // n, w.prompts[(j // n) % len(w.prompts)]) for j in range(c)]


def _cell_waves(w: Workload, c: int, min_requests: int) -> list[list[tuple[int, list[int]]]]:
    """A cell's requests, ``max(c, min_requests)`` of them, in closed batches of ``c``: a cell of
    one request in flight times several responses one after another, so its ratio is not
    one sampled length's."""
    reqs = _cell_requests(w, max(c, min_requests))
    return [reqs[i:i + c] for i in range(0, len(reqs), c)]


def _cell(eng, w: Workload, temperature: float, c: int, rep: int = 0, min_requests: int = 1) -> dict:
    from rhymerl.rollout import SamplingSpec

    tot: dict = {}
    longest = []
    # A cell is a run of its own: its waves carry HistoSpec's learnt acceptance from one to
    # the next, as a trainer's rollouts do, but nothing comes from the cells run before it.
    eng.reset_drafter()
    for k, wave in enumerate(_cell_waves(w, c, min_requests)):
        sp = SamplingSpec(temperature=temperature, top_p=w.rollout.top_p, top_k=w.rollout.top_k,
                          max_tokens=w.rollout.max_tokens, seed=w.seed + 7919 * c + 104_729 * rep + 1_299_709 * k)
        res = eng.generate([p for _, p in wave], 1, sp, group_ids=[f"sweep:{g}" for g, _ in wave], epoch=1,
                           record_history=False)
        accumulate(tot, eng.metrics())
        longest.append(max((len(t) for r in res for t in r.token_ids), default=0))
    out = _derived(tot)
    out["batches"] = len(longest)
    out["longest_response"] = max(longest, default=0)
    out["sum_of_batch_longest"] = sum(longest)
    return out


def _closed_batches(run: dict) -> tuple[float, float]:
    """(closed batches, sum of each batch's longest response) of a run: one batch unless the
    run says otherwise (a sweep cell of waves)."""
    return float(run.get("batches", 1)), float(run.get("sum_of_batch_longest", run["longest_response"]))


def fit_none_time(runs: Sequence[dict]) -> Optional[tuple[float, float, float, float]]:
    """(c0, per_step, per_token, relative rms error) of wall = c0 + per_step * longest +
    per_token * generated over no-speculation runs of closed batches: without speculation a
    batch decodes one token per running request per step, so its steps number its longest
    response and sum(step cost = fixed + per_request * running) = fixed * longest +
    per_request * generated. A run of several closed batches one after another (``batches``,
    ``sum_of_batch_longest``) pays c0 per batch and per_step for each batch's longest.
    Fitted in relative error (weights 1/wall^2), every cost >= 0; None with fewer runs than
    unknowns."""
    import numpy as np

    from rhymerl.histopipe.calibration import nonnegative_lstsq

    rows = [(*_closed_batches(r), float(r["generated_tokens"]), float(r["wall_s"]))
            for r in runs if r.get("wall_s", 0) > 0 and r.get("longest_response", 0) > 0]
    if len(rows) < 3:
        return None
    a = np.array([r[:3] for r in rows])
    y = np.array([r[3] for r in rows])
    # Unconstrained, a run's six steps of similar lengths can fit a negative cost per batch,
    # which prices a variant that wrote shorter responses at less than nothing.
    coef = nonnegative_lstsq(a / y[:, None], np.ones_like(y))
    rel = a @ coef / y - 1.0
    return float(coef[0]), float(coef[1]), float(coef[2]), float(np.sqrt(np.mean(rel * rel)))


NONE_FIT_FIELDS = ("c0_s", "per_step_s", "per_token_s", "relative_rms_error")


def none_time_s(fit: tuple, longest: float, tokens: float, batches: float = 1.0) -> float:
    """None's fitted time (``fit_none_time``) for ``batches`` closed batches whose longest
    responses sum to ``longest`` and which write ``tokens`` in all."""
    c0, per_step, per_token, _ = fit
    return c0 * batches + per_step * longest + per_token * tokens


def describe_none_fit(fit: dict, fitted_on: str) -> str:
    """One line for a table: the fit (``NONE_FIT_FIELDS``) and its error."""
    return (f"{fit['c0_s']:.3f} s a batch + {1e3 * fit['per_step_s']:.1f} ms x longest + {1e3 * fit['per_token_s']:.2f} ms"
            f" x tokens (fitted on {fitted_on}, {100 * fit['relative_rms_error']:.0f}% rms error)")


def equal_lengths_ratio(fit: tuple, run: dict) -> float:
    """What none would take to write exactly ``run``'s responses (``fit_none_time``) over the
    time ``run`` took: sampled variants write different lengths, and a longer tail costs a
    closed batch more steps whatever the drafter."""
    batches, longest = _closed_batches(run)
    none_s = none_time_s(fit, longest, run["generated_tokens"], batches)
    return none_s / run["wall_s"] if run["wall_s"] > 0 else 0.0


def equal_lengths_ratios(fit: tuple, runs: Sequence[dict]) -> tuple[float, list]:
    """The median of ``equal_lengths_ratio`` over a variant's repeats (with an even count, the
    mean of the middle two: the upper one alone would report the better of two draws) and
    every repeat's ratio, sorted."""
    eq = sorted(equal_lengths_ratio(fit, r) for r in runs)
    return (statistics.median(eq) if eq else 0.0), eq


def rotated(items: Sequence, rep: int) -> list:
    """``items`` in repeat ``rep``'s order: rotated by ``rep``, so each takes every place in turn."""
    k = rep % len(items) if items else 0
    return list(items[k:]) + list(items[:k])


def median_run(runs: list, key: Callable[[Any], float]) -> Any:
    """The run whose ``key`` is the median (the upper one of an even count): a real run, so
    its other figures belong to it."""
    return sorted(runs, key=key)[len(runs) // 2]


def _s_per_token(run: dict) -> float:
    return run["wall_s"] / max(1, run["generated_tokens"])


def _variant_row(runs: dict, label: str) -> dict:
    """One HistoSpec variant against none in one cell: medians of the interleaved repeats."""
    r = {m: median_run(runs[m], lambda x: x["wall_s"]) for m in ("none", label)}
    per_tok = {m: _s_per_token(median_run(runs[m], _s_per_token)) for m in ("none", label)}
    v = r[label]
    return {"ratio": r["none"]["wall_s"] / v["wall_s"] if v["wall_s"] > 0 else 0.0,
            "ratio_per_token": per_tok["none"] / per_tok[label] if per_tok[label] else 0.0,
            "ratios_each_repeat": [a["wall_s"] / b["wall_s"] for a, b in zip(runs["none"], runs[label])
                                   if b["wall_s"] > 0],
            "tokens_per_forward": v["tokens_per_forward"], "acceptance_rate": v["acceptance_rate"],
            "none_wall_s": r["none"]["wall_s"], "histospec_wall_s": v["wall_s"],
            "generated_tokens": v["generated_tokens"],
            "none_ms_per_step": 1e3 * r["none"]["s_per_engine_step"],
            "histospec_ms_per_step": 1e3 * v["s_per_engine_step"],
            "draft_tokens_per_step": v.get("draft_proposed", 0) / max(1, v.get("engine_steps", 0)),
            "draft_time_s": v.get("draft_time_s", 0.0),
            **{k: x for k, x in v.items() if k.startswith("step_cost/")}}


# What a sweep's JSON keeps of each run: enough to redo its equal-lengths figure.
RUN_FIELDS = ("wall_s", "batches", "longest_response", "sum_of_batch_longest", "generated_tokens", "tokens_per_forward",
              "engine_steps")


def _ratio_summary(ratios: list) -> dict:
    return {"min_ratio": min(ratios) if ratios else None,
            "geomean_ratio": math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else None}


def run_sweep(args) -> dict:
    """none against each HistoSpec variant (``args.variants``: ``histospec[@key=value...]``)
    in every cell; the cell's top-level figures are the first variant's."""
    from rhymerl.distributed.devices import get_cpu_threads

    w = _config_workload(args) if args.config else _model_workload(args)
    temps = args.sweep_temperatures
    concs = args.sweep_concurrency
    labels = list(args.variants)
    if w.history is None:
        _fill_history(w)
    engines = {"none": w.engine("none", max(concs))}
    for label in labels:
        engines[label] = w.engine("histospec", max(concs), split_method(label)[1])
    cells_runs: list = []  # (temperature, concurrency, runs by method, rows by variant)
    try:
        for m, eng in engines.items():
            for t in temps:
                _warm(eng, w, t)
        for t in temps:
            for c in concs:
                # Repetitions interleaved, the order alternating, the median kept: drift of the
                # machine's load hits every method alike, one slow shot decides nothing.
                runs: dict = {m: [] for m in engines}
                for rep in range(args.repeats):
                    order = list(engines) if rep % 2 == 0 else list(reversed(list(engines)))
                    for m in order:
                        runs[m].append(_cell(engines[m], w, t, c, rep, args.sweep_min_requests))
                rows = {label: _variant_row(runs, label) for label in labels}
                cells_runs.append((t, c, runs, rows))
                print(f"[sweep] T={t} c={c}: " + "; ".join(
                    f"{label}/none {row['ratio']:.3f}x tok/fwd {row['tokens_per_forward']:.2f}"
                    for label, row in rows.items()), file=sys.stderr)
    finally:
        for eng in reversed(list(engines.values())):
            eng.shutdown()
        if w.trainer is not None:
            w.trainer.close()
    # Equal lengths: each HistoSpec run against none writing the same responses (fitted over
    # every none run of the sweep), the median over the repeats.
    fit = fit_none_time([r for _, _, runs, _ in cells_runs for r in runs["none"]])
    cells = []
    for t, c, runs, rows in cells_runs:
        for label, row in rows.items():
            if fit is not None:
                row["ratio_equal_lengths"], row["ratios_equal_lengths_each_repeat"] = equal_lengths_ratios(fit, runs[label])
        cells.append({"temperature": t, "concurrency": c, **rows[labels[0]],
                      **({"variants": rows} if len(labels) > 1 else {}),
                      "runs": {m: [{k: r.get(k) for k in RUN_FIELDS} for r in rs] for m, rs in runs.items()}})
    out = {"workload": args.config or args.model, "n": w.rollout.n, "max_tokens": w.rollout.max_tokens,
           "trained_epochs": args.train_epochs if args.config else 0, "threads": get_cpu_threads(),
           "repeats": args.repeats, "min_requests": args.sweep_min_requests, "variants": labels, "cells": cells,
           **_ratio_summary([c["ratio"] for c in cells])}
    if fit is not None:
        out["none_time_fit"] = dict(zip(NONE_FIT_FIELDS, fit))
        out["equal_lengths"] = _ratio_summary([c["ratio_equal_lengths"] for c in cells])
    if len(labels) > 1:
        out["variant_summary"] = {
            label: {**_ratio_summary([c["variants"][label]["ratio"] for c in cells]),
                    **({"equal_lengths": _ratio_summary([c["variants"][label]["ratio_equal_lengths"] for c in cells])}
                       if fit is not None else {})}
            for label in labels}
    return out


def _sweep_table(out: dict) -> str:
    temps = sorted({c["temperature"] for c in out["cells"]})
    concs = sorted({c["concurrency"] for c in out["cells"]})
    by = {(c["temperature"], c["concurrency"]): c for c in out["cells"]}
    labels = out.get("variants") or ["histospec"]
    eq = "equal_lengths" in out
    lines = [f"rollout sweep: {out['workload']} n={out['n']} max_tokens={out['max_tokens']} "
             f"trained epochs={out['trained_epochs']}: HistoSpec wall-time ratio to none (tokens per forward)"
             + (" [at equal lengths]" if eq else "") + f", median of {out.get('repeats', 1)}"
             + (f", at least {out['min_requests']} responses a cell" if out.get("min_requests", 1) > 1 else "")]
    if eq:
        lines.append("equal lengths: none's time for the same responses, "
                     + describe_none_fit(out["none_time_fit"], "none's runs"))
    for k, label in enumerate(labels):
        rows = {key: (cell if k == 0 else cell["variants"][label]) for key, cell in by.items()}
        summ = out if k == 0 else out["variant_summary"][label]
        lines.append(f"{label}:" if len(labels) > 1 else "")
        lines.append(f"{'T / requests':<14}" + "".join(f"{c:>{26 if eq else 16}}" for c in concs))
        for t in temps:
            lines.append(f"{t:<14}" + "".join(
                f"{rows[(t, c)]['ratio']:>9.3f}x ({rows[(t, c)]['tokens_per_forward']:.2f})"
                + (f" [{rows[(t, c)]['ratio_equal_lengths']:.3f}x]" if eq else "") for c in concs))
        lines.append(f"min {summ['min_ratio']:.3f}x  geomean {summ['geomean_ratio']:.3f}x"
                     + (f"; at equal lengths min {summ['equal_lengths']['min_ratio']:.3f}x  geomean "
                        f"{summ['equal_lengths']['geomean_ratio']:.3f}x" if eq else ""))
    return "\n".join(line for line in lines if line)


def _table(out: dict) -> str:
    cols = ["wall_s", "speedup_vs_none", "tokens_per_s", "tokens_per_forward", "acceptance_rate",
            "mean_accepted_len", "engine_steps", "scored_tokens", "ms_per_scored_token", "draft_time_s", "startup_s"]
    lines = [f"rollout bench: {out['workload']} T={out['temperature']} n={out['n']} prompts={out['prompts']} "
             f"max_tokens={out['max_tokens']} k={out['num_speculative_tokens']} trained epochs={out['trained_epochs']}",
             f"{'method':<10}" + "".join(f"{c[:18]:>19}" for c in cols)]
    for m, r in out["methods"].items():
        if "error" in r:
            lines.append(f"{m:<10} error: {r['error']}")
            continue
        lines.append(f"{m:<10}" + "".join(f"{'-' if r.get(c) is None else round(r[c], 3):>19}" for c in cols))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from rhymerl.config import ConfigError, HistoSpecConfig, RolloutConfig

    p = argparse.ArgumentParser(prog="python -m benchmarks rollout", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--config", default="configs/tiny-cpu.yaml",
                   help="run config whose prompts, sampling and trained policy are measured ('' = --model workload)")
    p.add_argument("--train-epochs", type=int, default=1,
                   help="epochs of the config's RL loop trained before measuring (0: base policy)")
    p.add_argument("--out", default="runs/bench-rollout", help="run folder of the training epochs")
    p.add_argument("--model", default=None, help="measure this model on built-in chat questions instead of a config")
    p.add_argument("--quick", action="store_true", help="capped tokens, no training: a run of a few minutes")
    p.add_argument("--sweep", action="store_true",
                   help="none vs HistoSpec over temperature {0, 0.7, 1.0} x concurrent requests {1, 8, 32, 64}")
    p.add_argument("--prompts", type=int, default=8, help="--model workload: number of questions")
    p.add_argument("--n", type=int, default=4, help="--model workload: samples per question")
    p.add_argument("--max-tokens", type=int, default=0, help="override the workload's max_tokens")
    p.add_argument("--temperature", type=float, default=None, help="override the workload's temperature")
    p.add_argument("-k", type=int, default=8, help="--model workload: num_speculative_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default=",".join(METHODS))
    # The sweep's own options default to None so that one given without --sweep is refused, not ignored.
    sweep_defaults = {"sweep_temperatures": ",".join(map(str, SWEEP_TEMPERATURES)),
                      "sweep_concurrency": ",".join(map(str, SWEEP_CONCURRENCY)),
                      "sweep_min_requests": SWEEP_MIN_REQUESTS, "variants": "histospec"}
    p.add_argument("--sweep-temperatures",
                   help=f"--sweep: comma-separated temperatures (default {sweep_defaults['sweep_temperatures']})")
    p.add_argument("--sweep-concurrency",
                   help="--sweep: comma-separated numbers of concurrent requests "
                        f"(default {sweep_defaults['sweep_concurrency']})")
    p.add_argument("--sweep-min-requests", type=int,
                   help="--sweep: requests each cell writes at least, in closed batches of its concurrency "
                        "(a 1-request cell writes this many responses one after another; "
                        f"default {sweep_defaults['sweep_min_requests']})")
    p.add_argument("--variants",
                   help="--sweep: comma-separated HistoSpec variants timed against none in the same cells, "
                        "each histospec[@key=value...] (rollout.* / histospec.* keys), e.g. "
                        f"histospec,histospec@histospec.step_cost=measured (default {sweep_defaults['variants']})")
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved repetitions of each method (with --sweep: of each cell); the median is kept")
    add_threads_flag(p)
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")
    args = p.parse_args(argv)
    given = [f"--{name.replace('_', '-')}" for name in sweep_defaults if getattr(args, name) is not None]
    if given and not args.sweep:
        p.error(f"{', '.join(given)}: only with --sweep")
    for name, value in sweep_defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.model:
        args.config = ""
    elif not args.config:
        args.model = "builtin:smollm2-135m-instruct"
    if args.quick:
        args.train_epochs = 0
        args.max_tokens = min(args.max_tokens or 32, 32)
        args.prompts = min(args.prompts, 4)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        p.error(f"--methods: unknown {bad}; allowed: {', '.join(METHODS)}")
    try:
        args.sweep_temperatures = tuple(float(t) for t in args.sweep_temperatures.split(",") if t.strip())
        args.sweep_concurrency = tuple(int(c) for c in args.sweep_concurrency.split(",") if c.strip())
    except ValueError as e:
        p.error(f"--sweep-temperatures / --sweep-concurrency: {e}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.sweep_min_requests < 1:
        p.error("--sweep-min-requests must be >= 1")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or any(split_method(v)[0] != "histospec" for v in args.variants):
        p.error("--variants: one or more histospec[@key=value...] specs")
    if len(set(args.variants)) != len(args.variants):
        p.error("--variants: each variant once")
    try:  # fail before any training or engine start-up on a bad key
        probe = Workload(None, [], RolloutConfig(), HistoSpecConfig(), 0, 1)
        for v in args.variants:
            probe.variant(split_method(v)[1])
    except ConfigError as e:
        p.error(f"--variants: {e}")
    if not args.sweep_temperatures or not args.sweep_concurrency or min(args.sweep_concurrency) < 1:
        p.error("--sweep-temperatures and --sweep-concurrency need at least one value each (concurrency >= 1)")
    engine_threads(args.threads)
    with quiet_stdout():
        out = run_sweep(args) if args.sweep else run(args)
    print(_sweep_table(out) if args.sweep else _table(out), file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
