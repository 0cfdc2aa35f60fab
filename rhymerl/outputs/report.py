"""`python -m rhymerl report RUN_DIR`: PNG figures and an ``index.html`` of a run from its own files."""

from __future__ import annotations

import argparse
import html
import io
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from rhymerl.outputs.atomic import atomic_write_bytes, atomic_write_text

# The trainer logs each phase of a step as time/<phase>_s and the whole step as time/step_s.
STEP_TIME = "time/step_s"


class ReportError(ValueError):
    pass


@dataclass
class RunData:
    rows: list[dict]                       # metrics.jsonl, one per step, in step order
    lengths_by_epoch: dict[int, list[int]]  # from traces.jsonl (empty if none)
    run_dir: Path

    def series(self, key: str) -> tuple[list[int], list[float]]:
        xs, ys = [], []
        for r in self.rows:
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                xs.append(int(r["step"]))
                ys.append(float(v))
        return xs, ys

    def by_epoch(self, key: str) -> tuple[list[int], list[float]]:
        """A per-step metric over each epoch, as if the epoch were one step (see ``epoch_figures``)."""
        figures = epoch_figures(self.rows, key)
        epochs = sorted(figures)
        return epochs, [figures[e] for e in epochs]


# Ratio metrics: an epoch's figure is the ratio of the epoch's sums, not the mean of step ratios.
EPOCH_RATIOS = {"histospec/tokens_per_forward": ("histospec/generated_tokens", "histospec/target_forwards"),
                "histospec/history_tokens_per_forward": ("histospec/source/history/accepted",
                                                         "histospec/target_forwards"),
                "histospec/acceptance": ("histospec/draft_accepted", "histospec/draft_proposed")}
# Means over a step's responses: an epoch's mean weighs each step by its responses.
EPOCH_WEIGHTS = {"reward/mean": "rollout/responses", "reward/accuracy": "rollout/responses"}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def epoch_figures(rows: list[dict], key: str) -> dict[int, float]:
    """``key`` per epoch: ratio of sums (EPOCH_RATIOS), response-weighted mean (EPOCH_WEIGHTS), else the mean."""
    by_epoch: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        if _number(r.get(key)) and _number(r.get("epoch")):
            by_epoch[int(r["epoch"])].append(r)
    return {e: _epoch_figure(rs, key) for e, rs in sorted(by_epoch.items())}


def _epoch_figure(rows: list[dict], key: str) -> float:
    num, den = EPOCH_RATIOS.get(key, (None, None))
    if num and all(_number(r.get(num)) and _number(r.get(den)) for r in rows):
        total = sum(float(r[den]) for r in rows)
        if total > 0:
            return sum(float(r[num]) for r in rows) / total
    weight = EPOCH_WEIGHTS.get(key)
    ws = [r.get(weight) for r in rows] if weight else []
    if ws and all(_number(w) for w in ws) and sum(ws) > 0:
        return sum(float(r[key]) * w for r, w in zip(rows, ws)) / sum(ws)
    return sum(float(r[key]) for r in rows) / len(rows)


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}:{i}: not JSON ({e.msg})") from None
        if not isinstance(d, dict):
            raise ReportError(f"{path}:{i}: each line must be a JSON object")
        rows.append(d)
    return rows


def load_run(run_dir: Path) -> RunData:
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run folder")
    mpath = run_dir / "metrics.jsonl"
    if not mpath.is_file():
        raise ReportError(f"{run_dir}: no metrics.jsonl (is this a run's output_dir?)")
    rows = _read_jsonl(mpath)
    for i, r in enumerate(rows, 1):
        if not isinstance(r.get("step"), int):
            raise ReportError(f"{mpath}:{i}: row without an integer 'step'")
    if not rows:
        raise ReportError(f"{mpath}: empty (the run has not finished a step yet)")
    # A resumed run may have re-logged steps; the last row of a step is the one that counted.
    rows = sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])
    lengths: dict[int, list[int]] = defaultdict(list)
    tpath = run_dir / "traces.jsonl"
    if tpath.is_file():
        for i, t in enumerate(_read_jsonl(tpath), 1):
            ids = t.get("token_ids")
            if not isinstance(ids, list) or not isinstance(t.get("epoch"), int):
                raise ReportError(f"{tpath}:{i}: a trace row needs 'epoch' and 'token_ids'")
            lengths[t["epoch"]].append(len(ids))
    return RunData(rows=rows, lengths_by_epoch=dict(lengths), run_dir=run_dir)


