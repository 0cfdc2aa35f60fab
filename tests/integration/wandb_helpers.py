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
