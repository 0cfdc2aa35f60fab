"""Training phase of one RL step: a separate old-log-prob pass vs on-policy, full-width vs
length-cut micro-batches, in one process on the same batch.

The batch is a real step's responses from a rollout trace (``benchmarks/traces/*.jsonl``: one
step's rows, behind a fixed prompt of ``--prompt-tokens`` tokens), trained on the Megatron
backend (TP=PP=DP=1, this process). Variants, each timed as the trainer's training phase
(old-log-prob pass, if any, plus ``train_step``), interleaved over ``--repeats``:

- ``separate_full``: a no-grad pass for the old log-probs, micro-batches as wide as the
  batch's longest row (the trainer's path before on-policy steps and length-cut micro-batches);
- ``separate_cut``: the separate pass, micro-batches cut to their own longest row;
- ``on_policy_cut``: old log-probs from the loss's own forward (``updates_per_step: 1``).

Prints seconds per variant and each one's ratio to ``on_policy_cut``. ``--attention`` and
``--recompute-activations`` / ``--recompute-norms`` choose the backend's attention kernel and
recomputation (run once per choice to compare them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

DEFAULT_TRACE = Path(__file__).with_name("traces") / "smollm2-basic-arithmetic-steps-grpo.jsonl"


def trace_batch(path: Path, rows: int, prompt_tokens: int, step: int):
    import torch

    from rhymerl.training.base import PolicyBatch

    from rhymerl.outputs.traces import read_trace

    recs = read_trace(path)
    steps = sorted({r.step or 0 for r in recs})
    pick = [r for r in recs if (r.step or 0) == steps[min(step, len(steps) - 1)]][:rows]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 20000, (prompt_tokens,), generator=g).tolist()
    T = prompt_tokens + max(len(r.token_ids) for r in pick)
    ids = torch.zeros(len(pick), T, dtype=torch.long)
    mask = torch.zeros(len(pick), T)
    for i, r in enumerate(pick):
        row = prompt + list(r.token_ids)
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, prompt_tokens:len(row)] = 1.0
    # No row at advantage 0, which the backends would leave out: every row trains.
    n = len(pick)
    adv = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0) * torch.linspace(0.5, 1.0, n)
    lengths = [len(r.token_ids) for r in pick]
    return PolicyBatch(input_ids=ids, response_mask=mask, advantages=adv), lengths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.train_phase", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--step", type=int, default=0, help="which step of the trace (index into its steps)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--micro-batch-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--attention", choices=("sdpa", "unfused"), default="sdpa", help="parallel.attention")
    ap.add_argument("--recompute-activations", action="store_true", help="parallel.recompute_activations")
    ap.add_argument("--recompute-norms", choices=["true", "false"], default=None,
                    help="parallel.recompute_norms (default: the config default)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch

    import rhymerl.training.megatron_backend as mb_mod
    from rhymerl.config import AlgorithmConfig, ModelConfig, ParallelConfig
    from rhymerl.models import resolve_model
    from rhymerl.training import build_backend
    from rhymerl.distributed.process_groups import destroy_process_groups, init_process_groups

    batch, lengths = trace_batch(args.trace, args.rows, args.prompt_tokens, args.step)
    pcfg = ParallelConfig(attention=args.attention, recompute_activations=args.recompute_activations)
    if args.recompute_norms is not None:
        pcfg.recompute_norms = args.recompute_norms == "true"
    groups = init_process_groups(pcfg, 1, 0)
    backend = build_backend(pcfg, AlgorithmConfig(lr=1e-7, micro_batch_tokens=args.micro_batch_tokens),
                            resolve_model(ModelConfig(path=args.model)), groups)
    real_split, real_policy = mb_mod.split_policy_rows, mb_mod.policy_micro_batches

    def full_width(on: bool) -> None:
        # The full-width variant forces the fixed-shape micro-batches pipeline stages need.
        mb_mod.split_policy_rows = (lambda *a, **k: real_split(*a[:5], fixed_shape=True)) if on else real_split
        mb_mod.policy_micro_batches = (lambda *a, **k: real_policy(*a[:4], fixed_shape=True)) if on else real_policy

    def phase(separate: bool) -> float:
        b = type(batch)(batch.input_ids, batch.response_mask, batch.advantages)
        t0 = time.perf_counter()
        if separate:
            with torch.no_grad():
                b.old_logprobs = backend.compute_logprobs(b.input_ids, b.response_mask)
        backend.train_step(b)
        return time.perf_counter() - t0

    variants = {"separate_full": (True, True), "separate_cut": (True, False), "on_policy_cut": (False, False)}
    phase(False)  # warm-up: allocator, optimizer state
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.repeats):
        for name, (separate, full) in variants.items():
            full_width(full)
            times[name].append(phase(separate))
    full_width(False)
    destroy_process_groups()
    base = statistics.median(times["on_policy_cut"])
    out = {"rows": len(lengths), "response_tokens": sum(lengths), "response_len_max": max(lengths),
           "prompt_tokens": args.prompt_tokens, "batch_width": int(batch.input_ids.shape[1]),
           "micro_batch_tokens": args.micro_batch_tokens, "attention": args.attention,
           "recompute_activations": args.recompute_activations, "recompute_norms": pcfg.recompute_norms,
           "matmul_dtype": str(backend.dtype).removeprefix("torch."),
           "repeats": args.repeats,
           "seconds": {k: round(statistics.median(v), 3) for k, v in times.items()},
           "ratio_to_on_policy_cut": {k: round(statistics.median(v) / base, 3) for k, v in times.items()}}
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out["seconds"].items():
            print(f"{k:15s} {v:8.2f} s  {out['ratio_to_on_policy_cut'][k]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