# Each figure function draws on a fresh Axes and returns False when the run has no data for it.

def _fig_reward(run: RunData, ax) -> bool:
    drawn = False
    for key, label in (("reward/mean", "mean reward"), ("reward/accuracy", "accuracy")):
        xs, ys = run.series(key)
        if xs:
            ax.plot(xs, ys, marker="o", label=label)
            drawn = True
    if drawn:
        _draw_epoch_means(run, "reward/mean", ax)
    ax.set_xlabel("step")
    ax.set_title("Reward and accuracy per step; mean reward per epoch")
    return drawn


def _draw_epoch_means(run: RunData, key: str, ax) -> None:
    """One bar across each epoch's steps at the epoch's figure (the headline's numbers)."""
    steps: dict[int, list[int]] = defaultdict(list)
    for r in run.rows:
        if _number(r.get("epoch")) and _number(r.get(key)):
            steps[int(r["epoch"])].append(int(r["step"]))
    figures = epoch_figures(run.rows, key)
    for i, e in enumerate(sorted(figures)):
        ax.hlines(figures[e], min(steps[e]) - 0.4, max(steps[e]) + 0.4, colors="black", linewidth=2.5,
                  label="mean reward per epoch" if i == 0 else None)


def _fig_speculation(run: RunData, ax) -> bool:
    ep, tpf = run.by_epoch("histospec/tokens_per_forward")
    ep2, acc = run.by_epoch("histospec/acceptance")
    if not ep and not ep2:
        return False
    if ep:
        ax.plot(ep, tpf, marker="o", color="tab:blue", label="tokens per forward")
        ep3, hist = run.by_epoch("histospec/history_tokens_per_forward")
        if ep3:
            ax.plot(ep3, hist, marker="^", color="tab:green", label="accepted from earlier responses, per forward")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_ylabel("tokens per target forward")
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left")
    if ep2:
        ax2 = ax.twinx()
        ax2.plot(ep2, acc, marker="s", color="tab:orange", label="draft acceptance")
        ax2.set_ylabel("draft acceptance")
        ax2.set_ylim(0, 1)
        ax2.legend(loc="lower right")
    ax.set_xlabel("epoch")
    ax.set_title("HistoSpec per epoch")
    return True


def _fig_phases(run: RunData, ax) -> bool:
    steps = [int(r["step"]) for r in run.rows]
    bottom = [0.0] * len(steps)
    drawn = False
    phases = list(dict.fromkeys(k for r in run.rows for k in r
                                if k.startswith("time/") and k.endswith("_s") and k != STEP_TIME))
    for key in phases:
        vals = [float(r.get(key, 0.0) or 0.0) for r in run.rows]
        if any(vals):
            ax.bar(steps, vals, bottom=bottom, label=key[len("time/"):-len("_s")])
            bottom = [b + v for b, v in zip(bottom, vals)]
            drawn = True
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("Time per phase per step")
    return drawn


def _fig_lengths(run: RunData, ax) -> bool:
    if run.lengths_by_epoch:
        epochs = sorted(run.lengths_by_epoch)
        ax.hist([run.lengths_by_epoch[e] for e in epochs], bins=30, label=[f"epoch {e}" for e in epochs],
                histtype="step", linewidth=1.5)
        ax.set_xlabel("response length (tokens)")
        ax.set_ylabel("responses")
        ax.set_title("Response-length distribution (traces.jsonl)")
        return True
    xs, mean = run.series("response/len_mean")
    if not xs:
        return False
    ax.plot(xs, mean, marker="o", label="mean")
    xs2, mx = run.series("response/len_max")
    if xs2:
        ax.plot(xs2, mx, marker="^", label="max")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens")
    ax.set_title("Response length per step (no traces.jsonl)")
    return True


def _fig_bubble(run: RunData, ax) -> bool:
    keys = sorted({k for r in run.rows for k in r if k.startswith("histopipe/") and "bubble" in k})
    drawn = False
    for key in keys:
        xs, ys = run.series(key)
        if xs:
            ax.plot(xs, ys, marker="o", label=key.split("/", 1)[1])
            drawn = True
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of instance time idle")
    ax.set_title("HistoPipe rollout bubble")
    return drawn


FIGURES: list[tuple[str, str, Callable]] = [
    ("reward.png", "Reward and accuracy", _fig_reward),
    ("histospec.png", "HistoSpec tokens per forward and acceptance", _fig_speculation),
    ("phases.png", "Phase times", _fig_phases), ("lengths.png", "Response lengths", _fig_lengths),
    ("bubble.png", "HistoPipe bubble", _fig_bubble)]


