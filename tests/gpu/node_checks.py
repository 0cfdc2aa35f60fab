"""The checks of the GPU node smoke check (tests/gpu/node_smoke.sh), one line each, then a verdict.

    python tests/gpu/node_checks.py OUT      # check what node_smoke.sh left in OUT; exit 1 on any FAIL
    python tests/gpu/node_checks.py --list   # the checks and what each decides on

Each check function takes parsed inputs (metrics rows, the ranks' reports of
tests/gpu/audited_rank.py, log text) and returns (ok, detail): the detail names the figure that
decided and, on a failure, what failed and where to look.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Callable

Result = tuple[bool, str]

# The two invocations: run 1 trains steps 0-2 (checkpoints after steps 2 and 3 of the count),
# run 2 is asked for 4 steps and must resume from one of them.
RUN1_STEPS = 3
RUN2_STEPS = 4
# The engine's memory is gpu_memory_utilization x the device, nearly all of it KV cache and
# weights, which sleep level 2 releases and waking takes back. Half leaves room for what a
# sleeping engine keeps (CUDA graph pool, allocator slack) while still telling an engine on its
# own GPU from one that allocated elsewhere or never released anything.
SHARE_FRACTION = 0.5
# bfloat16 keeps 8 significant bits: a logit of a few tens is rounded by a few hundredths, the
# trainer (megatron) and the engine (vLLM) round at different places in different kernels, and
# the sampling temperature divides the logits, so a rare tail token can differ by a good part
# of a nat. A weight the reshard put in the wrong place (shard order, fused QKV/gate-up split,
# a stale layer) moves most tokens by nats: the mean separates the two cases, the max (a
# factor e^2 in one token's probability) catches a few tokens gone badly wrong.
LOGPROB_MAX_ABS = 2.0
LOGPROB_MEAN_ABS = 0.1
# A step of this run is seconds of rollout and training; a minute-scale bound fails a rank that
# waits on a collective or an engine recompiling every step, long before the job times out.
STEP_S_BOUND = 120.0

CHECKS = {
    "runs": "both torchrun invocations exited 0 (run 1: 3 steps; run 2: resumed, 4 steps)",
    "devices": "every rank bound a GPU of its own (distinct UUIDs); the engine build left it current; "
               "still current at the end",
    "engine_memory": f"each rank's engine build took >= {SHARE_FRACTION:g} x its gpu_memory_utilization share "
                     "from the rank's own GPU",
    "collectives": "no collective handed a tensor on the wrong device; NCCL tensor collectives audited on every rank",
    "offload_before_build": "training state left the GPU before the engine build (and freed memory); the engine "
                            "slept at once; step 0 logged the extra offload",
    "sleep_wake": f"every engine sleep freed, every wake took back, >= {SHARE_FRACTION:g} x the engine's share "
                  "(colocation/*_freed_gb)",
    "histospec": "from the second step on HistoSpec drafted and had tokens accepted (tokens per forward > 1)",
    "histopipe_live": "every step went through live HistoPipe across all instances, each stepping on its own "
                      "(not in lock-step); bubble fraction reported",
    "logprobs": f"trainer/engine log-prob agreement in bf16: max |diff| < {LOGPROB_MAX_ABS:g}, "
                f"mean < {LOGPROB_MEAN_ABS:g} nats, every step",
    "loss": "loss and gradient norm finite every step",
    "resume": "run 1 checkpointed at steps 2 and 3; run 2 resumed from one of them, kept run 1's rows before it "
              "and continued the numbering to step 3",
    "step_time": f"every step under {STEP_S_BOUND:g} s (engine start-up shown)",
}


# --------------------------------------------------------------------------- helpers


def _span(values: list[float], fmt: str = "{:.2f}") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _events(rank: dict, name: str) -> list[dict]:
    return [e for e in rank.get("events", []) if e["e"] == name]


def _cuda_index(bound: str) -> int:
    return int(bound.split(":")[1]) if ":" in bound else 0


def _missing_ranks(run: str, ranks: list[dict], world: int) -> str | None:
    if not ranks:
        return f"{run}: no rank reports (ranks-*/rank<r>.json): the run died before its ranks ended; see its log"
    missing = sorted(set(range(world)) - {r["rank"] for r in ranks})
    if missing:
        return f"{run}: no report from rank(s) {', '.join(map(str, missing))}: see the run's log"
    return None


# --------------------------------------------------------------------------- checks


def check_runs(rcs: dict[str, int | None]) -> Result:
    """``rcs``: run name -> exit status (None: never started)."""
    parts = []
    for run, rc in rcs.items():
        log = f"{run.replace(' ', '')}.log"
        if rc == 0:
            parts.append(f"{run} exited 0")
        elif rc is None:
            parts.append(f"{run} never ran")
        else:
            parts.append(f"{run} {'timed out' if rc == 124 else 'exited'} {rc}: see {log}")
    return all(rc == 0 for rc in rcs.values()), ", ".join(parts)


def check_devices(runs: dict[str, list[dict]], world: int) -> Result:
    gpus = set()
    for run, ranks in runs.items():
        problem = _missing_ranks(run, ranks, world)
        if problem:
            return False, problem
        owner: dict[tuple, int] = {}
        for r in ranks:
            bound = r.get("bound")
            if not bound or not bound.startswith("cuda"):
                return False, f"{run}: rank {r['rank']} bound no GPU ({bound}): see devices.bind_rank_device in its log"
            index = _cuda_index(bound)
            if r.get("current_at_end") != index:
                return False, (f"{run}: rank {r['rank']} ended on cuda:{r.get('current_at_end')} but bound {bound}: "
                               "something changed the current device (see devices.check_rank_device)")
            for build in _events(r, "engine.build"):
                if build.get("current_device") != index:
                    return False, (f"{run}: rank {r['rank']}'s engine build left cuda:{build.get('current_device')} "
                                   f"current, not its {bound}: vLLM chose another device (LOCAL_RANK?)")
            key = (r.get("host"), r.get("uuid") or bound)
            if key in owner:
                return False, (f"{run}: ranks {owner[key]} and {r['rank']} share GPU {key[1]} on {key[0]}: "
                               "check LOCAL_RANK and CUDA_VISIBLE_DEVICES of the ranks")
            owner[key] = r["rank"]
            gpus.add(bound)
    return True, (f"{', '.join(runs)}: {world} ranks on {world} distinct GPUs ({', '.join(sorted(gpus))}), "
                  "current after the engine build and at the end")


def check_engine_memory(runs: dict[str, list[dict]]) -> Result:
    taken = []
    for run, ranks in runs.items():
        if not ranks:
            return False, f"{run}: no rank reports"
        for r in ranks:
            builds = _events(r, "engine.build")
            if not builds or "freed_gb" not in builds[0]:
                return False, f"{run}: rank {r['rank']} has no measured engine build: see its log"
            got, want = -builds[0]["freed_gb"], SHARE_FRACTION * r["engine_share_gb"]
            if got < want:
                return False, (f"{run}: rank {r['rank']}'s engine build took {got:.2f} GB of its own {r['bound']}, "
                               f"expected >= {want:.2f} GB: the engine allocated on another GPU")
            taken.append(got / r["engine_share_gb"])
    return True, f"engine builds took {_span(taken)} of their share from the rank's own GPU"


def check_collectives(runs: dict[str, list[dict]], log_text: str = "") -> Result:
    """``log_text``: the runs' logs (an error a rank reported only there)."""
    logged = next((line for line in log_text.splitlines() if "CollectiveDeviceError" in line), None)
    if logged:
        return False, f"logged: {logged.strip()}"
    totals, own, library = {}, 0, 0
    for run, ranks in runs.items():
        if not ranks:
            return False, f"{run}: no rank reports"
        for r in ranks:
            err = r.get("error") or ""
            if "CollectiveDeviceError" in err:
                return False, f"{run}: rank {r['rank']}: {err.splitlines()[0]}"
            if not r.get("collectives", {}).get("nccl"):
                return False, (f"{run}: rank {r['rank']} ran no NCCL tensor collective under the audit "
                               f"({r.get('collectives')}): is the world NCCL (parallel.dist_backend)?")
            audit = r.get("audit") or {}
            if audit.get("bridged"):
                return False, f"{run}: rank {r['rank']}: {audit['bridged']} collective(s) bridged to another device"
            for backend, n in r["collectives"].items():
                totals[backend] = totals.get(backend, 0) + n
            for key, n in audit.get("checked", {}).items():
                own, library = (own + n, library) if key.endswith("/own") else (own, library + n)
    by_backend = ", ".join(f"{b} {n}" for b, n in sorted(totals.items()))
    return True, f"no device error; tensor collectives audited: {by_backend} (rhymerl {own}, libraries {library})"


