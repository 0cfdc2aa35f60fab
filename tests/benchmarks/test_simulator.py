import json

import pytest

from benchmarks.simulate.simulator import SCHEDULERS, main
from rhymerl.outputs.traces import TraceRecord, write_trace

pytestmark = pytest.mark.cpu


def _results(capsys, argv):
    assert main(argv) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert set(data) <= {"results", "calibration", "projection"} and data["calibration"]
    return data["results"], err


def test_json_contract_and_gpu_list(capsys):
    res, err = _results(capsys, ["--gpus", "16,32", "--gpus", "64", "--tp", "4", "--trace", "synthetic", "--json",
                                 "--prompts-per-instance", "4", "--no-projection"])
    assert [r["gpus"] for r in res] == [16] * 5 + [32] * 5 + [64] * 5
    for r in res:
        assert set(r) == {"gpus", "scheduler", "makespan_s", "bubble_fraction", "ratio_to_oracle", "shuffled"}
        assert r["scheduler"] in SCHEDULERS and r["makespan_s"] > 0 and 0 <= r["bubble_fraction"] < 1
    assert all(r["ratio_to_oracle"] == 1.0 for r in res if r["scheduler"] == "oracle")
    assert "makespan_s" in err and "calibration: " in err  # tables go to stderr


def test_projection_rows_are_labelled_with_their_calibration(capsys):
    assert main(["--gpus", "16", "--json", "--prompts-per-instance", "4", "--shuffle"]) == 0
    out, err = capsys.readouterr()
    proj = json.loads(out)["projection"]
    assert "not a measurement" in proj["label"] and proj["calibration"] and proj["speculation"]
    rows = {r["config"]: r for r in proj["rows"]}
    assert len(rows) == 5 and rows["no speculation + least-loaded"]["speedup_vs_least_loaded"] == 1.0
    # Speculation emits more than one token per forward: it must shorten the rollout.
    assert rows["HistoSpec + HistoPipe"]["makespan_s"] < rows["HistoPipe only"]["makespan_s"]
    assert "PROJECTION" in err


def test_trace_file_input(tmp_path, capsys):
    recs = []
    for epoch in range(3):
        for p in range(6):
            for s in range(4):
                L = 50 * (p + 1) + 7 * s + 3 * epoch
                recs.append(TraceRecord(prompt_id=f"q{p}", epoch=epoch, sample_idx=s, token_ids=[1] * L,
                                        prompt_token_ids=[2] * (10 + p)))
    path = tmp_path / "trace.jsonl"
    write_trace(path, recs)
    assert main(["--gpus", "8", "--tp", "2", "--trace", str(path), "--json", "--prompts-per-instance", "3"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert {r["scheduler"] for r in data["results"]} == set(SCHEDULERS)
    assert "tiled" in err  # 6 prompts tiled up to 4 instances x 3
    # The projection's speculation is HistoSpec replayed on this trace, not the shipped profile.
    assert "HistoSpec replay of trace.jsonl" in data["projection"]["speculation"]
    one = tmp_path / "one.jsonl"
    write_trace(one, [r for r in recs if r.epoch == 0])
    assert main(["--gpus", "8", "--tp", "2", "--trace", str(one), "--json", "--prompts-per-instance", "3"]) == 0
    out, err = capsys.readouterr()
    assert "has one epoch" in err and "projection" not in json.loads(out)


def test_user_errors(tmp_path, capsys):
    assert main(["--gpus", "10", "--tp", "4"]) == 2
    assert "multiple of --tp" in capsys.readouterr().err
    assert main(["--gpus", "8", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["--gpus", "8", "--schedulers", "fifo"]) == 2
    with pytest.raises(SystemExit):
        main(["--gpus", "x"])


def test_wired_into_the_cli():
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    out = subprocess.run([sys.executable, "-m", "benchmarks", "simulate", "--gpus", "8", "--tp", "2", "--json",
                          "--prompts-per-instance", "2", "--genie"], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["results"]) == 5
    assert "true group means" in out.stderr and "longest true group mean first" in out.stderr and "longer than 1.5x their group's mean" in out.stderr


def test_outlier_genie_told_every_length_schedules_like_longest_first():
    import dataclasses

    from rhymerl.config import HistoPipeConfig
    from rhymerl.histopipe import calibration
    from benchmarks.simulate.event_loop import simulate
    from rhymerl.histopipe.scheduler import PriorityPolicy
    from benchmarks.simulate.simulator import histopipe_policy, outlier_genie, trained_predictor
    from benchmarks.simulate.workload import synthetic

    cost, _, _ = calibration.load(None)
    w = synthetic(24, n=4, seed=3)
    cfg = HistoPipeConfig()
    pr = trained_predictor(w, cfg)
    args = (cost, 3, w.lengths, w.prompt_lens(), w.group_of())

    def without_migration(pol):
        pol.migrate = False
        return pol

    told_all = without_migration(outlier_genie(w, cost, cfg, pr, factor=0.0))
    assert len(told_all.known) == w.num_requests
    by_length = simulate(*args, PriorityPolicy(w.lengths.tolist()))
    assert simulate(*args, told_all).makespan_s == pytest.approx(by_length.makespan_s)
    told_none = without_migration(outlier_genie(w, cost, cfg, pr, factor=1e9))
    assert not told_none.known
    plain = without_migration(histopipe_policy(w, cost, cfg, pr))
    assert simulate(*args, told_none).makespan_s == pytest.approx(simulate(*args, plain).makespan_s)
