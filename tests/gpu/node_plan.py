"""The node smoke check's config, written and checked before any GPU work (tests/gpu/node_smoke.sh).

    python tests/gpu/node_plan.py config BASE OVERLAY OUT_FILE [key=value ...]
        BASE with OVERLAY's keys laid over it and the overrides applied: one self-contained
        config file, loaded strictly (an unknown key or bad value fails here, naming the key).
    python tests/gpu/node_plan.py plan CONFIG DEVICE_GB
        The checks `--print-config` leaves to the job for a built-in model: TP against the
        model's heads, prompts per step against the data-parallel ranks, the engine layout and
        live HistoPipe's needs, and the memory plan of one DEVICE_GB device (printed).
        Resolves the model as the job would (a built-in one is converted once into the cache,
        where the job then finds it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml


def deep_merge(base: dict, over: dict) -> dict:
    """``base`` with ``over``'s keys laid over it, section by section."""
    out = dict(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def write_config(base: Path, overlay: Path, out_file: Path, overrides: list[str]) -> None:
    from rhymerl.config import load_config, with_overrides

    data = deep_merge(yaml.safe_load(base.read_text()) or {}, yaml.safe_load(overlay.read_text()) or {})
    data = with_overrides(data, overrides)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    header = f"# Written by tests/gpu/node_plan.py: {base} + {overlay} + {' '.join(overrides) or 'no overrides'}\n"
    out_file.write_text(header + yaml.safe_dump(data, sort_keys=False))
    load_config(out_file, report_unused=False)


def live_histopipe_problem(cfg, world_size: int) -> str | None:
    """Why live HistoPipe would not run across instances with ``cfg`` on ``world_size`` ranks, or None."""
    if not cfg.histopipe.enabled:
        return "histopipe.enabled must be true"
    if cfg.rollout.tensor_parallel != 1:
        return f"rollout.tensor_parallel is {cfg.rollout.tensor_parallel}; live dispatch needs 1"
    if world_size < 2:
        return f"{world_size} GPU: live dispatch needs at least two instances (GPUs)"
    return None


def check_plan(config: Path, device_gb: float) -> str:
    """The plan's summary and memory table; raises ConfigError / ModelError / MemoryPlanError."""
    import json

    from rhymerl.config import ConfigError, load_config, validate
    from rhymerl.distributed.memory_plan import check, estimate
    from rhymerl.models import check_model_use, model_shape, resolve_model
    from rhymerl.resharding.layout import ModelLayout
    from rhymerl.rollout.placement import engine_placement

    cfg = load_config(config, report_unused=False)
    world = cfg.parallel.world_size
    folder = resolve_model(cfg.model)
    dp = validate(cfg, model_shape(folder), world_size=world)
    check_model_use(folder, cfg.parallel.backend, cfg.data.chat_template)
    layout = engine_placement(world, 0, 0, cfg.rollout.tensor_parallel, ranks_per_node=world)
    problem = live_histopipe_problem(cfg, world)
    if problem:
        raise ConfigError(f"histopipe.enabled: {problem}")
    size = ModelLayout.from_hf_config(json.loads((folder / "config.json").read_text()))
    plan = estimate(cfg, size, world, device_gb * 1e9)
    check(plan)
    requests = cfg.data.prompts_per_step * cfg.rollout.n
    return (f"plan: {world} ranks (training TP {cfg.parallel.tensor_parallel} x DP {dp}), {layout.num_instances} "
            f"rollout instances, {requests} requests per step, model {folder}\n{plan.table()}")


def main(argv: list[str]) -> int:
    from rhymerl.config import ConfigError
    from rhymerl.distributed.memory_plan import MemoryPlanError
    from rhymerl.models import ModelError
    from rhymerl.rollout.placement import EnginePlacementError

    what = argv[0] if argv else ""
    try:
        if what == "config" and len(argv) >= 4:
            write_config(Path(argv[1]), Path(argv[2]), Path(argv[3]), argv[4:])
            return 0
        if what == "plan" and len(argv) == 3:
            print(check_plan(Path(argv[1]), float(argv[2])))
            return 0
    except (ConfigError, ModelError, MemoryPlanError, EnginePlacementError) as e:
        print(f"node smoke: config error: {e}", file=sys.stderr)
        return 2
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