def check_offload_before_build(runs: dict[str, list[dict]], first_row: dict | None) -> Result:
    """``first_row``: run 1's step-0 metrics."""
    freed = []
    for run, ranks in runs.items():
        if not ranks:
            return False, f"{run}: no rank reports"
        for r in ranks:
            names = [e["e"] for e in r.get("events", [])]
            if "engine.build" not in names:
                return False, f"{run}: rank {r['rank']} never built its engine: see its log"
            b = names.index("engine.build")
            # The offloads since the last onload (the policy's, and a KL reference's).
            start = max((i + 1 for i, n in enumerate(names[:b]) if n == "trainer.onload"), default=0)
            offloads = [e for e in r["events"][start:b] if e["e"] == "trainer.offload"]
            if not offloads:
                return False, (f"{run}: rank {r['rank']}: training state was resident at the engine build "
                               f"(calls before it: {names[:b]}): see colocation.before_engine_build")
            if b + 1 >= len(names) or names[b + 1] != "engine.sleep":
                return False, (f"{run}: rank {r['rank']}: the engine did not sleep right after its build "
                               f"(next: {names[b + 1:b + 2]}): see colocation.attach_engine")
            if any("freed_gb" not in e for e in offloads):
                return False, f"{run}: rank {r['rank']}: the offload before the engine build was not measured (no GPU)"
            got = sum(e["freed_gb"] for e in offloads)
            if got <= 0:
                return False, (f"{run}: rank {r['rank']}: the offload before the engine build freed {got:.3f} GB: "
                               "gradients and optimizer state stayed on the GPU")
            freed.append(got)
    if first_row is None:
        return False, "no step-0 row in run 1's metrics"
    calls = first_row.get("colocation/trainer_offload_calls", 0)
    if calls < 2:
        return False, f"step 0 logged {calls} trainer offload(s); expected 2 (before the engine build, after training)"
    # Shown, not decided: what a resumed run's checkpoint load left on the GPU before its first
    # rollout (the allocator's cache counts too, so it is no proof either way).
    loads = [-e["freed_gb"] for ranks in runs.values() for r in ranks for e in _events(r, "trainer.load_checkpoint")
             if "freed_gb" in e]
    resumed = f"; checkpoint load took {_span(loads, '{:.3f}')} GB" if loads else ""
    return True, (f"offload (freed {_span(freed, '{:.3f}')} GB) -> engine build -> sleep on every rank; "
                  f"step 0: {calls} offloads{resumed}")


