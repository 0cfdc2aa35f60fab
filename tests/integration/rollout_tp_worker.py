"""One rank of the rollout tensor-parallel probe (started by rhymerl.training.local_launch.run_ranks).

Every rank starts the gloo world and the training backend (megatron, DP over the ranks), then
builds one vLLM engine across all ranks (tensor parallel = world size, vLLM's external
launcher) and samples; the trainer's log-probs of the samples are compared with the engine's,
before and after one training step whose weights are resharded into the TP engine.
Rank 0 writes ``OUT/result.json``.

    python rollout_tp_worker.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> int:
    out = Path(sys.argv[1])
    import torch

    from rhymerl.config import AlgorithmConfig, HistoSpecConfig, ModelConfig, ParallelConfig, RolloutConfig
    from rhymerl.models import resolve_model
    from rhymerl.rollout import RolloutEngine, SamplingSpec
    from rhymerl.rollout.placement import engine_placement
    from rhymerl.training import build_backend
    from rhymerl.training.base import PolicyBatch
    from rhymerl.distributed.process_groups import init_process_groups

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = resolve_model(ModelConfig(path="builtin:tiny"))
    pc = ParallelConfig()
    groups = init_process_groups(pc, world, rank)
    backend = build_backend(pc, AlgorithmConfig(lr=1e-3), model, groups, seed=0)
    rc = RolloutConfig(speculative="none", max_model_len=256, max_num_seqs=8, tensor_parallel=world)
    engine = RolloutEngine(rc, HistoSpecConfig(), model, seed=0, cpu_kv_cache_bytes=50 << 20,
                           placement=engine_placement(world, rank, rank, world))
    prompts = [[1, 5, 9, 13, 4], [1, 7, 7, 7, 2, 3]]
    spec = SamplingSpec(temperature=1.0, max_tokens=12, seed=11)

    def diff() -> tuple[float, list]:
        res = engine.generate(prompts, 2, spec, record_history=False)
        rows, eng = [], []
        for r in res:
            for resp in r.responses:
                rows.append(r.prompt_token_ids + resp.token_ids)
                eng.append((len(r.prompt_token_ids), resp.logprobs))
        T = max(len(x) for x in rows)
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        mask = torch.zeros(len(rows), T)
        lp_e = torch.zeros(len(rows), T)
        for i, (row, (p, lps)) in enumerate(zip(rows, eng)):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, p:len(row)] = 1
            lp_e[i, p:len(row)] = torch.tensor(lps)
        lp_t = backend.compute_logprobs(ids, mask)
        return float(((lp_t - lp_e).abs() * mask).max()), rows, ids, mask, lp_t

    d0, rows0, ids, mask, lp = diff()
    batch = PolicyBatch(input_ids=ids, response_mask=mask, advantages=torch.randn(ids.shape[0]),
                        old_logprobs=lp, engine_logprobs=lp)
    backend.train_step(batch)
    engine.load_weights((n, t) for bucket in backend.export_hf_weights(64 << 20) for n, t in bucket)
    d1, rows1, _, _, _ = diff()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps({"lp_diff_before": d0, "lp_diff_after_update": d1,
                                                      "samples_changed": rows0 != rows1, "rows": rows0}))
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
