"""Read an offline W&B run back with wandb's own reader (`wandb leet inspect --json`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def wandb_records(run_folder: Path) -> list[dict]:
    """Every record of ``run_folder``'s .wandb transaction log, in order."""
    exe = Path(sys.executable).with_name("wandb")
    out = subprocess.run([str(exe), "leet", "inspect", "--json", str(run_folder)], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def history_by_step(run_folder: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for rec in wandb_records(run_folder):
        if rec.get("type") == "history":
            item = rec["history"]["item"]
            rows.setdefault(int(item["_step"]), {}).update(item)
    return rows


def run_record(run_folder: Path) -> dict:
    return next(r["run"] for r in wandb_records(run_folder) if r.get("type") == "run")


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((Path(run_dir) / "wandb").glob("offline-run-*"))


def wandb_disagreements(run_dir: Path, keys: tuple[str, ...] = ("reward/mean", "train/loss", "epoch")) -> list[str]:
    """How W&B's offline history of the run in ``run_dir`` differs from its metrics.jsonl: a step
    in one and not the other, a step logged twice, or one of ``keys`` with another value (the
    timings of a repeated step may differ; these do not). [] when they agree."""
    metrics = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    by_step = {m["step"]: m for m in metrics}
    problems = []
    if len(by_step) != len(metrics):
        problems.append(f"metrics.jsonl repeats steps: {[m['step'] for m in metrics]}")
    seen: list[int] = []
    for run in offline_runs(run_dir):
        for step, row in sorted(history_by_step(run).items()):
            seen.append(step)
            m = by_step.get(step)
            if m is None:
                problems.append(f"W&B has step {step}, metrics.jsonl does not ({run.name})")
                continue
            for k in keys:
                if k in m and row.get(k) != m[k]:
                    problems.append(f"step {step} {k}: W&B {row.get(k)!r}, metrics.jsonl {m[k]!r}")
    if sorted(seen) != sorted(by_step):
        problems.append(f"W&B steps {sorted(seen)} != metrics.jsonl steps {sorted(by_step)}")
    return problems
