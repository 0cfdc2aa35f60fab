"""The checks of tests/gpu/smoke.sh, one per sub-command; each prints one JSON line and exits
non-zero when its check fails.

    python tests/gpu/smoke_checks.py nccl          # NCCL group, collectives through rhymerl.collectives
    python tests/gpu/smoke_checks.py sleep         # engine sleep/wake, device memory before and after
    python tests/gpu/smoke_checks.py step RUN_DIR  # the colocated RL step's metrics
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GB = 1e9


def _fail(what: str, **figures) -> None:
    print(json.dumps({"ok": False, "failed": what, **figures}))
    sys.exit(1)


def check_nccl() -> dict:
    import torch
    import torch.distributed as dist

    from rhymerl.collective_audit import CollectiveAudit
    from rhymerl.collectives import WorldComm, all_reduce_max
    from rhymerl.config import ParallelConfig
    from rhymerl.devices import collective_device
    from rhymerl.training.process_groups import destroy_process_groups, init_process_groups

    groups = init_process_groups(ParallelConfig(), 1, 0)
    if groups.dist_backend != "nccl" or groups.device.type != "cuda":
        _fail("expected an NCCL world on CUDA", backend=groups.dist_backend, device=str(groups.device))
    # The failure the device shim exists for: NCCL refuses a CPU tensor.
    try:
        dist.all_reduce(torch.ones(1))
        refused = False
    except (RuntimeError, ValueError):
        refused = True
    audit = CollectiveAudit().install()
    value = all_reduce_max(7, groups.dp)
    parts = [torch.empty(3, device=collective_device(groups.tp))]
    dist.all_gather(parts, torch.arange(3.0, device=collective_device(groups.tp)), group=groups.tp)
    comm = WorldComm(rank=0, world_size=1)
    echoed = comm.broadcast_object({"step": 1})
    audit.uninstall()
    destroy_process_groups()
    out = {"cpu_tensor_refused_by_nccl": refused, "all_reduce_max": value, "all_gather": parts[0].tolist(),
           "audit": audit.summary(), "object": echoed}
    if value != 7 or parts[0].tolist() != [0.0, 1.0, 2.0] or echoed != {"step": 1}:
        _fail("collective results", **out)
    return out


def check_sleep() -> dict:
    import torch
    from safetensors.torch import load_file

    from rhymerl.config import HistoSpecConfig, ModelConfig, RolloutConfig
    from rhymerl.models import resolve_model
    from rhymerl.rollout import RolloutEngine, SamplingSpec

    model = resolve_model(ModelConfig(path="builtin:tiny"))
    cfg = RolloutConfig(speculative="none", gpu_memory_utilization=0.3, max_model_len=256, max_num_seqs=8,
                        enforce_eager=True)
    engine = RolloutEngine(cfg, HistoSpecConfig(enabled=False), model, seed=0)
    greedy = SamplingSpec(temperature=0.0, max_tokens=16)
    prompts = [[1, 5, 9, 13], [1, 7, 7, 7, 2]]
    before = [r.token_ids for r in engine.generate(prompts, 1, greedy, record_history=False)]
    free = lambda: torch.cuda.mem_get_info()[0]  # noqa: E731
    f_awake = free()
    engine.sleep(2)
    f_asleep = free()
    engine.wake_up(["weights"])
    f_weights = free()
    weights = {}
    for f in sorted(model.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    engine.load_weights(weights.items())
    engine.wake_up(["kv_cache"])
    f_woken = free()
    after = [r.token_ids for r in engine.generate(prompts, 1, greedy, record_history=False)]
    engine.shutdown()
    out = {"freed_by_sleep_gb": (f_asleep - f_awake) / GB, "taken_by_weights_gb": (f_asleep - f_weights) / GB,
           "taken_by_kv_gb": (f_weights - f_woken) / GB, "engine_share_gb": cfg.gpu_memory_utilization *
           torch.cuda.get_device_properties(0).total_memory / GB, "greedy_same_after_wake": before == after}
    # The KV cache is most of the engine's share: sleeping must free at least half of it.
    if out["freed_by_sleep_gb"] < 0.5 * out["engine_share_gb"] or not out["greedy_same_after_wake"]:
        _fail("sleep/wake", **out)
    return out


def check_step(run_dir: Path) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if not rows:
        _fail("no step rows", run_dir=str(run_dir))
    r = rows[-1]
    keys = ("colocation/engine_sleep_calls", "colocation/engine_sleep_s", "colocation/engine_sleep_freed_gb",
            "colocation/engine_wake_weights_calls", "colocation/engine_wake_kv_calls", "colocation/trainer_offload_calls",
            "train/logprob_max_abs", "time/step_s")
    out = {k: r.get(k) for k in keys}
    if r.get("colocation/engine_sleep_calls") != 1 or (r.get("colocation/engine_sleep_freed_gb") or 0) <= 0 \
            or r.get("train/logprob_max_abs", 1.0) >= 0.05:
        _fail("colocated step", **out)
    return out


def main() -> None:
    what = sys.argv[1]
    if what == "nccl":
        out = check_nccl()
    elif what == "sleep":
        out = check_sleep()
    elif what == "step":
        out = check_step(Path(sys.argv[2]))
    else:
        raise SystemExit(f"unknown check {what!r}: nccl, sleep, step")
    print(json.dumps({"ok": True, "check": what, **out}))


if __name__ == "__main__":
    main()
