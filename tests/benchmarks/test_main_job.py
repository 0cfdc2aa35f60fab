"""`bench main-job`'s pure parts: per-epoch figures from a run's metrics rows, and the verdict."""

from __future__ import annotations

import json

import pytest

from benchmarks.main_job import format_seed, main, seed_summary, verdict

pytestmark = [pytest.mark.cpu]


def _rows(rewards_by_epoch, tpf_by_epoch, first_epoch=1, history_from=1):
    """Two steps per epoch; the second step of an epoch draws twice the responses and tokens. From the
    epoch at index ``history_from`` on, a tenth of the tokens are accepted drafts from the prompt's history."""
    rows = []
    for i, (rewards, tpf) in enumerate(zip(rewards_by_epoch, tpf_by_epoch)):
        for j, rew in enumerate(rewards):
            gen = 100 * (j + 1)
            rows.append({"step": len(rows), "epoch": first_epoch + i, "reward/mean": rew, "reward/accuracy": rew / 2,
                         "rollout/responses": 8 * (j + 1), "histospec/generated_tokens": gen,
                         "histospec/target_forwards": gen / tpf[j], "histospec/tokens_per_forward": tpf[j],
                         "histospec/source/history/accepted": gen / 10 if i >= history_from else 0,
                         "histospec/history_tokens_per_forward": tpf[j] / 10 if i >= history_from else 0.0,
                         "response/len_mean": 50.0, "time/step_s": 10.0})
    return rows


def test_epoch_figures_weigh_steps_by_their_responses_and_tokens():
    r = seed_summary(_rows([(0.0, 0.3), (0.3, 0.6), (0.6, 0.9)], [(1.0, 2.0), (1.0, 2.0), (2.0, 4.0)]))
    assert r["epochs"] == [1, 2, 3] and r["steps"] == 6 and r["train_s"] == 60.0
    # (0 * 8 + 0.3 * 16) / 24, not the steps' plain mean 0.15
    assert r["reward"] == pytest.approx([0.2, 0.5, 0.8])
    assert r["accuracy"] == pytest.approx([0.1, 0.25, 0.4])
    # 300 tokens over 100 + 100 forwards, not the steps' mean 1.5
    assert r["tokens_per_forward"] == pytest.approx([1.5, 1.5, 3.0])
    # 30 accepted history tokens over 200 forwards; the first epoch has none.
    assert r["history_per_forward"] == pytest.approx([0.0, 0.15, 0.3])
    assert r["reward_rose"] and r["tokens_per_forward_rose"] and r["history_paid"]
    json.dumps(r)


def test_epochs_keep_the_numbers_the_rows_carry():
    r = seed_summary(_rows([(0.5, 0.5), (0.5, 0.5)], [(1.0, 1.0), (1.0, 1.0)], first_epoch=0))
    assert r["epochs"] == [0, 1]
    assert "epoch                     0      1" in format_seed(7, r)


def test_verdict_needs_every_seed():
    up = seed_summary(_rows([(0.1, 0.1), (0.2, 0.2), (0.9, 0.9)], [(1.0, 1.0), (1.5, 1.5), (2.0, 2.0)]))
    flat = seed_summary(_rows([(0.5, 0.5), (0.2, 0.2), (0.5, 0.5)], [(1.0, 1.0), (1.5, 1.5), (2.0, 2.0)]))
    settled_late = seed_summary(_rows([(0.1, 0.1), (0.2, 0.2), (0.9, 0.9)], [(1.0, 1.0), (2.0, 2.0), (1.9, 1.9)]))
    ok, line = verdict({1: dict(up, wall_s=100.0), 2: dict(up, wall_s=120.0)})
    assert ok and line.startswith("verdict: PASS") and "at 2 of 2 seeds" in line and "wall 100-120 s" in line
    ok, line = verdict({1: up, 2: flat})
    assert not ok and "at 1 of 2 seeds" in line
    ok, line = verdict({1: up, 2: settled_late})
    assert not ok and "second at 1 of 2;" in line
    history_late = seed_summary(_rows([(0.1, 0.1), (0.2, 0.2), (0.9, 0.9)], [(1.0, 1.0), (1.5, 1.5), (2.0, 2.0)],
                                      history_from=2))
    ok, line = verdict({1: up, 2: history_late})
    assert not ok and "second epoch at 1 of 2" in line
    assert not verdict({})[0]


def test_main_refuses_a_run_folder_that_would_resume(tmp_path, capsys):
    (tmp_path / "seed-1").mkdir()
    with pytest.raises(SystemExit) as e:
        main(["--seeds", "1,2", "--out", str(tmp_path)])
    assert e.value.code == 2 and "would resume" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--seeds", "1,1", "--out", str(tmp_path / "new")])
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "new"), "run.seed=3"])