def _rank_sleep_wake(runs: dict[str, list[dict]], want: float) -> str | None:
    """The first sleep or KV-cache wake of any rank that moved less than ``want`` GB, or None."""
    for run, ranks in runs.items():
        for r in ranks:
            for e in r.get("events", []):
                if e["e"] not in ("engine.sleep", "engine.wake_up:kv_cache") or "freed_gb" not in e:
                    continue
                moved = e["freed_gb"] if e["e"] == "engine.sleep" else -e["freed_gb"]
                if moved < want:
                    return (f"{run}: rank {r['rank']}: {e['e']} moved {moved:.2f} GB of its {r['bound']}, "
                            f"expected >= {want:.2f} GB")
    return None


def check_sleep_wake(rows: list[dict], share_gb: float, runs: dict[str, list[dict]]) -> Result:
    """Rank 0's per-step figures (``rows``), then every rank's own calls."""
    if not rows:
        return False, "no metrics rows"
    want = SHARE_FRACTION * share_gb
    expected = f"expected >= {want:.2f} GB (engine share {share_gb:.1f} GB)"
    freed, taken = [], []
    for row in rows:
        sleeps, wakes = row["colocation/engine_sleep_calls"], row["colocation/engine_wake_kv_calls"]
        if not sleeps or not wakes:
            return False, f"step {row['step']}: {sleeps} sleep(s), {wakes} wake(s): the engine stayed resident"
        f = row["colocation/engine_sleep_freed_gb"] / sleeps
        # The weights wake only when they are stale (every step of an on-policy run).
        woken = row.get("colocation/engine_wake_weights_freed_gb", 0.0) + row["colocation/engine_wake_kv_freed_gb"]
        t = -woken / wakes
        if f < want:
            return False, f"step {row['step']}: a sleep freed {f:.2f} GB, {expected}"
        if t < want:
            return False, f"step {row['step']}: a wake took back {t:.2f} GB, {expected}"
        freed.append(f)
        taken.append(t)
    problem = _rank_sleep_wake(runs, want)
    if problem:
        return False, problem
    return True, (f"per call: sleep freed {_span(freed)} GB, wake took {_span(taken)} GB (engine share "
                  f"{share_gb:.1f} GB); every rank's sleeps and wakes likewise")


