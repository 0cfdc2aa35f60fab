"""`python -m rhymerl train|bench|simulate|export|slurm ...`.

Subcommands are imported lazily so `--help` and config errors answer in milliseconds
without importing torch or vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, function, one-line help)
BENCHES = {
    "histospec": ("bench.histospec", "main", "HistoSpec drafting vs n-gram/suffix on rollout traces (forward passes per token)"),
    "rollout": ("bench.rollout", "main", "vLLM rollout: no-spec vs ngram vs suffix vs HistoSpec on epoch 2"),
    "reshard": ("bench.reshard", "main", "Megatron -> vLLM weight transfer: GB/s and peak memory per bucket size"),
    "e2e": ("bench.e2e", "main", "RL step time with HistoSpec+HistoPipe on vs off"),
    "memory": ("bench.memory", "main", "peak resident memory of one RL step, bytes per parameter by component"),
}
SIMULATIONS = {
    "histopipe": ("rhymerl.histopipe.simulator", "main", "cluster simulator: rollout schedulers on N GPUs"),
}


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


def _sub_table(parser: argparse.ArgumentParser, table: dict, what: str) -> None:
    parser.add_argument("name", choices=sorted(table), help="; ".join(f"{k}: {v[2]}" for k, v in sorted(table.items())))
    parser.add_argument("args", nargs=argparse.REMAINDER, help=f"arguments for the {what} (see `{what} NAME --help`)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rhymerl", description="RhymeRL: RL for LLM reasoning with history-accelerated rollouts")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="run RL training from a YAML config", description="Run RL training.")
    t.add_argument("config", help="YAML run config, e.g. configs/tiny-cpu.yaml")
    t.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. algo.lr=1e-6 rollout.n=8")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")

    b = sub.add_parser("bench", help="benchmarks that print ratios against a same-run baseline",
                       description="Run a benchmark; --json prints one JSON object on stdout.")
    _sub_table(b, BENCHES, "bench")
    s = sub.add_parser("simulate", help="simulators", description="Run a simulator; --json prints one JSON object.")
    _sub_table(s, SIMULATIONS, "simulate")

    e = sub.add_parser("export", help="export a checkpoint as an HF folder", description="Export a RhymeRL checkpoint to HF safetensors.")
    e.add_argument("checkpoint", help="checkpoint folder (or run folder: its latest)")
    e.add_argument("--hf", required=True, help="output HF folder")

    sl = sub.add_parser("slurm", help="render or submit an sbatch script for a config",
                        description="Render (print) or submit the sbatch script for a run config.")
    sl.add_argument("action", choices=["render", "submit"])
    sl.add_argument("config")
    sl.add_argument("overrides", nargs="*")
    sl.add_argument("--dry-run", action="store_true", help="show what would be submitted, submit nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.cmd == "train":
        from rhymerl.config import ConfigError, load_config, to_yaml

        try:
            cfg = load_config(args.config, args.overrides)
        except ConfigError as e:
            print(f"rhymerl: config error: {e}", file=sys.stderr)
            return 2
        if args.print_config:
            sys.stdout.write(to_yaml(cfg))
            return 0
        return _dispatch(("launch.train", "run_from_config", ""), [args.config, *args.overrides], "train")
    if args.cmd == "bench":
        return _dispatch(BENCHES[args.name], args.args, f"bench {args.name}")
    if args.cmd == "simulate":
        return _dispatch(SIMULATIONS[args.name], args.args, f"simulate {args.name}")
    if args.cmd == "export":
        return _dispatch(("rhymerl.resharding.export", "main", ""), [args.checkpoint, "--hf", args.hf], "export")
    if args.cmd == "slurm":
        rest = [args.action, args.config, *args.overrides] + (["--dry-run"] if args.dry_run else [])
        return _dispatch(("launch.slurm", "main", ""), rest, "slurm")
    return 2
