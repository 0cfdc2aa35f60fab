"""End-to-end RL step time with HistoSpec + HistoPipe on vs off (and vLLM's drafters), in one process.

`python -m benchmarks e2e [--config configs/tiny-cpu.yaml] [--epochs 2] [--methods ngram,suffix,histospec] [--json] [key=value ...]`

A method may carry overrides of its own, ``method@key=value@key=value`` (an ablation in the
same process, e.g. ``histospec@histospec.step_cost=measured``); its label is the whole string.

Runs the same config from the same seed once per variant: accelerations off
(rollout.speculative=none, histopipe.enabled=false), then for each method of --methods the
same RL loop with that drafter and HistoPipe on (``histospec`` is RhymeRL's "on"; ``ngram``
and ``suffix`` are vLLM's drafters through the same loop). Reports the mean step time,
per-phase times, tokens per forward and reward over the steps of epoch >= 2 (epoch 1 has
no history to draft from), and each variant's ratio to off. ``--json`` prints one JSON
object on stdout (the engines' and trainers' logs go to stderr).

``--seeds 1234,1,2`` repeats the whole comparison once per ``run.seed``, each in a process of
its own, off included, and summarises each ratio across the seeds (geometric mean, min,
max). A seed is one draw of every sampled trajectory: the same code has given 1.04x to
1.71x at equal lengths over seeds 1234, 1 and 2, so one seed cannot rank two settings.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.rollout import (NONE_FIT_FIELDS, describe_none_fit, fit_none_time, none_time_s, quiet_stdout,
                                split_method)

PHASES = ("plan", "rollout", "reward", "train", "reshard")


def variant_config(base_cfg, spec: str, epochs: int, run_dir: Path):
    """The run's config as one variant runs it: the method's own overrides, its drafter,
    HistoPipe on unless it is ``none``, ``epochs`` epochs into ``run_dir``."""
    from rhymerl.config import from_dict, to_dict, with_overrides

    method, overrides = split_method(spec)
    d = with_overrides(to_dict(base_cfg), overrides)
    d["run"]["output_dir"] = str(run_dir)
    d["run"]["epochs"] = epochs
    d["run"]["max_steps"] = 0
    d["rollout"]["speculative"] = method
    d["histopipe"]["enabled"] = method != "none"
    return from_dict(d)


def _run_variant(cfg, groups, label: str) -> dict:
    from rhymerl.distributed.collectives import WorldComm
    from rhymerl.trainer import Trainer

    trainer = Trainer(cfg, WorldComm(), groups)
    rows = []
    try:
        total = cfg.run.epochs * trainer.sampler.steps_per_epoch
        while trainer.step < total:
            out = trainer.train_step()
            m = out.metrics
            rows.append(step_row(out.epoch, m))
            print(f"[bench e2e] {label} step {out.step} epoch {out.epoch} "
                  f"step {m['time/step_s']:.2f}s rollout {m.get('time/rollout_s', 0):.2f}s "
                  f"train {m.get('time/train_s', 0):.2f}s reward {m['reward/mean']:.3f} "
                  f"tok/fwd {rows[-1]['tokens_per_forward']:.2f}", file=sys.stderr)
    except BaseException:
        trainer.close()
        raise
    return summarize(rows), trainer


def step_row(epoch: int, m: dict) -> dict:
    """One step's figures from the trainer's metrics: the reward itself, and each phase's seconds."""
    return {"epoch": epoch, "step_s": m["time/step_s"], "reward_mean": m["reward/mean"],
            "response_len_mean": m.get("response/len_mean", 0.0),
            "tokens_per_forward": m.get("histospec/tokens_per_forward", 1.0),
            "generated_tokens": m.get("rollout/generated_tokens", 0),
            "longest_response": m.get("response/len_max", 0),
            "phases_s": {p: m.get(f"time/{p}_s", 0.0) for p in PHASES}}


def summarize(rows: list[dict]) -> dict:
    """Means over the steps of epoch >= 2 (the first epoch has no history to draft from)."""
    late = [r for r in rows if r["epoch"] >= 2] or rows
    mean = lambda get: sum(get(r) for r in late) / len(late)  # noqa: E731
    return {"step_s": mean(lambda r: r["step_s"]), "phases": {p: mean(lambda r: r["phases_s"][p]) for p in PHASES},
            "tokens_per_forward": mean(lambda r: r["tokens_per_forward"]),
            "reward_mean": mean(lambda r: r["reward_mean"]), "response_len_mean": mean(lambda r: r["response_len_mean"]),
            # Sampled variants follow different trajectories (other responses, other lengths): the
            # rollout's seconds per generated token compares them at equal work.
            "rollout_s_per_token": sum(r["phases_s"]["rollout"] for r in late)
            / max(1, sum(r.get("generated_tokens", 0) for r in late)),
            "steps_measured": len(late), "per_step": rows}