def _render_png(draw: Callable, run: RunData) -> Optional[bytes]:

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        if not draw(run, ax):
            return None
        if ax.get_xlabel() in ("step", "epoch"):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(loc="best")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)


# The headline's figures, per epoch: steps compare prompt draws; every epoch sees all prompts.
HEADLINE = ("reward/mean", "reward/accuracy", "histospec/tokens_per_forward", "histospec/history_tokens_per_forward")


def _direction(first: float, last: float) -> str:
    a, b = float(f"{first:.3g}"), float(f"{last:.3g}")
    return "higher" if b > a else "lower" if b < a else "unchanged"


def epoch_headline(run: RunData, key: str) -> Optional[str]:
    """``key`` first epoch -> last epoch, whether the last is higher, and every epoch's figure."""
    epochs, vals = run.by_epoch(key)
    if not epochs:
        return None
    if len(epochs) == 1:
        return f"{vals[0]:.3g} (epoch {epochs[0]}, the only one)"
    line = (f"{vals[0]:.3g} (epoch {epochs[0]}) -> {vals[-1]:.3g} (epoch {epochs[-1]}), "
            f"{_direction(vals[0], vals[-1])}; per epoch: " + ", ".join(f"{v:.3g}" for v in vals))
    if key == "histospec/tokens_per_forward" and len(epochs) > 2:
        # The first epoch drafts without any history of its prompts.
        line += (f"; from epoch {epochs[1]}, when history joins: {vals[1]:.3g} -> {vals[-1]:.3g}, "
                 f"{_direction(vals[1], vals[-1])}")
    return line + _partial_last_epoch(run)


def _partial_last_epoch(run: RunData) -> str:
    """A note when the last epoch has fewer steps than the fullest (its figure covers only those)."""
    counts: dict[int, int] = defaultdict(int)
    for r in run.rows:
        if _number(r.get("epoch")):
            counts[int(r["epoch"])] += 1
    if not counts:
        return ""
    last, most = max(counts), max(counts.values())
    return f" (epoch {last} so far: {counts[last]} of {most} steps)" if counts[last] < most else ""


def _summary(run: RunData) -> list[tuple[str, str]]:
    first, last = run.rows[0], run.rows[-1]
    out = [("steps", f"{first['step']}..{last['step']} ({len(run.rows)} rows)")]
    for key in HEADLINE:
        line = epoch_headline(run, key)
        if line:
            out.append((f"{key} per epoch", line))
    _, step_s = run.series(STEP_TIME)
    if step_s:
        out.append(("training time", f"{sum(step_s):.0f} s over {len(step_s)} steps (sum of {STEP_TIME})"))
    if run.lengths_by_epoch:
        n = sum(len(v) for v in run.lengths_by_epoch.values())
        out.append(("responses in traces.jsonl", str(n)))
    return out


def write_report(run_dir: Path, out_dir: Path) -> list[Path]:
    run = load_run(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written, sections = [], []
    for name, title, draw in FIGURES:
        png = _render_png(draw, run)
        if png is None:
            sections.append(f"<h2>{html.escape(title)}</h2><p class=missing>not logged by this run</p>")
            continue
        atomic_write_bytes(out_dir / name, png)
        written.append(out_dir / name)
        sections.append(f"<h2>{html.escape(title)}</h2><img src=\"{name}\" alt=\"{html.escape(title)}\">")
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in _summary(run))
    page = (
        "<!doctype html><html><head><meta charset=utf-8>"
        f"<title>RhymeRL run {html.escape(run_dir.name)}</title>"
        "<style>body{font-family:sans-serif;margin:2em;max-width:60em}img{max-width:100%;border:1px solid #ddd}"
        "th{text-align:left;padding-right:1em}.missing{color:#888}</style></head><body>"
        f"<h1>RhymeRL run: {html.escape(str(run_dir))}</h1><table>{rows}</table>"
        + "".join(sections) + "</body></html>\n")
    atomic_write_text(out_dir / "index.html", page)
    written.append(out_dir / "index.html")
    return written


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rhymerl report", description="Write PNG figures and an HTML page of a run.")
    p.add_argument("run_dir", help="a run's output_dir (holds metrics.jsonl)")
    p.add_argument("--out", help="output folder (default: RUN_DIR/report)")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "report"
    try:
        files = write_report(run_dir, out)
    except ReportError as e:
        print(f"rhymerl report: {e}", file=sys.stderr)
        return 3
    for f in files:
        print(f)
    return 0
