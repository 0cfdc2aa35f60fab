"""Where an engine step's time goes, and what speculation with no drafts costs.

For each method, in one process, with the same requests: build a rollout engine, decode
a fixed number of tokens for each batch size (ignore_eos), and split every engine step
into phases timed around vLLM's own functions: scheduling, input preparation, the model
forward, the output layer (logits over the vocabulary), sampling (with log-probs, or
rejection sampling when drafts exist), drafting, bookkeeping and output processing.
From two batch sizes it fits step time = fixed + per request x requests.

The zero-draft tax: ``histospec`` with an empty history proposes nothing, so its steps
do the same work as ``none``; it is measured with rhymerl's sampler patches on (the
shipped path) and off (vLLM's own path), and reported as a ratio to ``none`` in the same
run. The cost of a draft token: ``histospec`` drafting from an untimed pass over the same
requests, (step time - none's step time) / drafts per step, patched and unpatched.

``--calibrate`` measures the goodput rule's step-cost prior instead
(``benchmarks/step_calibration.py``) and prints it as a device prior (``StepCosts``).

    python -m benchmarks step --json
    python -m benchmarks step --sizes 2,32 --tokens 32
    python -m benchmarks step --calibrate
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from typing import Any, Callable

# Phase -> (object path, attribute): methods wrapped with a timer on the live engine.
PHASES = {
    "schedule": ("scheduler", "schedule"),
    "update": ("scheduler", "update_from_output"),
    "prepare": ("runner", "_prepare_inputs"),
    "forward": ("runner", "_model_forward"),
    "logits": ("model", "compute_logits"),
    "sample": ("runner", "_sample"),
    "draft": ("runner", "propose_draft_token_ids"),
    "bookkeep": ("runner", "_bookkeeping_sync"),
    "output": ("output_processor", "process_outputs"),
}


class PhaseTimer:
    """Accumulates seconds per phase of the wrapped engine's steps."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, obj: Any, attr: str, phase: str) -> None:
        seconds = self.seconds
        if attr in getattr(obj, "__dict__", {}):
            inner: Callable = getattr(obj, attr)
        else:
            # Looked up on the class at each call: a vLLM patch swapped in or out later still counts.
            cls = type(obj)

            def inner(*args: Any, **kwargs: Any) -> Any:
                return getattr(cls, attr)(obj, *args, **kwargs)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[phase] += time.perf_counter() - t0

        setattr(obj, attr, timed)

    def reset(self) -> None:
        self.seconds.clear()


