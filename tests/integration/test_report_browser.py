"""`rhymerl report`'s page in a real browser: a short real run, its report, opened in headless
Chromium; every figure must decode, and the page must not screenshot blank.

Chromium comes from Debian's `chromium` package, which `.ci/run` installs. Where it is missing
the test skips and says how to install it, except under CI (CI=true), where it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from browser_helpers import find_chromium, load_and_inspect

pytestmark = [pytest.mark.cpu, pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# The main job's config on the tiny built-in model, shrunk to two epochs of two steps, so the
# run logs every figure the report draws (history drafts included) in seconds of decoding.
QUICK_RUN = ["model.path=builtin:tiny", "run.epochs=2", "data.size=4", "data.prompts_per_step=2", "rollout.n=2",
             "rollout.max_tokens=16", "reward.workers=1", "tracking.wandb=disabled", "checkpoint.every_steps=0"]


def _chromium() -> str:
    path = find_chromium()
    if path:
        return path
    why = "chromium is not installed (Debian: apt-get install -y chromium; .ci/run installs it)"
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)


def _run_cli(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    res = subprocess.run([sys.executable, "-m", "rhymerl", *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, f"rhymerl {args[0]} failed (rc={res.returncode}):\n{res.stderr[-6000:]}"
    return res


def _screenshot_shows_a_page(path: Path) -> tuple[float, int]:
    """The fraction of the screenshot's pixels that are not the background, and its colours."""
    from PIL import Image

    with Image.open(path) as im:
        px = im.convert("RGB")
        colours = px.getcolors(maxcolors=1 << 20) or []
        background = max(colours)[1] if colours else (255, 255, 255)
        drawn = sum(n for n, c in colours if c != background)
        return drawn / (px.width * px.height), len(colours)


def test_report_page_renders_every_figure_in_chromium(tmp_path):
    chromium = _chromium()
    run = tmp_path / "run"
    _run_cli("train", str(REPO / "configs" / "tiny-cpu.yaml"), f"run.output_dir={run}", *QUICK_RUN, timeout=600)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and (run / "traces.jsonl").stat().st_size > 0
    report = tmp_path / "report"
    _run_cli("report", str(run), "--out", str(report), timeout=300)
    page = report / "index.html"
    html = page.read_text()
    assert "not logged by this run" not in html, "the run logged no data for a figure"
    assert "per epoch" in html and "(first step)" not in html

    shot = tmp_path / "page.png"
    images = load_and_inspect(chromium, page, shot, width=1200, height=900)
    pngs = sorted(p.name for p in report.glob("*.png"))
    assert sorted(i["src"] for i in images) == pngs and len(pngs) == 5, (images, pngs)
    for img in images:
        assert img["complete"] and img["width"] > 0 and img["height"] > 0, f"{img['src']} did not decode: {img}"
    drawn, colours = _screenshot_shows_a_page(shot)
    assert drawn > 0.05 and colours > 50, f"the screenshot looks blank: {drawn:.1%} drawn, {colours} colours"
