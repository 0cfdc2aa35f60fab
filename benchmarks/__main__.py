"""`python -m benchmarks NAME [args]`: the lab's benchmarks and simulators (see docs/benchmarks.md).

Each prints ratios against a baseline measured in the same run; --json prints one JSON
object on stdout. Run from a checkout: the lab is not part of the installed package.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS = {
    "histospec": ("benchmarks.histospec", "HistoSpec drafting vs n-gram/suffix on rollout traces (forward passes per token)"),
    "rollout": ("benchmarks.rollout", "vLLM rollout in the RL loop: no-spec vs ngram vs suffix vs HistoSpec; --sweep"),
    "greedy-replay": ("benchmarks.greedy_replay", "a trained run's prompts replayed greedily: every method's exact wall time"),
    "step": ("benchmarks.step", "where an engine step's time goes; the zero-draft tax of speculation; --calibrate"),
    "reshard": ("benchmarks.reshard", "Megatron -> vLLM weight transfer: GB/s and peak memory per bucket size"),
    "e2e": ("benchmarks.e2e", "RL step time with HistoSpec+HistoPipe on vs off, vs ngram and suffix"),
    "memory": ("benchmarks.memory", "peak resident memory of RL steps (steady state), bytes per parameter by component"),
    "train-phase": ("benchmarks.train_phase", "the training phase alone: one backend step over a fixed batch"),
    "roofline": ("benchmarks.roofline", "HistoSpec's step-cost prior of a GPU engine, from the decode roofline"),
    "simulate": ("benchmarks.simulate.simulator", "cluster simulator: rollout schedulers on N GPUs"),
    "main-job": ("benchmarks.main_job", "the README's main job at several seeds: per-epoch reward and tokens per forward"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("name", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v[1]}" for k, v in sorted(COMMANDS.items())))
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (see `python -m benchmarks NAME --help`)")
    args = p.parse_args(argv)
    module = importlib.import_module(COMMANDS[args.name][0])
    from rhymerl.config import ConfigError
    from rhymerl.outputs.traces import TraceError

    try:
        return int(module.main(args.args) or 0)
    except (ConfigError, TraceError) as e:
        # A bad config or trace file is the user's input: the message, not a traceback.
        print(f"python -m benchmarks {args.name}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
