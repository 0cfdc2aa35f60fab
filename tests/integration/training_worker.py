"""One rank of the multi-rank training tests (started by rhymerl.training.local_launch.run_ranks).

For each model folder given, it builds the Megatron backend at the requested TP/PP, and rank 0
writes what the tests compare: full logits and log-probs of a fixed batch, the exported HF weights
before and after one training step, and losses. Optionally it saves a checkpoint after step 1
or loads one (written at another TP/PP) and continues from it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch


def make_batch(seed: int, vocab: int, rows: int = 4, seq: int = 16):
    from rhymerl.training.base import PolicyBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)
    mask = torch.zeros(rows, seq)
    lengths = [16, 12, 14, 9]
    for i in range(rows):
        mask[i, 5: lengths[i]] = 1.0
        ids[i, lengths[i]:] = 0
    adv = torch.randn(rows, generator=g)
    if seed == 2:
        # The second step's batch has a row at advantage 0, which the backends leave out of the
        # forward and backward: the references, which train every row, check the update is the same.
        adv[1] = 0.0
    return PolicyBatch(ids, mask, adv, torch.zeros(rows, seq)), g


def with_old_logprobs(batch, g):
    # Old log-probs that do not depend on the current weights (near log(1/vocab) of the random
    # model), so the ratios differ per token and the clip takes part in the gradient.
    shape = batch.response_mask.shape
    batch.old_logprobs = (-5.9 + 0.3 * torch.randn(shape, generator=g)) * batch.response_mask
    return batch


def export_to(backend, path: Path, bucket_bytes: int, rank0: bool) -> int:
    from safetensors.torch import save_file

    out, n = {}, 0
    for bucket in backend.export_hf_weights(bucket_bytes):
        n += 1
        for name, t in bucket:
            out[name] = t.detach().clone().cpu()
    if rank0:
        save_file(out, str(path))
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", action="append", required=True, help="name=HF folder")
    ap.add_argument("--save-ckpt", action="store_true")
    ap.add_argument("--load-ckpt", default="")
    ap.add_argument("--bucket-bytes", type=int, default=20_000)
    args = ap.parse_args()

    from rhymerl.config import AlgorithmConfig, ParallelConfig
    from rhymerl.training import build_backend, destroy_process_groups, init_process_groups

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    pc = ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp)
    algo = AlgorithmConfig(lr=1e-2, micro_batch_tokens=32, eps_low=0.2, eps_high=0.28)
    groups = init_process_groups(pc, world, rank)
    out = Path(args.out)
    rank0 = rank == 0
    results = {}
    for spec in args.model:
        name, folder = spec.split("=", 1)
        d = out / name
        if rank0:
            d.mkdir(parents=True, exist_ok=True)
        backend = build_backend(pc, algo, Path(folder), groups, seed=0)
        vocab = backend.layout.vocab_size
        batch, g = make_batch(1, vocab)
        logits = backend.forward_logits(batch.input_ids)
        lp = backend.compute_logprobs(batch.input_ids, batch.response_mask)
        if rank0:
            torch.save({"input_ids": batch.input_ids, "mask": batch.response_mask, "logits": logits, "logprobs": lp},
                       d / "forward.pt")
        r = {"buckets": export_to(backend, d / "export0.safetensors", args.bucket_bytes, rank0)}
        batch = with_old_logprobs(batch, g)
        m1 = backend.train_step(batch)
        r["loss1"], r["grad_norm1"], r["metrics1"] = m1.loss, m1.grad_norm, m1.extra
        export_to(backend, d / "step1.safetensors", args.bucket_bytes, rank0)
        batch2, g2 = make_batch(2, vocab)
        if args.save_ckpt:
            backend.save_checkpoint(d / "ckpt")
        batch2 = with_old_logprobs(batch2, g2)
        m2 = backend.train_step(batch2)
        r["loss2"], r["rows_skipped2"] = m2.loss, m2.extra["rows_skipped"]
        export_to(backend, d / "step2.safetensors", args.bucket_bytes, rank0)
        if args.load_ckpt:
            fresh = build_backend(pc, algo, Path(folder), groups, seed=0)
            fresh.load_checkpoint(Path(args.load_ckpt) / name / "ckpt")
            batch2, g2 = make_batch(2, vocab)
            batch2 = with_old_logprobs(batch2, g2)
            r["loss2_loaded"] = fresh.train_step(batch2).loss
            export_to(fresh, d / "step2_loaded.safetensors", args.bucket_bytes, rank0)
        results[name] = r
    if rank0:
        (out / "results.json").write_text(json.dumps(results, indent=2))
    destroy_process_groups()


if __name__ == "__main__":
    main()
