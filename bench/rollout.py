"""vLLM rollout benchmark: no speculation vs ngram vs suffix vs HistoSpec on epoch 2.

For each method, in one process and with the same prompts, sampling and seed: build
an engine, warm it up, run epoch 1 (fills HistoSpec's history, and suffix decoding's
own cache of recent responses), then time epoch 2. The policy does not change between
the epochs here, so epoch 2 is as similar to epoch 1 as sampling allows; in training
the policy moves a little each step. Ratios are against `none` measured in this run;
`tokens_per_forward` (tokens emitted per target forward pass of a sequence) does not
depend on the hardware.

    python -m rhymerl bench rollout --json                  # SmolLM2-135M-Instruct, T=1.0, n=4
    python -m rhymerl bench rollout --quick --model builtin:tiny
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

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


def _prompts(model_dir, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for q in (QUESTIONS * (count // len(QUESTIONS) + 1))[:count]:
        if tok.chat_template:
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tok(q)["input_ids"]
        out.append([int(t) for t in ids])
    return out


def run(args) -> dict:
    from rhymerl.config import HistoSpecConfig, ModelConfig, RolloutConfig
    from rhymerl.models import resolve_model
    from rhymerl.rollout import RolloutEngine, RolloutError, SamplingSpec

    if args.model == "builtin:tiny":
        from rhymerl.config import TinyModelConfig

        # vLLM's CPU attention has no head size 16 (the default tiny shape): use 2 heads of 32.
        model_dir = resolve_model(ModelConfig(path=args.model, tiny=TinyModelConfig(num_attention_heads=2, num_key_value_heads=1)))
    else:
        model_dir = resolve_model(ModelConfig(path=args.model))
    prompts = _prompts(model_dir, args.prompts)
    sp = SamplingSpec(temperature=args.temperature, max_tokens=args.max_tokens, seed=None)
    hs = HistoSpecConfig()
    results: dict = {}
    for method in args.methods:
        cfg = RolloutConfig(speculative=method, n=args.n, temperature=args.temperature, max_tokens=args.max_tokens,
                            num_speculative_tokens=args.k, max_num_seqs=max(64, args.n * len(prompts)),
                            max_model_len=1024, cpu_kv_cache_gb=1.0)
        t0 = time.perf_counter()
        try:
            eng = RolloutEngine(cfg, hs, model_dir, seed=args.seed)
        except RolloutError as e:
            results[method] = {"error": str(e)}
            print(f"[{method}] skipped: {e}", file=sys.stderr)
            continue
        startup = time.perf_counter() - t0
        try:
            eng.generate(prompts[:1], 1, SamplingSpec(temperature=args.temperature, max_tokens=8), epoch=0)  # warm-up (JIT)
            eng.history = type(eng.history)(hs, vocab_size=eng.vocab_size)  # forget the warm-up
            eng.generate(prompts, args.n, sp, epoch=1)
            e1 = eng.metrics()
            eng.generate(prompts, args.n, sp, epoch=2)
            e2 = eng.metrics()
        finally:
            eng.shutdown()
        r = dict(e2)
        r["startup_s"] = startup
        r["epoch1_tokens_per_forward"] = e1["tokens_per_forward"]
        r["epoch1_wall_s"] = e1["wall_s"]
        r["s_per_engine_step"] = e2["wall_s"] / max(1, e2["engine_steps"])
        # Tokens the target model scored (1 + draft per sequence-step): CPU cost is ~linear in them.
        scored = e2["target_forwards"] + e2["draft_proposed"]
        r["scored_tokens"] = scored
        r["ms_per_scored_token"] = 1e3 * e2["wall_s"] / max(1, scored)
        results[method] = r
        print(f"[{method}] startup {startup:.1f}s epoch2 {e2['wall_s']:.2f}s {e2['tokens_per_s']:.0f} tok/s "
              f"tok/fwd {e2['tokens_per_forward']:.2f} acc {e2['acceptance_rate']:.2f}", file=sys.stderr)
    base = results.get("none", {}).get("wall_s")
    for r in results.values():
        if "wall_s" in r:
            r["speedup_vs_none"] = base / r["wall_s"] if base else None
    return {
        "model": args.model, "temperature": args.temperature, "n": args.n, "prompts": len(prompts),
        "max_tokens": args.max_tokens, "num_speculative_tokens": args.k, "threads": os.environ.get("OMP_NUM_THREADS"),
        "methods": results,
    }


def _table(out: dict) -> str:
    cols = ["wall_s", "speedup_vs_none", "tokens_per_s", "tokens_per_forward", "acceptance_rate",
            "mean_accepted_len", "engine_steps", "scored_tokens", "ms_per_scored_token", "draft_time_s", "startup_s"]
    lines = [f"rollout bench: {out['model']} T={out['temperature']} n={out['n']} prompts={out['prompts']} "
             f"max_tokens={out['max_tokens']} k={out['num_speculative_tokens']} (epoch 2)",
             f"{'method':<10}" + "".join(f"{c[:18]:>19}" for c in cols)]
    for m, r in out["methods"].items():
        if "error" in r:
            lines.append(f"{m:<10} error: {r['error']}")
            continue
        lines.append(f"{m:<10}" + "".join(f"{r.get(c) if r.get(c) is None else round(r[c], 3):>19}" for c in cols))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rhymerl bench rollout", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--model", default="builtin:smollm2-135m-instruct")
    p.add_argument("--quick", action="store_true", help="fewer prompts and tokens (a fast smoke run)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("-k", type=int, default=8, help="num_speculative_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default="none,ngram,suffix,histospec")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens = min(args.prompts, 4), min(args.max_tokens, 48)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM logs to stdout; keep stdout for the one JSON object.
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        out = run(args)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    print(_table(out), file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