def instrument(engine: Any) -> PhaseTimer:
    from rhymerl.rollout.engine import _runner_of

    runner = engine.llm.collective_rpc(_runner_of)[0]
    objs = {"runner": runner, "model": runner.model, "scheduler": engine._engine.engine_core.engine_core.scheduler,
            "output_processor": engine._engine.output_processor}
    timer = PhaseTimer()
    for phase, (obj, attr) in PHASES.items():
        timer.wrap(objs[obj], attr, phase)
    return timer


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y over x; one point gives slope 0."""
    if len(points) < 2:
        return (points[0][1] if points else 0.0), 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - slope * mx, slope


def _measure(engine: Any, timer: PhaseTimer, prompts: list[list[int]], tokens: int, temperature: float) -> dict:
    from rhymerl.rollout import SamplingSpec

    timer.reset()
    engine.generate(prompts, 1, SamplingSpec(temperature=temperature, max_tokens=tokens, ignore_eos=True),
                    record_history=False)
    m = engine.metrics()
    steps = max(1, m["engine_steps"])
    row = {f"{k}_ms": 1e3 * v / steps for k, v in sorted(timer.seconds.items())}
    row["step_ms"] = 1e3 * m["wall_s"] / steps
    named = sum(v for k, v in row.items() if k != "step_ms")
    row["other_ms"] = row["step_ms"] - named
    row["steps"] = m["engine_steps"]
    row["draft_proposed"] = m["draft_proposed"]
    row["drafts_per_step"] = m["draft_proposed"] / steps
    row["tokens_per_forward"] = m["tokens_per_forward"]
    return row


# label -> (engine, drafts from a history of the same requests, rhymerl's sampler patches on)
VARIANTS = {
    "none": ("none", False, True),
    "histospec-no-drafts": ("histospec", False, True),
    "histospec-no-drafts-unpatched": ("histospec", False, False),
    "histospec-drafts": ("histospec", True, True),
    "histospec-drafts-unpatched": ("histospec", True, False),
}


def run(args) -> dict:
    from benchmarks.rollout import _prompts, median_run
    from rhymerl.config import HistoSpecConfig, ModelConfig, RolloutConfig
    from rhymerl.distributed.devices import get_cpu_threads
    from rhymerl.histospec import HistoryStore
    from rhymerl.models import resolve_model
    from rhymerl.rollout import RolloutEngine, SamplingSpec
    from rhymerl.rollout import vllm_patches

    model_dir = resolve_model(ModelConfig(path=args.model))
    prompts = _prompts(model_dir, max(args.sizes))
    out: dict = {"model": args.model, "tokens": args.tokens, "temperature": args.temperature, "sizes": args.sizes,
                 "repeats": args.repeats, "threads": get_cpu_threads(), "variants": {}}
    engines: dict = {}
    timers: dict = {}
    hs = HistoSpecConfig()
    try:
        for method in ("none", "histospec"):
            cfg = RolloutConfig(speculative=method, n=1, temperature=args.temperature, max_tokens=args.tokens,
                                num_speculative_tokens=8, max_num_seqs=max(64, max(args.sizes)), max_model_len=1024,
                                cpu_kv_cache_gb=1.0)
            engines[method] = RolloutEngine(cfg, hs, model_dir, seed=args.seed)
            timers[method] = instrument(engines[method])
            engines[method].generate(prompts[:2], 1, SamplingSpec(temperature=args.temperature, max_tokens=4),
                                     record_history=False)  # warm-up
        spec = engines["histospec"]
        rows: dict = {label: {} for label in VARIANTS}
        for n in args.sizes:
            empty = HistoryStore(hs, vocab_size=spec.vocab_size)
            filled = HistoryStore(hs, vocab_size=spec.vocab_size)
            spec.set_history(filled)  # an untimed pass over the same requests is the history to draft from
            spec.generate(prompts[:n], 1, SamplingSpec(temperature=args.temperature, max_tokens=args.tokens,
                                                       ignore_eos=True), epoch=0)
            reps: dict = {label: [] for label in VARIANTS}
            # Variants interleaved, repeated: drift of the machine's load hits them alike.
            for _ in range(args.repeats):
                for label, (method, drafts, patched) in VARIANTS.items():
                    if method == "histospec":
                        # No drafts at all: besides the prompt's history, the in-flight sources
                        # (the request's own output, the shared index) would draft too.
                        spec.histospec_cfg = hs if drafts else dataclasses.replace(hs, enabled=False)
                        spec.set_history(filled if drafts else empty)
                    if not patched:
                        vllm_patches.unpatch_zero_draft_plain_sampler()
                        vllm_patches.unpatch_rejection_sampler_cuts()
                    try:
                        reps[label].append(_measure(engines[method], timers[method], prompts[:n], args.tokens,
                                                    args.temperature))
                    finally:
                        if not patched:
                            vllm_patches.apply_all()
            for label, rs in reps.items():
                rows[label][n] = median_run(rs, lambda r: r["step_ms"])
            print(f"[{n} requests] " + "  ".join(f"{lb}: {rows[lb][n]['step_ms']:.1f}" for lb in VARIANTS) + " ms/step",
                  file=sys.stderr)
    finally:
        for eng in reversed(list(engines.values())):
            eng.shutdown()
    for label, by_size in rows.items():
        fixed, per_req = fit_line([(n, r["step_ms"]) for n, r in by_size.items()])
        out["variants"][label] = {"by_size": by_size, "fixed_ms": fixed, "per_request_ms": per_req}
    base = out["variants"]["none"]["by_size"]
    for label, v in out["variants"].items():
        v["ratio_to_none"] = {n: r["step_ms"] / base[n]["step_ms"] for n, r in v["by_size"].items()}
        # What one more scored draft token adds to a step, against the same requests without speculation.
        v["ms_per_draft_token"] = {n: (r["step_ms"] - base[n]["step_ms"]) / r["drafts_per_step"]
                                   for n, r in v["by_size"].items() if r["drafts_per_step"] > 0}
    return out


def _table(out: dict) -> str:
    phases = [f"{p}_ms" for p in PHASES] + ["other_ms", "step_ms"]
    lines = [f"engine step: {out['model']} T={out['temperature']} {out['tokens']} tokens per request, "
             f"threads={out['threads']} (ms per engine step)",
             f"{'variant':<31}{'reqs':>5}" + "".join(f"{p[:-3]:>9}" for p in phases) + f"{'vs none':>9}"]
    for label, v in out["variants"].items():
        for n, r in v["by_size"].items():
            lines.append(f"{label:<31}{n:>5}" + "".join(f"{r.get(p, 0.0):>9.2f}" for p in phases)
                         + f"{v['ratio_to_none'][n]:>9.3f}")
        per_draft = "  ".join(f"{n} req: {x:.2f} ({v['by_size'][n]['drafts_per_step']:.1f} drafts/step)"
                              for n, x in v["ms_per_draft_token"].items())
        lines.append(f"{'':<31}fit: {v['fixed_ms']:.1f} ms fixed + {v['per_request_ms']:.2f} ms per request"
                     + (f"; ms per draft token: {per_draft}" if per_draft else ""))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks step", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--model", default="builtin:smollm2-135m-instruct")
    p.add_argument("--sizes", default=None,
                   help="concurrent requests, comma-separated (default 2,32; with --calibrate 1,8,32,64)")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens decoded per request (default 24; --calibrate 256: rows at a rollout's contexts)")
    p.add_argument("--temperature", type=float, default=1.0, help="(--calibrate decodes greedily)")
    p.add_argument("--repeats", type=int, default=None,
                   help="interleaved repetitions per variant, median kept (default 3); --calibrate: passes over its grid (1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibrate", action="store_true",
                   help="measure the goodput rule's step-cost prior (a StepCosts) on this machine")
    from benchmarks.rollout import add_threads_flag

    add_threads_flag(p)
    args = p.parse_args(argv)
    cal = args.calibrate
    try:
        args.sizes = sorted({int(s) for s in (args.sizes or ("1,8,32,64" if cal else "2,32")).split(",") if s.strip()})
    except ValueError:
        print(f"benchmarks step: --sizes must be integers separated by commas (got {args.sizes!r})", file=sys.stderr)
        return 2
    args.tokens = args.tokens if args.tokens is not None else (256 if cal else 24)
    args.repeats = args.repeats if args.repeats is not None else (1 if cal else 3)
    for flag, v in (("--sizes", min(args.sizes, default=0)), ("--tokens", args.tokens), ("--repeats", args.repeats)):
        if v < 1:
            print(f"benchmarks step: {flag} must be >= 1 (got {v})", file=sys.stderr)
            return 2
    if cal and len(args.sizes) < 2:
        print("benchmarks step: --calibrate needs two --sizes or more", file=sys.stderr)
        return 2
    from benchmarks.rollout import engine_threads, quiet_stdout

    threads = engine_threads(args.threads)

    if cal:
        from benchmarks import step_calibration

        with quiet_stdout():
            rows = step_calibration.measure(args)
        out = {"model": args.model, "tokens": args.tokens, "sizes": args.sizes, "repeats": args.repeats,
               "threads": threads, **step_calibration.fit_step_costs(rows)}
        print(step_calibration.table(out), file=sys.stderr)
        if args.json:
            print(json.dumps(out))
        return 0
    with quiet_stdout():
        out = run(args)
    print(_table(out), file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