def check_histospec(rows: list[dict]) -> Result:
    later = [r for r in rows if r["step"] >= 1]
    if not later:
        return False, "no step after the first: HistoSpec drafts from the prompts' earlier visits"
    for row in later:
        tpf, acc = row["histospec/tokens_per_forward"], row["histospec/draft_accepted"]
        if not acc > 0 or not tpf > 1:
            return False, (f"step {row['step']}: tokens per forward {tpf:.2f}, {acc:g} draft tokens accepted: "
                           "HistoSpec did not draft (look for the proposer in the rank logs)")
    steps, tpf = [r["step"] for r in later], [r["histospec/tokens_per_forward"] for r in later]
    return True, (f"steps {_span(steps, '{}')}: tokens per forward {_span(tpf)}, "
                  f"{sum(r['histospec/draft_accepted'] for r in later):g} draft tokens accepted")


def _lock_step(ranks: list[dict]) -> bool:
    """Every instance took the same engine steps in every rollout though their tokens differed."""
    rollouts = list(zip(*[r["rollouts"] for r in ranks]))
    same_steps = all(len({x["engine_steps"] for x in k}) == 1 for k in rollouts)
    same_tokens = all(len({x["tokens"] for x in k}) == 1 for k in rollouts)
    return bool(rollouts) and same_steps and not same_tokens


def check_histopipe_live(rows: list[dict], runs: dict[str, list[dict]], log_text: str, world: int) -> Result:
    if world < 2:
        return False, f"{world} GPU: live HistoPipe needs at least two instances"
    if not rows:
        return False, "no metrics rows"
    live_steps = {int(s) for s in re.findall(r"histopipe live step (\d+):", log_text)}
    for row in rows:
        bubble = row.get("histopipe/bubble_fraction")
        if not _finite(bubble) or not 0 <= bubble <= 1:
            return False, f"step {row['step']}: histopipe/bubble_fraction is {bubble!r}"
        if row["step"] not in live_steps:
            return False, (f"step {row['step']}: no 'histopipe live step' line in the logs: the rollout did not go "
                           "through live dispatch (histopipe.enabled, rollout.tensor_parallel 1, more than one GPU)")
    per_instance = []
    for run, ranks in runs.items():
        if len(ranks) < 2:
            return False, f"{run}: {len(ranks)} instance report(s); live HistoPipe needs two or more"
        counts = {len(r["rollouts"]) for r in ranks}
        if len(counts) != 1:
            return False, f"{run}: instances ran different numbers of rollouts ({sorted(counts)}): see the logs"
        for k, rollout in enumerate(zip(*[r["rollouts"] for r in ranks])):
            stepped = [x["engine_steps"] for x in rollout]
            if sum(1 for s in stepped if s) < 2:
                return False, f"{run}: rollout {k}: engine steps per instance {stepped}: fewer than two instances ran"
            per_instance.extend(stepped)
        idle = [r["rank"] for r in ranks if not any(x["engine_steps"] for x in r["rollouts"])]
        if idle:
            return False, f"{run}: instance(s) {idle} never took an engine step"
        if _lock_step(ranks):
            return False, (f"{run}: every instance took the same engine steps in every rollout though their tokens "
                           "differed: the engines step in lock-step (vLLM data parallelism?)")
    moves = sum(r.get("histopipe/moves", 0) for r in rows)
    bubbles = [r["histopipe/bubble_fraction"] for r in rows]
    return True, (f"{world} instances, every step live; engine steps per instance and rollout "
                  f"{_span(per_instance, '{}')}, bubble {_span(bubbles)}, {moves:g} moves")


