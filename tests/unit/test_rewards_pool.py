"""RewardPool with real worker processes (spawn) and the real scorers."""

import os
import time

import pytest

from rhymerl.config import ConfigError, RewardConfig, load_config
from rhymerl.rewards import RewardItem, RewardPool, RewardResult
from rhymerl.rewards.pool import RewardErrorRate, RewardSetupError, check_error_rate, load_function

pytestmark = pytest.mark.cpu


# Module-level so they pickle by reference into spawned workers.
def loop_forever(item):
    while True:
        pass


def sleepy(item):
    time.sleep(float(item.answer))
    return 1.0


def broken(item):
    raise ZeroDivisionError("scorer bug")


def hard_exit(item):
    os._exit(3)


def length_reward(item):
    """A user reward (reward.function): loops on "loop", otherwise rewards short answers."""
    if item.answer == "loop":
        while True:
            pass
    return RewardResult(score=1.0 / len(item.response_text), correct=item.response_text == item.answer)


SCORERS = {"loop": loop_forever, "sleep": sleepy, "broken": broken, "exit": hard_exit}


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child not yet reaped is a zombie: count it as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def pool():
    p = RewardPool(RewardConfig(workers=2, timeout_s=1.0), scorers=SCORERS)
    p.wait_ready()
    yield p
    p.close()


def _math(resp, gold):
    return RewardItem(resp, gold, kind="math_verify")


def test_pool_scores_real_items_in_order(pool):
    items = [_math(r"\boxed{0.5}", "1/2"), _math(r"\boxed{3}", "4"),
             RewardItem("<answer>-129</answer>", "-129", metadata={"source_dataset": "basic_arithmetic"})]
    res = pool.score(items * 3)
    assert [r.score for r in res] == [1.0, 0.0, 1.0] * 3
    assert all(r.error is None and not r.timed_out for r in res)


def test_timeout_kills_stuck_worker_and_pool_keeps_working(pool):
    before = list(pool.worker_pids)
    res = pool.score([RewardItem("x", "0", kind="loop"), _math(r"\boxed{2}", "2")])
    assert res[0].timed_out and res[0].score == 0.0
    assert res[1].score == 1.0 and not res[1].timed_out
    killed = pool.stats["killed_pids"][-1]
    assert killed in before and killed not in pool.worker_pids
    assert not _alive(killed)
    again = pool.score([_math(r"\boxed{2}", "2"), RewardItem("y", "0.05", kind="sleep")] * 2)
    assert [r.score for r in again] == [1.0, 1.0, 1.0, 1.0]
    assert pool.stats["timeouts"] >= 1 and pool.stats["restarts"] >= 1


def test_exceptions_and_dead_workers_score_zero_and_are_counted(pool):
    errors = pool.stats["errors"]
    res = pool.score([RewardItem("x", "1", kind="broken"), RewardItem("x", "1", kind="exit"),
                      RewardItem("x", "1", kind="nonexistent"), _math(r"\boxed{1}", "1")])
    assert [r.score for r in res] == [0.0, 0.0, 0.0, 1.0]
    assert "ZeroDivisionError: scorer bug" in res[0].error
    assert "died" in res[1].error and "exit code 3" in res[1].error
    assert "no reward scorer named 'nonexistent'" in res[2].error
    assert pool.stats["errors"] == errors + 3
    assert pool.score([_math(r"\boxed{5}", "5")])[0].score == 1.0


def test_in_process_pool_contains_exceptions():
    p = RewardPool(RewardConfig(workers=0), scorers=SCORERS)
    res = p.score([RewardItem("x", "1", kind="broken"), _math(r"\boxed{\frac{2}{4}}", "0.5")])
    assert res[0].score == 0.0 and res[0].error and res[1].score == 1.0
    assert p.stats["errors"] == 1
    p.close()


