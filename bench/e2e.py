"""End-to-end RL step time with HistoSpec + HistoPipe on vs off, in one process.

`python -m rhymerl bench e2e [--config configs/tiny-cpu.yaml] [--epochs 2] [--json] [key=value ...]`

Runs the same config twice from the same seed: accelerations off (rollout.speculative=none,
histopipe.enabled=false) and on (histospec + histopipe), and reports the mean step time
and per-phase times over the steps of epoch >= 2 (epoch 1 has no history to draft from).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PHASES = ("plan", "rollout", "reward", "train", "reshard")


def _run_variant(base_cfg, groups, on: bool, epochs: int, run_dir: Path) -> dict:
    from rhymerl.collectives import WorldComm
    from rhymerl.config import from_dict, to_dict
    from rhymerl.trainer import Trainer

    d = to_dict(base_cfg)
    d["run"]["output_dir"] = str(run_dir)
    d["run"]["epochs"] = epochs
    d["run"]["max_steps"] = 0
    d["rollout"]["speculative"] = "histospec" if on else "none"
    d["histopipe"]["enabled"] = on
    cfg = from_dict(d)
    trainer = Trainer(cfg, WorldComm(), groups)
    rows = []
    try:
        total = epochs * trainer.sampler.steps_per_epoch
        while trainer.step < total:
            out = trainer.train_step()
            m = out.metrics
            rows.append({"epoch": out.epoch, "step_s": m["time/step_s"], "reward": m["reward/mean"],
                         "tokens_per_forward": m.get("histospec/tokens_per_forward", 1.0),
                         **{p: m.get(f"time/{p}_s", 0.0) for p in PHASES}})
            print(f"[bench e2e] {'on ' if on else 'off'} step {out.step} epoch {out.epoch} "
                  f"step {m['time/step_s']:.2f}s rollout {m.get('time/rollout_s', 0):.2f}s "
                  f"train {m.get('time/train_s', 0):.2f}s reward {m['reward/mean']:.3f} "
                  f"tok/fwd {rows[-1]['tokens_per_forward']:.2f}", file=sys.stderr)
    except BaseException:
        trainer.close()
        raise
    late = [r for r in rows if r["epoch"] >= 1] or rows
    mean = lambda k: sum(r[k] for r in late) / len(late)  # noqa: E731
    return {"step_s": mean("step_s"), "phases": {p: mean(p) for p in PHASES},
            "tokens_per_forward": mean("tokens_per_forward"), "reward_mean": mean("reward"),
            "steps_measured": len(late), "per_step": rows}, trainer


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rhymerl bench e2e", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    ap.add_argument("--epochs", type=int, default=2, help="epochs per variant (measured: epoch >= 2)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="runs/bench-e2e")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides applied to both variants")
    args = ap.parse_args(argv)
    if args.epochs < 2:
        ap.error("--epochs must be >= 2: epoch 1 has no history")
    from rhymerl.config import load_config

    from rhymerl.training.process_groups import init_process_groups

    cfg = load_config(args.config, args.overrides)
    groups = init_process_groups(cfg.parallel, 1, 0)
    t0 = time.time()
    # Both trainers stay alive until the end: shutting down the last live vLLM engine tears
    # down the process-wide torch.distributed state the next trainer's Megatron needs.
    trainers = []
    try:
        off, t = _run_variant(cfg, groups, False, args.epochs, Path(args.out) / "off")
        trainers.append(t)
        on, t = _run_variant(cfg, groups, True, args.epochs, Path(args.out) / "on")
        trainers.append(t)
    finally:
        for t in reversed(trainers):
            t.close()
    speedup = off["step_s"] / on["step_s"] if on["step_s"] > 0 else 0.0
    print(f"\n{'phase':<10}{'off (s)':>10}{'on (s)':>10}{'ratio':>8}", file=sys.stderr)
    for p in ("step",) + PHASES:
        a = off["step_s"] if p == "step" else off["phases"][p]
        b = on["step_s"] if p == "step" else on["phases"][p]
        print(f"{p:<10}{a:>10.2f}{b:>10.2f}{(a / b if b > 0 else 0):>8.2f}", file=sys.stderr)
    print(f"tokens/forward on: {on['tokens_per_forward']:.2f}   step-time speedup (epoch >= 2): {speedup:.2f}x   "
          f"({time.time() - t0:.0f} s total)", file=sys.stderr)
    if args.json:
        print(json.dumps({"on": on, "off": off, "speedup": speedup}))
    return 0