def add_ratios(v: dict, off: dict) -> None:
    """A variant's ratios to off. The raw step and rollout ratios compare different
    trajectories (sampled variants write other responses of other lengths: the same run
    has shown 1.21x and 1.86x for the same code); the per-token rollout ratio compares equal
    work, and ``step_speedup_at_equal_work`` is off's step with its rollout run at that
    per-token speed and every other phase as off measured it."""
    v["step_speedup"] = off["step_s"] / v["step_s"] if v["step_s"] > 0 else 0.0
    v["rollout_speedup"] = off["phases"]["rollout"] / v["phases"]["rollout"] if v["phases"]["rollout"] > 0 else 0.0
    v["rollout_share"] = v["phases"]["rollout"] / v["step_s"] if v["step_s"] > 0 else 0.0
    per_tok = off["rollout_s_per_token"] / v["rollout_s_per_token"] if v["rollout_s_per_token"] > 0 else 0.0
    v["rollout_speedup_per_token"] = per_tok
    rollout = off["phases"]["rollout"]
    equal = off["step_s"] - rollout + (rollout / per_tok if per_tok > 0 else 0.0)
    v["step_speedup_at_equal_work"] = off["step_s"] / equal if per_tok > 0 and equal > 0 else 0.0
    add_equal_lengths(v, off)


def add_equal_lengths(v: dict, off: dict) -> None:
    """Ratios at the variant's own lengths: off's rollout time for exactly the responses the
    variant wrote, step by step (fitted over off's steps: a rollout is a closed batch that
    pays per step for its longest response and per token for the rest; ``fit_none_time``),
    against the variant's rollout; its step with every other phase as the variant measured it
    (the same responses train, score and reshard alike with or without drafts). Per-token
    speed alone charges a variant that drew a longer tail for the tail's small batches."""

    runs = [{"longest_response": r.get("longest_response", 0), "generated_tokens": r.get("generated_tokens", 0),
             "wall_s": r["phases_s"]["rollout"]} for r in off.get("per_step", [])]
    fit = fit_none_time(runs)
    late = [r for r in v.get("per_step", []) if r["epoch"] >= 2]
    if fit is None or not late or any(r.get("longest_response", 0) <= 0 for r in late):
        return
    off["rollout_time_fit"] = dict(zip(NONE_FIT_FIELDS, fit))
    off_rollout = [none_time_s(fit, r["longest_response"], r["generated_tokens"]) for r in late]
    rollout = sum(r["phases_s"]["rollout"] for r in late)
    step = sum(r["step_s"] for r in late)
    if rollout > 0 and step > 0:
        v["rollout_speedup_at_equal_lengths"] = sum(off_rollout) / rollout
        v["step_speedup_at_equal_lengths"] = (step - rollout + sum(off_rollout)) / step


METHODS = ("ngram", "suffix", "histospec")
# The ratios summarised across seeds.
SEED_KEYS = ("rollout_speedup_at_equal_lengths", "step_speedup_at_equal_lengths", "rollout_speedup_per_token",
             "step_speedup", "rollout_speedup", "tokens_per_forward")


def across_seeds(runs: dict) -> dict:
    """Per variant label and ratio of ``SEED_KEYS``: each seed's value (in ``runs``' order),
    their geometric mean, min and max. ``runs``: one ``bench e2e --json`` object per seed.
    A ratio a seed did not produce (no fit) is left out of that ratio's summary."""
    out: dict = {}
    for seed, run in runs.items():
        for label, v in run["variants"].items():
            for key in SEED_KEYS:
                x = v.get(key)
                if x is None or not x > 0:
                    continue
                cell = out.setdefault(label, {}).setdefault(key, {"seeds": [], "each": []})
                cell["seeds"].append(seed)
                cell["each"].append(x)
    for keys in out.values():
        for cell in keys.values():
            xs = cell["each"]
            cell.update(geomean=math.exp(sum(math.log(x) for x in xs) / len(xs)), min=min(xs), max=max(xs))
    return out