def check_logprobs(rows: list[dict]) -> Result:
    if not rows:
        return False, "no metrics rows"
    for row in rows:
        mx, mean, n = row["train/logprob_max_abs"], row["train/logprob_mean_abs"], row.get("train/logprob_tokens", 1)
        if not n:
            return False, f"step {row['step']}: no tokens compared (train/logprob_tokens 0)"
        if not (_finite(mx) and mx < LOGPROB_MAX_ABS and _finite(mean) and mean < LOGPROB_MEAN_ABS):
            return False, (f"step {row['step']}: trainer/engine log-probs differ by max {mx:.3f}, mean {mean:.4f} "
                           f"(bounds {LOGPROB_MAX_ABS:g}, {LOGPROB_MEAN_ABS:g}): check the reshard into the engine")
    return True, (f"max |diff| {_span([r['train/logprob_max_abs'] for r in rows], '{:.3f}')}, "
                  f"mean {_span([r['train/logprob_mean_abs'] for r in rows], '{:.4f}')} over {len(rows)} steps")


def check_loss(rows: list[dict]) -> Result:
    if not rows:
        return False, "no metrics rows"
    for row in rows:
        for key in ("train/loss", "train/grad_norm"):
            if key in row and not _finite(row[key]):
                return False, f"step {row['step']}: {key} is {row[key]!r}"
        if "train/loss" not in row:
            return False, f"step {row['step']}: no train/loss (did it train?)"
    return True, f"loss {_span([r['train/loss'] for r in rows], '{:.4g}')} over {len(rows)} steps, all finite"


def check_resume(run1_rows: list[dict], final_rows: list[dict], run2_log: str, ckpt_steps: list[int]) -> Result:
    """``ckpt_steps``: the checkpoint steps run 1 left; ``final_rows``: metrics after run 2."""
    steps1 = [r["step"] for r in run1_rows]
    if steps1 != list(range(RUN1_STEPS)):
        return False, f"run 1 logged steps {steps1}, expected {list(range(RUN1_STEPS))}"
    if not {2, 3} <= set(ckpt_steps):
        return False, f"run 1 left checkpoints of steps {ckpt_steps}, expected 2 and 3 (checkpoint.every_steps 2)"
    m = re.search(r"resumed from (.+?) at step (\d+)", run2_log)
    if m is None:
        return False, "run 2 did not resume (no 'resumed from' line in run2.log): it started over"
    at = int(m.group(2))
    if at not in (2, 3):
        return False, f"run 2 resumed at step {at} from {m.group(1)}, expected 2 or 3"
    steps = [r["step"] for r in final_rows]
    if steps != list(range(RUN2_STEPS)):
        return False, f"after run 2 the metrics hold steps {steps}, expected {list(range(RUN2_STEPS))} once each"
    if [r for r in final_rows if r["step"] < at] != [r for r in run1_rows if r["step"] < at]:
        return False, f"the rows of steps before {at} differ from run 1's: run 2 ran them again"
    return True, (f"run 1 checkpointed steps {', '.join(map(str, sorted(ckpt_steps)))}; run 2 resumed from "
                  f"{Path(m.group(1)).name} at step {at} and logged step(s) {_span([at, RUN2_STEPS - 1], '{}')}")


