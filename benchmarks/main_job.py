"""The main job as a user runs it, at several seeds: does the reward rise, does HistoSpec pay more?

`python -m benchmarks main-job [--config configs/tiny-cpu.yaml] [--seeds 1234,1,2] [--out runs/main-job] [--json] [key=value ...]`

Runs ``python -m rhymerl train CONFIG run.seed=S run.output_dir=OUT/seed-S`` once per seed, one
after the other (the README's command, without setup), each in a process of its own, its log in
``OUT/seed-S.log``. Then prints per seed, from the run's own ``metrics.jsonl``, the per-epoch
mean reward, accuracy, HistoSpec tokens per forward, the draft tokens accepted from the prompts'
earlier responses per forward, and response length (the figures of ``rhymerl report``'s
headline), the wall time of the process and the training time (the sum of its steps'
``time/step_s``), and the host's load average before and after (the host may be shared: times
are comparable only with runs measured under the same load). The verdict: at every seed the last
epoch's mean reward is above the first's, the last epoch's tokens per forward above the second's
(the first epoch has no history to draft from), and the second epoch accepts drafts from the
prompts' earlier responses. ``--json`` prints one JSON object on stdout instead. Exit
status 1 when a run fails or the verdict does not hold.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from rhymerl.outputs.report import STEP_TIME, epoch_figures, load_run

# Per-epoch figures of a run, by the name this bench prints them under.
FIGURES = {
    "reward": "reward/mean",
    "accuracy": "reward/accuracy",
    "tokens_per_forward": "histospec/tokens_per_forward",
    "history_per_forward": "histospec/history_tokens_per_forward",
    "response_len": "response/len_mean",
}
# The trainer's one console line per step, echoed while a run goes.
STEP_LINE = re.compile(r"^step \d+/\d+ \|")


def seed_summary(rows: list[dict]) -> dict:
    """Per-epoch figures (lists in epoch order, with the epochs as the rows number them), the
    training time, and whether this seed shows learning and HistoSpec paying more."""
    per_epoch = {name: epoch_figures(rows, key) for name, key in FIGURES.items()}
    epochs = sorted(per_epoch["reward"])
    out = {"epochs": epochs, **{name: [figs[e] for e in epochs if e in figs] for name, figs in per_epoch.items()},
           "steps": len(rows), "train_s": sum(float(r.get(STEP_TIME, 0.0)) for r in rows)}
    rew, tpf = out["reward"], out["tokens_per_forward"]
    out["reward_rose"] = len(rew) >= 2 and rew[-1] > rew[0]
    out["tokens_per_forward_rose"] = len(tpf) >= 3 and tpf[-1] > tpf[1]
    hist = out["history_per_forward"]
    # The promise is that history pays from the second epoch; later, a policy that loops may draft
    # better from its own output, and the rule rightly switches sources.
    out["history_paid"] = len(hist) >= 2 and hist[1] > 0
    return out


def verdict(runs: dict) -> tuple[bool, str]:
    """Whether every seed's reward and tokens per forward rose, as one line."""
    n = len(runs)
    rose = sum(r["reward_rose"] for r in runs.values())
    paid = sum(r["tokens_per_forward_rose"] for r in runs.values())
    hist = sum(r["history_paid"] for r in runs.values())
    train = [r["train_s"] for r in runs.values()]
    wall = [r["wall_s"] for r in runs.values() if "wall_s" in r]
    ok = n > 0 and rose == n and paid == n and hist == n
    times = f"training {min(train):.0f}-{max(train):.0f} s" if train else "no runs"
    if wall:
        times += f", wall {min(wall):.0f}-{max(wall):.0f} s"
    return ok, (f"verdict: {'PASS' if ok else 'FAIL'}: reward higher in the last epoch than the first at {rose} of "
                f"{n} seeds; tokens per forward higher in the last epoch than the second at {paid} of {n}; drafts "
                f"from earlier responses accepted in the second epoch at {hist} of {n}; {times}")


