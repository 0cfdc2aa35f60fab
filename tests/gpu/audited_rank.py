"""One rank of the GPU node smoke check (tests/gpu/node_smoke.sh starts it under torchrun).

Runs the real driver (``rhymerl.launch.train.run_from_config``) with the collective-device audit
installed and writes what the checks of tests/gpu/node_checks.py read to ``OUT/rank<r>.json``:
the GPU the rank bound and the one current at the end, the device memory each colocation call
freed or took on the rank's own GPU (in order), its engine's steps and tokens per rollout, its
tensor collectives per backend, the audit's counts, and the error that ended it, if any.

    torchrun --standalone --nproc_per_node=N tests/gpu/audited_rank.py OUT CONFIG [overrides...]
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import socket
import sys
import time
from collections import Counter
from pathlib import Path

GB = 1e9
# Enough for every colocation call of a short run; a longer one keeps its first calls.
MAX_EVENTS = 400

EVENTS: list[dict] = []
ROLLOUTS: list[dict] = []
BACKENDS: Counter = Counter()


def _own_free_bytes() -> int | None:
    import torch

    from rhymerl.distributed import devices

    own = devices.rank_device()
    return int(torch.cuda.mem_get_info(own)[0]) if own is not None else None


def _record_memory(cls, name: str, label: str) -> None:
    """``cls.name`` records ``label`` with the bytes of the rank's own GPU it freed (< 0: took)."""
    real = getattr(cls, name)

    @functools.wraps(real)
    def recorded(self, *args, **kwargs):
        before = _own_free_bytes()
        t0 = time.perf_counter()
        out = real(self, *args, **kwargs)
        after = _own_free_bytes()
        if name == "wake_up":
            tags = args[0] if args else kwargs.get("tags")
            tag = f"{label}:{','.join(tags) if tags else 'all'}"
        else:
            tag = label
        event = {"e": tag, "s": round(time.perf_counter() - t0, 3)}
        if before is not None and after is not None:
            event["freed_gb"] = round((after - before) / GB, 4)
        if name == "__init__":
            import torch

            # Where the engine left the current device: vLLM's worker sets it itself.
            event["current_device"] = torch.cuda.current_device() if torch.cuda.is_available() else None
        if len(EVENTS) < MAX_EVENTS:
            EVENTS.append(event)
        return out

    setattr(cls, name, recorded)


def _count_engine_steps(engine_cls) -> None:
    """Per rollout: the engine steps this rank's instance took and the tokens they emitted."""
    start, step = engine_cls.start_rollout, engine_cls.step_deltas

    @functools.wraps(start)
    def start_rollout(self, *args, **kwargs):
        ROLLOUTS.append({"engine_steps": 0, "tokens": 0})
        return start(self, *args, **kwargs)

    @functools.wraps(step)
    def step_deltas(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        if ROLLOUTS:
            ROLLOUTS[-1]["engine_steps"] += 1
            ROLLOUTS[-1]["tokens"] += sum(len(d[1]) for d in out)
        return out

    engine_cls.start_rollout, engine_cls.step_deltas = start_rollout, step_deltas


def _count_backends() -> None:
    """Count every tensor collective by its group's backend. Installed before the audit, so the
    audit wraps these counters and still sees the real caller of each collective."""
    import torch.distributed as dist

    from rhymerl.distributed import devices
    from rhymerl.distributed.collective_audit import TENSOR_COLLECTIVES

    for name in TENSOR_COLLECTIVES:
        real = getattr(dist, name)
        sig = inspect.signature(real)

        def counted(*args, _real=real, _sig=sig, **kwargs):
            group = _sig.bind_partial(*args, **kwargs).arguments.get("group")
            BACKENDS[devices.group_backend(group)] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, functools.wraps(real)(counted))


def _device_facts(share: float) -> dict:
    import torch

    from rhymerl.distributed import devices

    own = devices.rank_device()
    if own is None or not torch.cuda.is_available():
        return {"bound": None}
    props = torch.cuda.get_device_properties(own)
    return {"bound": str(own), "uuid": str(getattr(props, "uuid", "")), "current_at_end": torch.cuda.current_device(),
            "total_gb": props.total_memory / GB, "engine_share_gb": share * props.total_memory / GB}


def _report(out: Path, audit, share: float, rc: int | None, error: str | None) -> None:
    rank = int(os.environ.get("RANK", "0"))
    report = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
              "world_size": int(os.environ.get("WORLD_SIZE", "1")), "host": socket.gethostname(),
              **_device_facts(share), "events": EVENTS, "rollouts": ROLLOUTS, "collectives": dict(BACKENDS),
              "audit": audit.summary() if audit is not None else None, "rc": rc, "error": error}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))


def _record_colocation() -> None:
    from rhymerl.rollout.engine import RolloutEngine
    from rhymerl.training.megatron_backend import MegatronBackend

    for name, label in (("__init__", "engine.build"), ("sleep", "engine.sleep"), ("wake_up", "engine.wake_up"),
                        ("load_weights", "engine.load_weights")):
        _record_memory(RolloutEngine, name, label)
    for name, label in (("offload_training_state", "trainer.offload"), ("onload_training_state", "trainer.onload"),
                        ("load_checkpoint", "trainer.load_checkpoint")):
        _record_memory(MegatronBackend, name, label)
    _count_engine_steps(RolloutEngine)


def _after_device_binding(install) -> None:
    """Run ``install`` once the driver has started its process groups, which binds the rank's GPU
    first: the recorders import vLLM and megatron-core, and an import that touched CUDA before
    the binding would put a context on GPU 0 of every rank, a fault the product itself avoids."""
    from rhymerl.distributed import process_groups

    real = process_groups.init_process_groups

    @functools.wraps(real)
    def init_then_install(*args, **kwargs):
        groups = real(*args, **kwargs)
        install()
        return groups

    process_groups.init_process_groups = init_then_install


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    from rhymerl.launch.preemption import PreemptionHandler

    # First: the driver expects its handler in place before anything slow starts.
    preempt = PreemptionHandler()
    from rhymerl.distributed.collective_audit import CollectiveAudit
    from rhymerl.config import load_config
    from rhymerl.launch.train import run_from_config

    share = load_config(argv[0], argv[1:], report_unused=False).rollout.gpu_memory_utilization
    _count_backends()
    audit = CollectiveAudit().install()
    _after_device_binding(_record_colocation)
    rc, error = None, None
    try:
        rc = run_from_config(argv, preempt)
        return rc
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        _report(out, audit, share, rc, error)


if __name__ == "__main__":
    sys.exit(main())
