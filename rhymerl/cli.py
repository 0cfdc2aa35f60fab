"""`python -m rhymerl train|export|report|slurm ...`; subcommands import lazily (no torch for `--help`)."""

from __future__ import annotations

import argparse
import importlib
import sys

def _dispatch(target: tuple[str, str, str], argv: list[str], what: str) -> int:
    module, func, _ = target
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (e.name == module or module.startswith(e.name + ".") or e.name.startswith(module)):
            print(f"rhymerl: {what} is not built yet ({module} is missing)", file=sys.stderr)
            return 2
        raise
    return int(getattr(mod, func)(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rhymerl", description="RhymeRL: RL for LLM reasoning with history-accelerated rollouts")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="run RL training from a YAML config", description="Run RL training.")
    t.add_argument("config", help="YAML run config, e.g. configs/tiny-cpu.yaml")
    t.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. algo.lr=1e-6 rollout.n=8")
    t.add_argument("--print-config", action="store_true",
                   help="check what the config names (model, data, tasks, lengths), print the resolved config and exit")
    t.add_argument("--no-check", action="store_true",
                   help="with --print-config: skip the checks of files and tasks (a cluster config on another machine)")

    e = sub.add_parser("export", help="export a checkpoint as an HF folder", description="Export a RhymeRL checkpoint to HF safetensors.")
    e.add_argument("checkpoint", help="checkpoint folder (or run folder: its latest)")
    e.add_argument("--hf", required=True, help="output HF folder")

    r = sub.add_parser("report", help="PNG figures and an HTML page of a run from its metrics.jsonl",
                       description="Write PNG figures and index.html for a run folder.")
    r.add_argument("run_dir", help="a run's output_dir (holds metrics.jsonl)")
    r.add_argument("--out", help="output folder (default: RUN_DIR/report)")

    sl = sub.add_parser("slurm", help="render or submit an sbatch script for a config",
                        description="Render (print) or submit the sbatch script for a run config.")
    sl.add_argument("action", choices=["render", "submit"])
    sl.add_argument("config")
    sl.add_argument("overrides", nargs="*")
    sl.add_argument("--dry-run", action="store_true", help="show what would be submitted, submit nothing")
    sl.add_argument("--no-check", action="store_true",
                    help="skip the checks of the model, data and tasks the config names (render on another machine)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.cmd == "train":
        from rhymerl.config import ConfigError, load_config, to_yaml

        try:
            # The run reports unused keys when it loads the config again.
            cfg = load_config(args.config, args.overrides, report_unused=args.print_config)
        except ConfigError as e:
            print(f"rhymerl: config error: {e}", file=sys.stderr)
            return 2
        if args.print_config:
            if not args.no_check:
                from rhymerl.launch.preflight import preflight

                try:
                    preflight(cfg, cfg.parallel.world_size or None)
                except ConfigError as e:
                    print(f"rhymerl: config error: {e}", file=sys.stderr)
                    return 2
            from rhymerl.distributed.memory_plan import MemoryPlanError, planned_table

            try:
                table = planned_table(cfg, cfg.parallel.world_size or max(cfg.slurm.nodes * cfg.slurm.gpus_per_node, 1))
            except MemoryPlanError as e:
                print(f"rhymerl: {e}", file=sys.stderr)
                return 2
            sys.stdout.write(to_yaml(cfg))
            # As YAML comments: the output stays a config that loads.
            sys.stdout.write("".join(f"# {line}\n" for line in table.splitlines()))
            return 0
        return _dispatch(("rhymerl.launch.train", "run_from_config", ""), [args.config, *args.overrides], "train")
    if args.cmd == "export":
        return _dispatch(("rhymerl.resharding.hf_export", "main", ""), [args.checkpoint, "--hf", args.hf], "export")
    if args.cmd == "report":
        return _dispatch(("rhymerl.outputs.report", "main", ""), [args.run_dir] + (["--out", args.out] if args.out else []), "report")
    if args.cmd == "slurm":
        rest = [args.action, args.config, *args.overrides] + (["--dry-run"] if args.dry_run else []) \
            + (["--no-check"] if args.no_check else [])
        return _dispatch(("rhymerl.launch.slurm", "main", ""), rest, "slurm")
    return 2
