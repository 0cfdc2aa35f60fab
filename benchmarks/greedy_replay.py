"""A trained run's prompts, replayed greedily through the real engine by every speculative method.

At temperature 0 every method writes the same tokens (lossless verification of a greedy
target), so their rollout wall times compare exactly: no sampled length lottery, no
equal-length correction. The policy is the run's checkpoint (exported to an HF folder), the
prompts are its dataset's, and every method drafts from the same evidence: HistoSpec from the
run's history store (the epochs it sampled) with the acceptance it had learnt, vLLM's
``suffix`` from a cache warmed with the same responses, ``ngram`` from the prompt and output.
Each repeat rebuilds that state, so no method drafts from a response it wrote in an earlier
repeat, and the methods run interleaved (the order rotates each repeat): a busy host slows
all of them alike. The figures are each method's median over the repeats.

    python -m benchmarks greedy-replay RUN_DIR [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import typing
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from transformers import AutoTokenizer

import yaml

from benchmarks.rollout import quiet_stdout, rotated
from benchmarks.suffix_cache import refill_suffix_cache
from rhymerl.config import RunConfig, from_dict
from rhymerl.data import few_shot_pool, load_records, render_prompt
from rhymerl.histospec import HistoryStore, prompt_key
from rhymerl.resharding.hf_export import export_checkpoint
from rhymerl.rollout import RolloutEngine, SamplingSpec

METHODS = ("none", "ngram", "suffix", "histospec")


def _known_keys(data: dict, cls: type) -> dict:
    """``data`` without the keys ``cls`` (a config dataclass) no longer has: a run written by an
    earlier version may name settings since removed."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            v = data[f.name]
            sub = hints[f.name]
            out[f.name] = _known_keys(v, sub) if dataclasses.is_dataclass(sub) and isinstance(v, dict) else v
    return out


def load_run(run_dir: Path, checkpoint: Optional[Path]) -> tuple[Any, Path, bytes, Optional[dict]]:
    """(config, checkpoint folder, history store bytes, the drafter's learnt state) of a run."""
    if checkpoint is None:
        pointer = run_dir / "checkpoints" / "latest"
        if not pointer.is_file():
            raise FileNotFoundError(f"{run_dir}: no checkpoints/latest (pass --checkpoint)")
        checkpoint = run_dir / "checkpoints" / pointer.read_text().strip()
    cfg = from_dict(_known_keys(yaml.safe_load((checkpoint / "config.yaml").read_text()), RunConfig))
    history = (checkpoint / "state" / "history.bin").read_bytes()
    rank = checkpoint / "ranks" / "rank-00000.json"
    drafter = json.loads(rank.read_text()).get("drafter") if rank.is_file() else None
    return cfg, checkpoint, history, drafter


