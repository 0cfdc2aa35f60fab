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


def _headline(page: str) -> dict:
    import re

    return dict(re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", page.split("<h2>")[0]))


def test_headline_compares_epochs_not_steps_and_says_which_way(tmp_path):
    _write_run(tmp_path)  # 3 epochs of 2 steps; every figure rises step by step
    write_report(tmp_path, tmp_path / "out")
    head = _headline((tmp_path / "out" / "index.html").read_text())
    # epoch means of the steps (0.2, 0.3), (0.4, 0.5), (0.6, 0.95: the re-logged step)
    assert head["reward/mean per epoch"] == ("0.25 (epoch 1) -&gt; 0.775 (epoch 3), higher; per epoch: 0.25, 0.45, 0.775")
    assert head["histospec/tokens_per_forward per epoch"].endswith("from epoch 2, when history joins: 1.75 -&gt; 2.35, higher")
    assert head["training time"] == "159 s over 6 steps (sum of time/step_s)"
    assert "first step" not in str(head)
    # A falling reward says so; a last epoch still under way is marked as such.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][:5]
    for r in rows:
        r["reward/mean"] = 1.0 - 0.1 * r["step"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_report(tmp_path, tmp_path / "out")
    head = _headline((tmp_path / "out" / "index.html").read_text())
    assert head["reward/mean per epoch"] == ("0.95 (epoch 1) -&gt; 0.6 (epoch 3), lower; per epoch: 0.95, 0.75, 0.6 "
                                             "(epoch 3 so far: 1 of 2 steps)")


def test_epoch_figures_are_ratios_of_the_epoch_sums():
    from rhymerl.outputs.report import epoch_figures

    rows = [{"step": 0, "epoch": 1, "histospec/tokens_per_forward": 1.0, "histospec/generated_tokens": 10,
             "histospec/target_forwards": 10, "reward/mean": 0.0, "rollout/responses": 4},
            {"step": 1, "epoch": 1, "histospec/tokens_per_forward": 3.0, "histospec/generated_tokens": 90,
             "histospec/target_forwards": 30, "reward/mean": 1.0, "rollout/responses": 12}]
    assert epoch_figures(rows, "histospec/tokens_per_forward") == {1: 100 / 40}
    assert epoch_figures(rows, "reward/mean") == {1: 0.75}
    assert epoch_figures([dict(r, **{"rollout/responses": None}) for r in rows], "reward/mean") == {1: 0.5}
