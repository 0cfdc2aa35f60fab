"""The GPU node smoke check without a GPU: each check of tests/gpu/node_checks.py on inputs that
must pass and inputs that must fail, the checks read from an OUT folder as node_smoke.sh leaves
it, and `node_smoke.sh --dry-run` end to end (config written and checked, commands and checks
printed, nothing started)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[2]
SHARE = 25.5  # GB: gpu_memory_utilization 0.3 of an 85 GB device


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nc = _load("node_checks")
node_plan = _load("node_plan")


# --------------------------------------------------------------------------- inputs


def rank_report(r: int, steps: int = 3, **over) -> dict:
    """What tests/gpu/audited_rank.py writes for a healthy rank ``r`` of a run of ``steps`` steps."""
    events = [{"e": "trainer.offload", "s": 0.1, "freed_gb": 0.31},
              {"e": "engine.build", "s": 40.0, "freed_gb": -25.3, "current_device": r},
              {"e": "engine.sleep", "s": 0.5, "freed_gb": 23.4}]
    for _ in range(steps):
        events += [{"e": "engine.wake_up:weights", "s": 0.1, "freed_gb": -0.27},
                   {"e": "engine.load_weights", "s": 0.2, "freed_gb": 0.0},
                   {"e": "engine.wake_up:kv_cache", "s": 0.3, "freed_gb": -22.8},
                   {"e": "engine.sleep", "s": 0.5, "freed_gb": 23.1},
                   {"e": "trainer.onload", "s": 0.1, "freed_gb": -0.5},
                   {"e": "trainer.offload", "s": 0.1, "freed_gb": 0.5}]
    report = {"rank": r, "local_rank": r, "world_size": 2, "host": "node1", "bound": f"cuda:{r}", "uuid": f"GPU-{r}",
              "current_at_end": r, "total_gb": 85.0, "engine_share_gb": SHARE, "events": events,
              "rollouts": [{"engine_steps": 60 + 7 * r + s, "tokens": 200 + 30 * r + s} for s in range(steps)],
              "collectives": {"nccl": 900, "gloo": 40},
              "audit": {"checked": {"all_reduce/own": 20, "all_gather/library": 900}, "bridged": 0},
              "rc": 0, "error": None}
    report.update(over)
    return report


def runs(world: int = 2) -> dict[str, list[dict]]:
    return {"run 1": [rank_report(r) for r in range(world)], "run 2": [rank_report(r, steps=1) for r in range(world)]}


def row(step: int, **over) -> dict:
    first = step == 0
    r = {"step": step,
         "colocation/trainer_offload_calls": 2 if first else 1, "colocation/engine_sleep_calls": 2 if first else 1,
         "colocation/engine_sleep_freed_gb": 46.5 if first else 23.1, "colocation/engine_wake_weights_calls": 1,
         "colocation/engine_wake_weights_freed_gb": -0.27, "colocation/engine_wake_kv_calls": 1,
         "colocation/engine_wake_kv_freed_gb": -22.8,
         "histospec/tokens_per_forward": 1.05 if first else 1.6, "histospec/draft_accepted": 12.0 if first else 400.0,
         "histopipe/bubble_fraction": 0.2, "histopipe/moves": 3,
         "train/logprob_max_abs": 0.6, "train/logprob_mean_abs": 0.012, "train/logprob_tokens": 3000.0,
         "train/loss": 0.013, "train/grad_norm": 0.8, "time/step_s": 20.0 if first else 9.0}
    r.update(over)
    return r


def rows(n: int = 4) -> list[dict]:
    return [row(s) for s in range(n)]


def live_log(steps) -> str:
    return "".join(f"2026-01-01 rhymerl.histopipe.live INFO histopipe live step {s}: makespan 3.1 s\n"
                   for s in steps)


RESUMED = "2026-01-01 rhymerl WARNING resumed from /scratch/out/run/checkpoints/step-000003 at step 3\n"


# --------------------------------------------------------------------------- each check


def test_runs_pass_only_when_both_exit_zero():
    assert nc.check_runs({"run 1": 0, "run 2": 0})[0]
    ok, detail = nc.check_runs({"run 1": 124, "run 2": None})
    assert not ok and "timed out" in detail and "run1.log" in detail and "run 2 never ran" in detail


def test_devices_distinct_gpus_pass():
    ok, detail = nc.check_devices(runs(), 2)
    assert ok, detail
    assert "cuda:0, cuda:1" in detail


def test_devices_two_ranks_on_one_gpu_fail():
    bad = runs()
    bad["run 1"][1]["uuid"] = "GPU-0"
    ok, detail = nc.check_devices(bad, 2)
    assert not ok and "ranks 0 and 1 share GPU GPU-0" in detail


def test_devices_every_engine_on_gpu_0_fails():
    bad = runs()
    for r in bad["run 2"]:
        r["events"][1]["current_device"] = 0
    ok, detail = nc.check_devices(bad, 2)
    assert not ok and "run 2: rank 1's engine build left cuda:0 current" in detail


def test_devices_device_changed_by_the_end_fails():
    bad = runs()
    bad["run 1"][1]["current_at_end"] = 0
    ok, detail = nc.check_devices(bad, 2)
    assert not ok and "rank 1 ended on cuda:0" in detail


def test_devices_missing_rank_fails():
    bad = runs()
    bad["run 2"] = bad["run 2"][:1]
    ok, detail = nc.check_devices(bad, 2)
    assert not ok and "run 2: no report from rank(s) 1" in detail


def test_engine_memory_taken_from_own_gpu():
    assert nc.check_engine_memory(runs())[0]
    bad = runs()
    bad["run 1"][1]["events"][1]["freed_gb"] = -0.4  # the engine's memory went elsewhere
    ok, detail = nc.check_engine_memory(bad)
    assert not ok and "rank 1's engine build took 0.40 GB" in detail


def test_collectives_pass_and_report_backends():
    ok, detail = nc.check_collectives(runs())
    assert ok and "nccl 3600" in detail and "gloo 160" in detail


def test_collectives_device_error_fails():
    bad = runs()
    bad["run 1"][0]["error"] = ("CollectiveDeviceError: torch.distributed.all_reduce(tensor=...) from x.py:3 f "
                                "(rhymerl.x): tensor on cpu, but the group's nccl backend takes cuda:0")
    ok, detail = nc.check_collectives(bad)
    assert not ok and "tensor on cpu" in detail


def test_collectives_device_error_in_the_logs_fails():
    log = "rank 3: rhymerl.distributed.collective_audit.CollectiveDeviceError: torch.distributed.broadcast(tensor=...) ...\n"
    ok, detail = nc.check_collectives(runs(), "step 0 ok\n" + log)
    assert not ok and detail.startswith("logged: rank 3") and "broadcast" in detail


def test_collectives_without_nccl_fail():
    bad = runs()
    bad["run 1"][1]["collectives"] = {"gloo": 30}
    ok, detail = nc.check_collectives(bad)
    assert not ok and "no NCCL tensor collective" in detail


def test_offload_before_build_pass():
    ok, detail = nc.check_offload_before_build(runs(), row(0))
    assert ok and "freed 0.310 GB" in detail


def test_training_state_resident_at_engine_build_fails():
    bad = runs()
    events = bad["run 1"][0]["events"]
    events.insert(1, {"e": "trainer.onload", "s": 0.1, "freed_gb": -0.3})
    ok, detail = nc.check_offload_before_build(bad, row(0))
    assert not ok and "training state was resident at the engine build" in detail


def test_offload_that_frees_nothing_fails():
    bad = runs()
    bad["run 2"][1]["events"][0]["freed_gb"] = 0.0
    ok, detail = nc.check_offload_before_build(bad, row(0))
    assert not ok and "freed 0.000 GB" in detail


def test_engine_not_asleep_after_build_fails():
    bad = runs()
    del bad["run 1"][0]["events"][2]
    ok, detail = nc.check_offload_before_build(bad, row(0))
    assert not ok and "did not sleep right after its build" in detail


def test_step_0_without_the_extra_offload_fails():
    ok, detail = nc.check_offload_before_build(runs(), row(0, **{"colocation/trainer_offload_calls": 1}))
    assert not ok and "step 0 logged 1 trainer offload" in detail


def test_sleep_wake_pass():
    ok, detail = nc.check_sleep_wake(rows(), SHARE, runs())
    assert ok and "sleep freed 23.10-23.25 GB" in detail and "wake took 23.07 GB" in detail


def test_sleep_that_frees_little_fails():
    ok, detail = nc.check_sleep_wake([row(0), row(1, **{"colocation/engine_sleep_freed_gb": 2.0})], SHARE, runs())
    assert not ok and "step 1: a sleep freed 2.00 GB" in detail


def test_wake_that_takes_little_fails():
    ok, detail = nc.check_sleep_wake([row(0, **{"colocation/engine_wake_kv_freed_gb": -1.0})], SHARE, runs())
    assert not ok and "step 0: a wake took back 1.27 GB" in detail


def test_engine_never_asleep_fails():
    ok, detail = nc.check_sleep_wake([row(0, **{"colocation/engine_sleep_calls": 0})], SHARE, runs())
    assert not ok and "stayed resident" in detail


def test_sleep_of_another_rank_that_frees_little_fails():
    bad = runs()
    bad["run 2"][1]["events"][-3]["freed_gb"] = 0.3  # its last sleep
    ok, detail = nc.check_sleep_wake(rows(), SHARE, bad)
    assert not ok and "run 2: rank 1: engine.sleep moved 0.30 GB of its cuda:1" in detail


def test_histospec_from_the_second_step():
    # The first step has no history yet: it is not held to drafting.
    ok, detail = nc.check_histospec([row(0, **{"histospec/tokens_per_forward": 1.0,
                                               "histospec/draft_accepted": 0.0}), *rows()[1:]])
    assert ok and "tokens per forward 1.60" in detail
    ok, detail = nc.check_histospec([*rows()[:3], row(3, **{"histospec/tokens_per_forward": 1.0,
                                                            "histospec/draft_accepted": 0.0})])
    assert not ok and "step 3: tokens per forward 1.00" in detail


def test_histopipe_live_pass():
    ok, detail = nc.check_histopipe_live(rows(), runs(), live_log(range(4)), 2)
    assert ok, detail
    assert "2 instances" in detail and "12 moves" in detail


def test_histopipe_step_without_live_dispatch_fails():
    ok, detail = nc.check_histopipe_live(rows(), runs(), live_log([0, 1, 3]), 2)
    assert not ok and "step 2: no 'histopipe live step' line" in detail


def test_histopipe_lock_step_instances_fail():
    bad = runs()
    for ranks in bad.values():
        for r in ranks:
            for k, x in enumerate(r["rollouts"]):
                x["engine_steps"] = 80 + k  # the same on every instance, whatever its tokens
    ok, detail = nc.check_histopipe_live(rows(), bad, live_log(range(4)), 2)
    assert not ok and "lock-step" in detail


def test_histopipe_equal_steps_for_equal_work_pass():
    same = runs()
    for ranks in same.values():
        for r in ranks:
            r["rollouts"] = [{"engine_steps": 128, "tokens": 512} for _ in r["rollouts"]]
    assert nc.check_histopipe_live(rows(), same, live_log(range(4)), 2)[0]


def test_histopipe_idle_instance_fails():
    bad = runs()
    for x in bad["run 1"][1]["rollouts"]:
        x["engine_steps"] = 0
    ok, detail = nc.check_histopipe_live(rows(), bad, live_log(range(4)), 2)
    assert not ok and "fewer than two instances ran" in detail


def test_histopipe_needs_bubble_and_two_gpus():
    ok, detail = nc.check_histopipe_live([row(0, **{"histopipe/bubble_fraction": float("nan")})], runs(),
                                         live_log([0]), 2)
    assert not ok and "bubble_fraction" in detail
    assert not nc.check_histopipe_live(rows(), runs(1), live_log(range(4)), 1)[0]


def test_logprob_agreement():
    ok, detail = nc.check_logprobs(rows())
    assert ok and "max |diff| 0.600" in detail
    for bad in ({"train/logprob_max_abs": 2.5}, {"train/logprob_mean_abs": 0.3},
                {"train/logprob_max_abs": float("nan")}, {"train/logprob_tokens": 0.0}):
        ok, detail = nc.check_logprobs([row(0), row(1, **bad)])
        assert not ok and "step 1" in detail, bad


def test_loss_finite():
    assert nc.check_loss(rows())[0]
    ok, detail = nc.check_loss([row(0), row(1, **{"train/loss": float("inf")})])
    assert not ok and "step 1: train/loss is inf" in detail


def test_resume_from_step_3_pass():
    final = rows()
    ok, detail = nc.check_resume(final[:3], final, RESUMED, [2, 3])
    assert ok and "resumed from step-000003 at step 3" in detail


def test_resume_from_step_2_pass():
    run1 = rows(3)
    final = [*run1[:2], row(2, **{"time/step_s": 8.5}), row(3)]
    log = RESUMED.replace("step-000003 at step 3", "step-000002 at step 2")
    assert nc.check_resume(run1, final, log, [2, 3])[0]


def test_resumed_run_that_restarted_at_step_0_fails():
    run1 = rows(3)
    # A fresh start moves run 1's rows aside and logs steps 0-3 again, with no "resumed from".
    rerun = [row(s, **{"time/step_s": 7.0}) for s in range(4)]
    ok, detail = nc.check_resume(run1, rerun, "2026-01-01 rhymerl INFO finished in 60 s\n", [2, 3])
    assert not ok and "did not resume" in detail
    # Even with the line, rows of the steps before the resume point must be run 1's.
    ok, detail = nc.check_resume(run1, rerun, RESUMED, [2, 3])
    assert not ok and "ran them again" in detail


def test_resume_needs_checkpoints_and_one_row_per_step():
    final = rows()
    ok, detail = nc.check_resume(final[:3], final, RESUMED, [3])
    assert not ok and "expected 2 and 3" in detail
    ok, detail = nc.check_resume(final[:3], [*final, row(3)], RESUMED, [2, 3])
    assert not ok and "once each" in detail


def test_step_time():
    ok, detail = nc.check_step_time(rows(), runs())
    assert ok and "first 20.0 s" in detail and "engine start-up 40 s" in detail
    ok, detail = nc.check_step_time([row(0), row(1, **{"time/step_s": 400.0})], runs())
    assert not ok and "step 1 took 400.0 s" in detail


# --------------------------------------------------------------------------- an OUT folder


def write_out(out: Path, world: int = 2) -> Path:
    """An OUT folder as node_smoke.sh leaves it after a healthy run."""
    (out / "run").mkdir(parents=True)
    (out / "node-smoke.yaml").write_text(f"parallel:\n  world_size: {world}\n")
    final = rows()
    (out / "metrics-run1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in final[:3]))
    (out / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in final))
    for tag, ranks in (("run1", runs(world)["run 1"]), ("run2", runs(world)["run 2"])):
        (out / f"ranks-{tag}").mkdir()
        for r in ranks:
            (out / f"ranks-{tag}" / f"rank{r['rank']}.json").write_text(json.dumps(r))
        (out / f"{tag}.rc").write_text("0\n")
    (out / "run1.log").write_text(live_log(range(3)))
    (out / "run2.log").write_text(RESUMED + live_log([3]))
    (out / "checkpoints-run1.txt").write_text("latest\nstep-000002\nstep-000003\n")
    return out


def test_evaluate_a_healthy_out_folder_passes(tmp_path, capsys):
    out = write_out(tmp_path / "out")
    results = nc.evaluate(out)
    assert [name for name, _, _ in results] == list(nc.CHECKS)
    assert all(ok for _, ok, _ in results), nc.report(results)
    assert nc.main([str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(nc.CHECKS) + 1 and printed[-1] == f"VERDICT: PASS ({len(nc.CHECKS)} checks)"


def test_evaluate_names_each_failure_and_exits_1(tmp_path, capsys):
    out = write_out(tmp_path / "out")
    (out / "run2.log").write_text(live_log([3]))  # run 2 started over
    report = copy.deepcopy(json.loads((out / "ranks-run1" / "rank1.json").read_text()))
    report["uuid"] = "GPU-0"
    (out / "ranks-run1" / "rank1.json").write_text(json.dumps(report))
    assert nc.main([str(out)]) == 1
    printed = capsys.readouterr().out
    assert "FAIL  devices" in printed and "FAIL  resume" in printed and "PASS  histospec" in printed
    assert printed.splitlines()[-1] == "VERDICT: FAIL (2 of 12 checks: devices, resume)"


def test_evaluate_after_a_run_that_died_fails_without_crashing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "node-smoke.yaml").write_text("parallel:\n  world_size: 8\n")
    (out / "run1.rc").write_text("1\n")
    results = nc.evaluate(out)
    assert [name for name, _, _ in results] == list(nc.CHECKS)
    assert not any(ok for _, ok, _ in results)
    assert dict((n, d) for n, _, d in results)["runs"] == "run 1 exited 1: see run1.log, run 2 never ran"


def test_live_histopipe_needs_two_instances_of_tp_1():
    from rhymerl.config import load_config

    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", [], report_unused=False)
    assert node_plan.live_histopipe_problem(cfg, 8) is None
    assert "at least two" in node_plan.live_histopipe_problem(cfg, 1)
    cfg.rollout.tensor_parallel = 2
    assert "needs 1" in node_plan.live_histopipe_problem(cfg, 8)


def test_config_lays_the_smoke_keys_over_the_main_job(tmp_path):
    out = tmp_path / "node-smoke.yaml"
    node_plan.write_config(REPO / "configs" / "tiny-cpu.yaml", REPO / "tests" / "gpu" / "node-smoke.yaml", out,
                           ["parallel.world_size=8", "data.prompts_per_step=8"])
    from rhymerl.config import load_config

    cfg = load_config(out, report_unused=False)
    assert (cfg.model.dtype, cfg.parallel.dist_backend, cfg.parallel.world_size) == ("bfloat16", "nccl", 8)
    assert cfg.rollout.enforce_eager is False and cfg.rollout.sleep_level == 2 and cfg.histopipe.enabled
    # Kept from the main job.
    assert cfg.data.tasks == ["basic_arithmetic"] and cfg.rollout.temperature == 0.7


# --------------------------------------------------------------------------- the dry run


def _dry_run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "SMOKE_GPUS": "8", "SMOKE_DEVICE_GB": "85"}
    return subprocess.run(["bash", str(REPO / "tests" / "gpu" / "node_smoke.sh"), "--dry-run", str(out), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_dry_run_prints_commands_and_checks_and_starts_nothing(tmp_path):
    out = tmp_path / "smoke"
    proc = _dry_run(out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    for want in ("--nproc_per_node=8", "tests/gpu/audited_rank.py", "run.max_steps=3", "run.max_steps=4",
                 f"tests/gpu/node_checks.py {out}", "per-device memory plan", "8 rollout instances",
                 "dry run: config and plan checked, nothing started"):
        assert want in text, want
    for name in nc.CHECKS:
        assert f"  {name} " in text, name
    assert sorted(p.name for p in out.iterdir()) == ["node-smoke.yaml", "print-config.yaml"]


def test_dry_run_refuses_a_tp_the_model_cannot_take(tmp_path):
    proc = _dry_run(tmp_path / "smoke", "parallel.tensor_parallel=2")
    assert proc.returncode == 2
    assert "parallel.tensor_parallel: 2 does not divide the model's 9 attention heads" in proc.stderr
    assert "run.max_steps" not in proc.stdout