def test_single_worker_requeues_the_rest_of_a_timed_out_chunk():
    with RewardPool(RewardConfig(workers=1, timeout_s=0.5), scorers=SCORERS) as p:
        p.wait_ready()
        res = p.score([RewardItem("x", "0", kind="loop"), _math(r"\boxed{2}", "2"), _math(r"\boxed{3}", "2")])
        assert [(r.score, r.timed_out) for r in res] == [(0.0, True), (1.0, False), (0.0, False)]
        assert p.stats["restarts"] == 1 and len(p.worker_pids) == 1


def test_scorer_module_that_cannot_import_aborts_at_start():
    # A broken verifier install used to be swallowed: every item then scored 0.
    with RewardPool(RewardConfig(workers=1), preload=("math_verify", "no_such_verifier_module")) as p:
        with pytest.raises(RewardSetupError, match="cannot import 'no_such_verifier_module'"):
            p.wait_ready()
    with pytest.raises(RewardSetupError, match="no_such_verifier_module"):
        RewardPool(RewardConfig(workers=0), preload=("no_such_verifier_module",))


def test_step_error_rate_above_threshold_aborts():
    ok, bad = RewardResult(score=1.0), RewardResult(error="ZeroDivisionError: scorer bug")
    check_error_rate([ok, ok, bad], 0.5)
    check_error_rate([bad, bad], 1.0)
    with pytest.raises(RewardErrorRate, match=r"2 of 3 .*max_error_rate=0.5.*ZeroDivisionError"):
        check_error_rate([ok, bad, bad], 0.5)


def test_user_reward_function_runs_in_the_timeout_guarded_pool():
    cfg = RewardConfig(workers=1, timeout_s=0.5, function=f"{__name__}:length_reward")
    with RewardPool(cfg) as p:
        res = p.score([RewardItem("ab", "ab"), RewardItem("abcd", "loop"), RewardItem("abcd", "x")])
    assert (res[0].score, res[0].correct) == (0.5, True)
    assert res[1].timed_out and res[1].score == 0.0
    assert (res[2].score, res[2].correct, res[2].error) == (0.25, False, None)


def test_user_reward_function_errors_are_clear():
    with pytest.raises(RewardSetupError, match="cannot import 'no_such_pkg.rewards'.*No module named 'no_such_pkg'"):
        load_function("no_such_pkg.rewards:score")
    with pytest.raises(RewardSetupError, match="has no attribute 'nope'"):
        load_function(f"{__name__}:nope")
    with pytest.raises(ConfigError, match="reward.function"):
        load_config(None, ["reward.function=just_a_module"])
    with pytest.raises(ConfigError, match="reward.kind"):
        load_config(None, ["reward.function=m:f", "reward.kind=exact"])


def announce_and_sleep(item):
    """Says it has started (a file named by the item's answer), then takes its time."""
    open(item.answer, "w").close()
    time.sleep(3.0)
    return 1.0


def test_a_worker_killed_from_outside_is_replaced_logged_and_counted(tmp_path, caplog):
    import logging
    import signal
    import threading

    marks = [tmp_path / "a", tmp_path / "b"]
    with RewardPool(RewardConfig(workers=2, timeout_s=60.0), scorers={"announce": announce_and_sleep}) as pool:
        pool.wait_ready()
        victim = pool.worker_pids[0]
        out: dict = {}
        items = [RewardItem("y", str(m), kind="announce") for m in marks]
        scoring = threading.Thread(target=lambda: out.update(res=pool.score(items)))
        with caplog.at_level(logging.WARNING, logger="rhymerl.rewards"):
            scoring.start()
            deadline = time.monotonic() + 60
            while not all(m.exists() for m in marks) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(victim, signal.SIGKILL)  # mid-item: each worker is inside its scorer
            scoring.join(60)
        assert sorted(r.score for r in out["res"]) == [0.0, 1.0]
        lines = [r.getMessage() for r in caplog.records if r.name == "rhymerl.rewards"]
        assert len(lines) == 1 and f"reward worker pid {victim} died (killed by SIGKILL) while scoring" in lines[0], lines
        assert f"started a replacement (pid {pool.worker_pids[0]}" in lines[0]
        assert pool.last_restarts == 1 and victim not in pool.worker_pids