def run(args: Any) -> dict:
    cfg, ckpt, history_bytes, drafter_state = load_run(Path(args.run), Path(args.checkpoint) if args.checkpoint else None)
    tmp = tempfile.TemporaryDirectory(prefix="greedy-replay-")
    t0 = time.perf_counter()
    model_dir = export_checkpoint(ckpt, Path(tmp.name) / "hf")
    print(f"[greedy-replay] exported {ckpt} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    records = load_records(cfg.data)
    shots = few_shot_pool(records, cfg.data.few_shot, cfg.data.seed)
    prompts = [render_prompt(r, shots[r.id], tok, cfg.data) for r in records]
    history = HistoryStore.from_bytes(history_bytes, cfg.histospec)
    by_key = {prompt_key(p): p for p in prompts}
    warm = [(by_key[k], r) for k in history.keys() if k in by_key for visit in history.responses(k) for r in visit]
    # HistoPipe's estimate, as the trainer passes it: the mean length the prompt drew before.
    predicted = [statistics.fmean(x for v in history.lengths(prompt_key(p)) for x in v)
                 if history.lengths(prompt_key(p)) else None for p in prompts]
    max_tokens = args.max_tokens or cfg.rollout.max_tokens
    rollout = replace(cfg.rollout, temperature=0.0, max_num_seqs=max(cfg.rollout.max_num_seqs, args.n * len(prompts)))
    sampling = SamplingSpec(temperature=0.0, max_tokens=max_tokens, seed=cfg.run.seed)
    engines = {}
    for method in args.methods:
        engines[method] = RolloutEngine(replace(rollout, speculative=method), cfg.histospec, model_dir, seed=cfg.run.seed,
                                        dtype=cfg.model.dtype)
    runs: dict[str, list[dict]] = {m: [] for m in args.methods}
    tokens: dict[str, list] = {}
    try:
        for method, eng in engines.items():  # untimed warm-up: first use of each code path
            eng.generate(prompts[:1], 1, replace(sampling, max_tokens=8), record_history=False)
        for rep in range(args.repeats):
            for method in rotated(args.methods, rep):
                eng = engines[method]
                if method == "histospec":
                    eng.set_history(HistoryStore.from_bytes(history_bytes, cfg.histospec))
                    eng.load_drafter_state(drafter_state)
                elif method == "suffix":
                    refill_suffix_cache(eng, warm)
                load = os.getloadavg()[0]
                t0, c0 = time.perf_counter(), time.process_time()
                res = eng.generate(prompts, args.n, sampling, epoch=cfg.run.epochs, record_history=False,
                                   group_ids=[f"g{i}" for i in range(len(prompts))], predicted_lengths=predicted)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                m = eng.metrics()
                # The host's load when the run began: on a shared machine, what a wall time is worth.
                # CPU seconds of this process (the engine runs in it): what other processes' load
                # barely moves, where wall time can stretch several fold.
                runs[method].append({"wall_s": wall, "cpu_s": cpu, "load_average": load,
                                     "tokens_per_forward": m["tokens_per_forward"],
                                     "acceptance_rate": m["acceptance_rate"], "generated_tokens": m["generated_tokens"],
                                     "draft_proposed": m["draft_proposed"], "target_forwards": m["target_forwards"],
                                     "engine_steps": m["engine_steps"]})
                tokens.setdefault(method, [r.token_ids for x in res for r in x.responses])
                print(f"[greedy-replay] repeat {rep + 1}/{args.repeats} {method}: {wall:.1f} s, "
                      f"{m['tokens_per_forward']:.2f} tokens per forward", file=sys.stderr)
    finally:
        for eng in engines.values():
            eng.shutdown()
        tmp.cleanup()
    out: dict = {"run": str(args.run), "checkpoint": str(ckpt), "prompts": len(prompts), "n": args.n,
                 "max_tokens": max_tokens, "repeats": args.repeats, "methods": {}}
    ref = tokens.get("none")
    for method, rs in runs.items():
        walls = [r["wall_s"] for r in rs]
        cpus = [r["cpu_s"] for r in rs]
        row = {"wall_s_median": statistics.median(walls), "wall_s": [round(w, 3) for w in walls],
               "cpu_s_median": statistics.median(cpus), "cpu_s": [round(c, 3) for c in cpus],
               "load_average": [round(r["load_average"], 1) for r in rs],
               **{k: rs[0][k] for k in ("tokens_per_forward", "acceptance_rate", "generated_tokens", "draft_proposed",
                                        "target_forwards", "engine_steps")},
               "same_tokens_as_none": None if ref is None else tokens[method] == ref}
        out["methods"][method] = row
    base, suffix = out["methods"].get("none"), out["methods"].get("suffix")
    for row in out["methods"].values():
        if base:
            row["speedup_vs_none"] = round(base["wall_s_median"] / row["wall_s_median"], 4)
            row["cpu_speedup_vs_none"] = round(base["cpu_s_median"] / row["cpu_s_median"], 4)
        if suffix:
            row["wall_vs_suffix"] = round(row["wall_s_median"] / suffix["wall_s_median"], 4)
            row["cpu_vs_suffix"] = round(row["cpu_s_median"] / suffix["cpu_s_median"], 4)
    return out


def table(out: dict) -> str:
    cols = ("wall_s_median", "speedup_vs_none", "wall_vs_suffix", "cpu_s_median", "cpu_vs_suffix",
            "tokens_per_forward", "acceptance_rate", "same_tokens_as_none")
    lines = [f"greedy replay of {out['checkpoint']}: {out['prompts']} prompts x {out['n']}, up to {out['max_tokens']} "
             f"tokens, median of {out['repeats']} interleaved repeats",
             "".ljust(12) + "".join(c.rjust(22) for c in cols)]
    for name, row in out["methods"].items():
        cells = [f"{row.get(c):22.3f}" if isinstance(row.get(c), float) else f"{str(row.get(c, '-')):>22}" for c in cols]
        lines.append(name.ljust(12) + "".join(cells))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks greedy-replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a run folder (its checkpoints/latest, config and history)")
    ap.add_argument("--checkpoint", help="a checkpoint folder of the run (default: the latest)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n", type=int, default=1, help="responses per prompt (greedy: identical siblings)")
    ap.add_argument("--max-tokens", type=int, default=0, help="default: the run's rollout.max_tokens")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := set(args.methods) - set(METHODS):
        print(f"benchmarks greedy-replay: unknown methods {sorted(unknown)}; allowed: {', '.join(METHODS)}",
              file=sys.stderr)
        return 2
    if args.repeats < 1 or args.n < 1:
        print("benchmarks greedy-replay: --repeats and --n must be >= 1", file=sys.stderr)
        return 2
    try:
        with quiet_stdout():
            out = run(args)
    except FileNotFoundError as e:
        print(f"benchmarks greedy-replay: {e}", file=sys.stderr)
        return 2
    print(table(out), file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
