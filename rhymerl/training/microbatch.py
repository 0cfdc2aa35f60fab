"""Splitting a padded batch across data-parallel ranks and into token-budget micro-batches.

Pure tensor logic. Every micro-batch has the same number of rows (pipeline schedules send
fixed-shape activations), so the last one is padded with rows whose mask is zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class MicroBatchPlan:
    rows_per_rank: int        # rows of the global batch each DP rank takes (after padding)
    rows_per_micro: int       # rows per micro-batch
    num_micro: int            # micro-batches per DP rank


def plan_micro_batches(batch_rows: int, seq_len: int, dp_size: int, micro_batch_tokens: int) -> MicroBatchPlan:
    if batch_rows < 1:
        raise ValueError("empty batch")
    per_rank = math.ceil(batch_rows / dp_size)
    rows = max(1, min(per_rank, micro_batch_tokens // max(seq_len, 1)))
    return MicroBatchPlan(per_rank, rows, math.ceil(per_rank / rows))


def pad_rows(t: torch.Tensor, rows: int, value=0) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = torch.full((rows - t.shape[0], *t.shape[1:]), value, dtype=t.dtype)
    return torch.cat([t, pad], dim=0)


def rank_slice(t: torch.Tensor, plan: MicroBatchPlan, dp_rank: int, value=0) -> torch.Tensor:
    """This DP rank's rows, padded to ``rows_per_micro * num_micro``."""
    lo = dp_rank * plan.rows_per_rank
    part = t[lo: lo + plan.rows_per_rank]
    return pad_rows(part, plan.rows_per_micro * plan.num_micro, value)


def split_micro(t: torch.Tensor, plan: MicroBatchPlan) -> list[torch.Tensor]:
    return list(t.split(plan.rows_per_micro, dim=0))


def policy_micro_batches(batch, dp_size: int, dp_rank: int, micro_batch_tokens: int) -> tuple[MicroBatchPlan, list[dict]]:
    """This DP rank's micro-batches of a ``PolicyBatch`` as dicts of input_ids / mask /
    advantages / old (and ref when the batch has reference log-probs)."""
    B, T = batch.input_ids.shape
    plan = plan_micro_batches(B, T, dp_size, micro_batch_tokens)
    fields = {"input_ids": batch.input_ids.long(), "mask": batch.response_mask.float(),
              "advantages": batch.advantages.float(), "old": batch.old_logprobs.float()}
    if batch.ref_logprobs is not None:
        fields["ref"] = batch.ref_logprobs.float()
    split = {k: split_micro(rank_slice(v, plan, dp_rank), plan) for k, v in fields.items()}
    return plan, [{k: split[k][i] for k in split} for i in range(plan.num_micro)]
