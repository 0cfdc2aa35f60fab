"""Probe for tests/integration/test_megatron_patches.py (one process per world size).

For every patch it runs the operations that need it twice: with all other patches applied but
this one (must fail), then with it (must succeed). Prints one JSON line per (patch, op).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch


def ops(model_dir: Path, tp: int, pp: int):
    from rhymerl.config import AlgorithmConfig, ParallelConfig
    from rhymerl.training.base import PolicyBatch
    from rhymerl.training.megatron_backend import MegatronBackend
    from rhymerl.distributed.process_groups import init_process_groups

    pc = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))

    def groups():
        return init_process_groups(pc, world, rank, apply_patches=False)

    def build():
        return MegatronBackend(pc, AlgorithmConfig(lr=1e-2), model_dir, groups(), train=False)

    def forward():
        b = build()
        ids = torch.randint(3, 300, (2, 8), generator=torch.Generator().manual_seed(0))
        return b.compute_logprobs(ids, torch.ones(2, 8))

    def forward_unfused():
        # megatron's own attention builds its causal mask (torch's fused attention needs none).
        b = MegatronBackend(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, attention="unfused"),
                            AlgorithmConfig(lr=1e-2), model_dir, groups(), train=False)
        ids = torch.randint(3, 300, (2, 8), generator=torch.Generator().manual_seed(0))
        return b.compute_logprobs(ids, torch.ones(2, 8))

    def train(**parallel_kw):
        b = MegatronBackend(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, **parallel_kw),
                            AlgorithmConfig(lr=1e-2), model_dir, groups())
        ids = torch.randint(3, 300, (2, 8), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(2, 8)
        return b.train_step(PolicyBatch(ids, mask, torch.tensor([1.0, -1.0]), torch.full((2, 8), -5.0)))

    return {"build": build, "forward": forward, "forward_unfused": forward_unfused, "train": train,
            "train_recompute": lambda: train(recompute_activations=True),
            "train_recompute_norms": lambda: train(recompute_norms=True)}


def main() -> None:
    import megatron_patches

    model_dir, tp, pp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    wanted = sys.argv[4].split(",")
    table = ops(model_dir, tp, pp)
    rank = int(os.environ.get("RANK", 0))
    for spec in wanted:
        name, op = spec.split(":")
        row = {"patch": name, "op": op}
        for phase, skip in (("without", (name,)), ("with", ())):
            megatron_patches.revert_all()
            megatron_patches.apply_all("cpu", skip=skip)
            try:
                table[op]()
                row[phase] = "ok"
            except BaseException as e:  # noqa: BLE001 - any failure counts
                row[phase] = f"{type(e).__name__}: {str(e)[:160]}"
                if os.environ.get("PROBE_TRACE"):
                    traceback.print_exc()
        if rank == 0:
            print("PROBE " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