def check_step_time(rows: list[dict], runs: dict[str, list[dict]]) -> Result:
    if not rows:
        return False, "no metrics rows"
    for row in rows:
        if not row["time/step_s"] < STEP_S_BOUND:
            return False, (f"step {row['step']} took {row['time/step_s']:.1f} s (bound {STEP_S_BOUND:g} s): "
                           "see the run's log")
    builds = [e["s"] for ranks in runs.values() for r in ranks for e in _events(r, "engine.build")]
    startup = f"; engine start-up {_span(builds, '{:.0f}')} s" if builds else ""
    times = [r["time/step_s"] for r in rows]
    return True, f"steps took {_span(times, '{:.1f}')} s (first {times[0]:.1f} s){startup}"


# --------------------------------------------------------------------------- reading OUT


def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_ranks(folder: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in folder.glob("rank*.json")), key=lambda r: r["rank"])


def read_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def read_rc(path: Path) -> int | None:
    return int(path.read_text().strip()) if path.is_file() else None


def read_world(config: Path) -> int:
    import yaml

    return int(yaml.safe_load(config.read_text())["parallel"]["world_size"])


def evaluate(out: Path) -> list[tuple[str, bool, str]]:
    """Every check on what node_smoke.sh left in ``out``: (name, ok, detail)."""
    run1_rows, final_rows = read_rows(out / "metrics-run1.jsonl"), read_rows(out / "run" / "metrics.jsonl")
    runs = {"run 1": read_ranks(out / "ranks-run1"), "run 2": read_ranks(out / "ranks-run2")}
    logs = {"run 1": read_text(out / "run1.log"), "run 2": read_text(out / "run2.log")}
    world = read_world(out / "node-smoke.yaml")
    ckpt_steps = [int(s) for s in re.findall(r"step-(\d+)", read_text(out / "checkpoints-run1.txt"))]
    rank0 = next((r for r in runs["run 1"] if r["rank"] == 0), {})
    first_row = next((r for r in run1_rows if r["step"] == 0), None)
    checks: dict[str, Callable[[], Result]] = {
        "runs": lambda: check_runs({"run 1": read_rc(out / "run1.rc"), "run 2": read_rc(out / "run2.rc")}),
        "devices": lambda: check_devices(runs, world),
        "engine_memory": lambda: check_engine_memory(runs),
        "collectives": lambda: check_collectives(runs, logs["run 1"] + logs["run 2"]),
        "offload_before_build": lambda: check_offload_before_build(runs, first_row),
        "sleep_wake": lambda: check_sleep_wake(final_rows, rank0["engine_share_gb"], runs),
        "histospec": lambda: check_histospec(final_rows),
        "histopipe_live": lambda: check_histopipe_live(final_rows, runs, logs["run 1"] + logs["run 2"], world),
        "logprobs": lambda: check_logprobs(final_rows),
        "loss": lambda: check_loss(final_rows),
        "resume": lambda: check_resume(run1_rows, final_rows, logs["run 2"], ckpt_steps),
        "step_time": lambda: check_step_time(final_rows, runs),
    }
    results = []
    for name, check in checks.items():
        try:
            ok, detail = check()
        except KeyError as e:
            ok, detail = False, f"could not decide: no figure {e} in OUT's files (see the runs' logs)"
        except (IndexError, TypeError, ValueError) as e:
            ok, detail = False, f"could not decide: {type(e).__name__}: {e} (OUT's files malformed?)"
        results.append((name, ok, detail))
    return results


def report(results: list[tuple[str, bool, str]]) -> str:
    lines = [f"{'PASS' if ok else 'FAIL'}  {name:<21} {detail}" for name, ok, detail in results]
    failed = [name for name, ok, _ in results if not ok]
    verdict = (f"VERDICT: FAIL ({len(failed)} of {len(results)} checks: {', '.join(failed)})" if failed
               else f"VERDICT: PASS ({len(results)} checks)")
    return "\n".join(lines + [verdict])


def main(argv: list[str]) -> int:
    if argv == ["--list"]:
        print("\n".join(f"  {name:<21} {what}" for name, what in CHECKS.items()))
        return 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    if not (Path(argv[0]) / "node-smoke.yaml").is_file():
        print(f"node checks: {argv[0]} has no node-smoke.yaml: give the OUT folder node_smoke.sh wrote",
              file=sys.stderr)
        return 2
    results = evaluate(Path(argv[0]))
    print(report(results))
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