def format_seed(seed: int, r: dict) -> str:
    head = f"seed {seed}: {r['steps']} steps, training {r['train_s']:.0f} s"
    if "wall_s" in r:
        head += f", wall {r['wall_s']:.0f} s (load average {r['load_before']:.1f} before, {r['load_after']:.1f} after)"
    lines = [head, f"  {'epoch':<20}" + "".join(f"{e:>7}" for e in r["epochs"])]
    for name, fmt in (("reward", ".3f"), ("accuracy", ".3f"), ("tokens_per_forward", ".2f"),
                      ("history_per_forward", ".2f"), ("response_len", ".0f")):
        if r.get(name):
            lines.append(f"  {name:<20}" + "".join(f"{v:>7{fmt}}" for v in r[name]))
    return "\n".join(lines)


def run_seed(config: str, seed: int, run_dir: Path, overrides: list[str]) -> dict:
    """Train one seed in a child process (its output to ``run_dir``.log, step lines echoed to
    stderr) and summarise its metrics; raises RuntimeError when the run fails."""
    cmd = [sys.executable, "-m", "rhymerl", "train", config, f"run.seed={seed}", f"run.output_dir={run_dir}",
           *overrides]
    log = run_dir.parent / f"{run_dir.name}.log"
    print(f"[bench main-job] seed {seed}: {' '.join(cmd[1:])} (log: {log})", file=sys.stderr)
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:
            f.write(line)
            if STEP_LINE.match(line):
                print(f"[bench main-job] seed {seed} {line.rstrip()}", file=sys.stderr)
        rc = proc.wait()
    wall = time.monotonic() - t0
    if rc != 0:
        raise RuntimeError(f"seed {seed}: training failed (exit {rc}); its log: {log}")
    out = seed_summary(load_run(run_dir).rows)
    out.update(wall_s=wall, load_before=load_before, load_after=os.getloadavg()[0], run_dir=str(run_dir))
    return out


def _parse_seeds(text: str) -> list[int]:
    seeds = [int(s) for s in text.split(",") if s.strip()]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: give distinct integers, e.g. 1234,1,2 (got {text!r})")
    return seeds


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks main-job", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    ap.add_argument("--seeds", default="1234,1,2", help="comma-separated run.seed values, one run each")
    ap.add_argument("--out", default="runs/main-job", help="one run folder per seed under it (must not exist yet)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides applied to every seed's run")
    args = ap.parse_args(argv)
    try:
        seeds = _parse_seeds(args.seeds)
    except ValueError as e:
        ap.error(str(e))
    if any(o.split("=", 1)[0].strip() in ("run.seed", "run.output_dir") for o in args.overrides):
        ap.error("--seeds and --out set run.seed and run.output_dir: drop those overrides")
    out = Path(args.out)
    # An existing run folder would resume from its checkpoint instead of training from scratch.
    taken = [str(out / f"seed-{s}") for s in seeds if (out / f"seed-{s}").exists()]
    if taken:
        ap.error(f"--out: {', '.join(taken)} already exist (a run there would resume); pass another --out")
    out.mkdir(parents=True, exist_ok=True)
    runs: dict = {}
    for seed in seeds:
        try:
            runs[seed] = run_seed(args.config, seed, out / f"seed-{seed}", args.overrides)
        except RuntimeError as e:
            print(f"python -m benchmarks main-job: {e}", file=sys.stderr)
            return 1
        print(format_seed(seed, runs[seed]), file=sys.stderr if args.json else sys.stdout, flush=True)
    ok, line = verdict(runs)
    if args.json:
        print(json.dumps({"config": args.config, "overrides": args.overrides, "seeds": seeds,
                          "runs": {str(s): r for s, r in runs.items()}, "pass": ok, "verdict": line}))
        print(line, file=sys.stderr)
    else:
        print(line)
    return 0 if ok else 1
