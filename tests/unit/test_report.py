"""`rhymerl report`: figures and page from a run folder's own files."""

from __future__ import annotations

import json
import struct

import pytest

from rhymerl.cli import main as cli_main
from rhymerl.outputs.report import ReportError, load_run, write_report

pytestmark = pytest.mark.cpu


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def _write_run(d, *, with_traces=True, with_spec=True):
    rows = []
    for step in range(6):
        r = {"step": step, "epoch": 1 + step // 2, "reward/mean": 0.2 + 0.1 * step, "reward/accuracy": 0.1 * step,
             "response/len_mean": 100.0 + step, "response/len_max": 300, "time/rollout_s": 20.0 - step,
             "time/train_s": 8.0, "time/reward_s": 0.5, "time/step_s": 29.0 - step,
             "histopipe/bubble_fraction": 0.3 - 0.02 * step}
        if with_spec:
            r.update({"histospec/tokens_per_forward": 1.0 + 0.3 * step, "histospec/acceptance": 0.1 * step})
        rows.append(r)
    rows.append(dict(rows[-1], **{"reward/mean": 0.95}))  # a step re-logged after a resume
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if with_traces:
        tr = [{"prompt_id": f"p{i % 4}", "epoch": 1 + i // 8, "sample_idx": i % 2, "token_ids": list(range(20 + 7 * i))}
              for i in range(24)]
        (d / "traces.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tr))


def test_report_writes_every_figure_and_a_page_that_shows_them(tmp_path):
    _write_run(tmp_path)
    files = write_report(tmp_path, tmp_path / "report")
    names = {f.name for f in files}
    assert names == {"reward.png", "histospec.png", "phases.png", "lengths.png", "bubble.png", "index.html"}
    for f in files:
        if f.suffix == ".png":
            w, h = _png_size(f)
            assert w >= 400 and h >= 200
    page = (tmp_path / "report" / "index.html").read_text()
    for f in files:
        if f.suffix == ".png":
            assert f'src="{f.name}"' in page
    assert "not logged" not in page
    # the re-logged step replaced the first row of that step
    run = load_run(tmp_path)
    assert [r["step"] for r in run.rows] == list(range(6)) and run.rows[-1]["reward/mean"] == 0.95
    assert run.by_epoch("histospec/tokens_per_forward")[0] == [1, 2, 3]


def test_report_says_what_the_run_did_not_log(tmp_path):
    _write_run(tmp_path, with_traces=False, with_spec=False)
    files = write_report(tmp_path, tmp_path / "out")
    assert "histospec.png" not in {f.name for f in files}
    assert "lengths.png" in {f.name for f in files}  # falls back to the per-step length metrics
    assert "not logged by this run" in (tmp_path / "out" / "index.html").read_text()


def test_report_errors_name_the_file_and_line(tmp_path, capsys):
    with pytest.raises(ReportError, match="no metrics.jsonl"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{oops\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl:2"):
        load_run(tmp_path)
    assert cli_main(["report", str(tmp_path / "missing")]) == 3
    assert "no such run folder" in capsys.readouterr().err