def parse_seeds(text: str) -> list[int]:
    seeds = [int(x) for x in text.split(",") if x.strip()]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: need distinct integers (got {text!r})")
    return seeds


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks e2e", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    ap.add_argument("--epochs", type=int, default=2, help="epochs per variant (measured: epoch >= 2)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"drafters run with HistoPipe on, each against off (any of {', '.join(METHODS)})")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--out", default="runs/bench-e2e")
    ap.add_argument("--seeds", default="",
                    help="comma-separated run.seed values: the whole comparison once per seed, each in its own "
                         "process, summarised across seeds")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides applied to every variant")
    args = ap.parse_args(argv)
    if args.epochs < 2:
        ap.error("--epochs must be >= 2: epoch 1 has no history")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if split_method(m)[0] not in METHODS]
    if bad or not methods:
        ap.error(f"--methods: unknown {bad or methods}; allowed: {', '.join(METHODS)}")
    from rhymerl.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, ValueError) as e:
        ap.error(str(e))
    # Every variant's config is built here, so a method's own overrides fail before any
    # variant has run for minutes.
    variants = {}
    for spec in ["none", *methods]:
        label = "off" if spec == "none" else spec
        try:
            variants[label] = variant_config(cfg, spec, args.epochs,
                                             Path(args.out) / label.replace("@", "+").replace("=", "-"))
        except (ConfigError, ValueError) as e:
            ap.error(f"--methods {spec}: {e}")
    if args.seeds:
        try:
            seeds = parse_seeds(args.seeds)
        except ValueError as e:
            ap.error(str(e))
        if any(o.split("=", 1)[0].strip() == "run.seed" for o in args.overrides):
            ap.error("--seeds sets run.seed: drop the run.seed override")
        out = _run_seeds(args, seeds)
        if out is None:
            return 1
        if args.json:
            print(json.dumps(out))
        return 0

    with quiet_stdout():
        out = _run(args, variants)
    if args.json:
        print(json.dumps(out))
    return 0


def _run_seeds(args, seeds: list[int]) -> dict | None:
    """One child ``bench e2e --json`` per seed (a fresh process each: vLLM engines and
    Megatron share process-wide state that one process cannot tear down and rebuild many
    times), then the ratios across seeds."""
    runs: dict = {}
    t0 = time.time()
    for seed in seeds:
        cmd = [sys.executable, "-m", "benchmarks", "e2e", "--json", "--config", args.config,
               "--epochs", str(args.epochs), "--methods", args.methods, "--out", str(Path(args.out) / f"seed-{seed}"),
               *args.overrides, f"run.seed={seed}"]
        print(f"[bench e2e] seed {seed}: {' '.join(cmd[1:])}", file=sys.stderr)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            print(f"python -m benchmarks e2e: seed {seed} failed (exit {proc.returncode}); its log is above", file=sys.stderr)
            return None
        runs[seed] = json.loads(proc.stdout)
    summary = across_seeds(runs)
    print(f"\n{'across seeds ' + ','.join(map(str, seeds)):<40}{'geomean':>9}{'min':>7}{'max':>7}", file=sys.stderr)
    for label, keys in summary.items():
        print(label, file=sys.stderr)
        for key in SEED_KEYS:
            c = keys.get(key)
            if c is not None:
                print(f"  {key:<38}{c['geomean']:>9.2f}{c['min']:>7.2f}{c['max']:>7.2f}", file=sys.stderr)
    print(f"({len(seeds)} seeds, each against its own off; {time.time() - t0:.0f} s total)", file=sys.stderr)
    return {"seeds": seeds, "epochs": args.epochs, "runs": {str(k): v for k, v in runs.items()},
            "across_seeds": summary}


def _run(args, configs: dict) -> dict:
    """``configs``: each variant's config by label, ``off`` first."""
    from rhymerl.distributed.process_groups import init_process_groups

    groups = init_process_groups(configs["off"].parallel, 1, 0)
    t0 = time.time()
    # Every trainer stays alive until the end: shutting down the last live vLLM engine tears
    # down the process-wide torch.distributed state the next trainer's Megatron needs.
    trainers = []
    variants: dict = {}
    try:
        for label, vcfg in configs.items():
            variants[label], t = _run_variant(vcfg, groups, label)
            trainers.append(t)
    finally:
        for t in reversed(trainers):
            t.close()
    off = variants["off"]
    for v in variants.values():
        add_ratios(v, off)
    labels = list(variants)
    print(f"\n{'phase (s)':<12}" + "".join(f"{lb:>11}" for lb in labels), file=sys.stderr)
    for p in ("step",) + PHASES:
        vals = [v["step_s"] if p == "step" else v["phases"][p] for v in variants.values()]
        print(f"{p:<12}" + "".join(f"{x:>11.2f}" for x in vals), file=sys.stderr)
    for key in ("step_speedup", "rollout_speedup", "rollout_speedup_per_token", "step_speedup_at_equal_work",
                "rollout_speedup_at_equal_lengths", "step_speedup_at_equal_lengths",
                "rollout_share", "tokens_per_forward", "reward_mean", "response_len_mean"):
        print(f"{key:<12}" + "".join(f"{v.get(key, float('nan')):>11.2f}" for v in variants.values()), file=sys.stderr)
    if "rollout_time_fit" in off:

        print(f"(equal lengths: off's rollout = {describe_none_fit(off['rollout_time_fit'], 'its steps')})",
              file=sys.stderr)
    print(f"(epoch >= 2 means; ratios vs off in this run; {time.time() - t0:.0f} s total)", file=sys.stderr)
    on = variants.get("histospec")
    return {"variants": variants, "off": off, "on": on, "speedup": on["step_speedup"] if on else None,
            "rollout_speedup": on["rollout_speedup"] if on else None, "epochs": args.epochs}
