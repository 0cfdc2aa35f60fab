"""Splitting a padded batch over DP ranks into token-budget micro-batches of similar-length rows."""

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


def row_lengths(mask: torch.Tensor) -> torch.Tensor:
    """[B] tokens each right-padded row needs: one past its last masked (response) position."""
    pos = torch.arange(1, mask.shape[1] + 1, dtype=torch.long)
    return ((mask > 0).long() * pos).amax(dim=1) if mask.numel() else torch.zeros(mask.shape[0], dtype=torch.long)


def length_order(lengths: torch.Tensor, plan: MicroBatchPlan, dp_size: int) -> torch.Tensor:
    """A permutation of the rows: longest first, dealt round-robin over the DP ranks (stable)."""
    B = lengths.shape[0]
    caps = [max(0, min(plan.rows_per_rank, B - r * plan.rows_per_rank)) for r in range(dp_size)]
    dealt: list[list[int]] = [[] for _ in range(dp_size)]
    ranks = [r for r in range(dp_size) if caps[r] > 0]
    i = 0
    for row in torch.argsort(lengths, descending=True, stable=True).tolist():
        while len(dealt[ranks[i % len(ranks)]]) >= caps[ranks[i % len(ranks)]]:
            i += 1
        dealt[ranks[i % len(ranks)]].append(row)
        i += 1
    return torch.tensor([row for part in dealt for row in part], dtype=torch.long)


def unscored_prefix(mask: torch.Tensor) -> int:
    """Leading positions of a [rows, T] micro-batch whose logits score no response token."""
    cols = (mask > 0).any(dim=0).nonzero()
    return max(int(cols[0]) - 1, 0) if cols.numel() else max(mask.shape[1] - 1, 0)


def trim_columns(micro: dict, lengths: torch.Tensor) -> dict:
    """A micro-batch cut to its longest row; per-row fields (1-D) stay as they are."""
    width = max(int(lengths.max()), 1) if lengths.numel() else 1
    return {k: (v[:, :width] if v.dim() == 2 else v) for k, v in micro.items()}


def split_policy_rows(fields: dict, mask: torch.Tensor, dp_size: int, dp_rank: int, micro_batch_tokens: int,
                      fixed_shape: bool) -> tuple[MicroBatchPlan, torch.Tensor, list[dict]]:
    """This DP rank's (plan, row permutation, micro-batches of ``fields``), cut unless ``fixed_shape``."""
    B, T = mask.shape
    plan = plan_micro_batches(B, T, dp_size, micro_batch_tokens)
    lengths = row_lengths(mask)
    perm = length_order(lengths, plan, dp_size)
    fields = dict(fields, _len=lengths)
    split = {k: split_micro(rank_slice(v[perm], plan, dp_rank), plan) for k, v in fields.items()}
    micro = []
    for i in range(plan.num_micro):
        mb = {k: split[k][i] for k in split}
        lens = mb.pop("_len")
        micro.append(mb if fixed_shape else trim_columns(mb, lens))
    return plan, perm, micro


def unpermute_rows(full: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Rows of a result computed on the permuted batch, back in the batch's order."""
    out = torch.empty_like(full[: perm.shape[0]])
    out[perm] = full[: perm.shape[0]]
    return out


def pad_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    return torch.cat([t, t.new_zeros((t.shape[0], width - t.shape[1], *t.shape[2:]))], dim=1)


def left_pad_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` [B, k] as [B, width], zeros before it."""
    if t.shape[1] == width:
        return t
    return torch.cat([t.new_zeros((t.shape[0], width - t.shape[1], *t.shape[2:])), t], dim=1)


def policy_micro_batches(batch, dp_size: int, dp_rank: int, micro_batch_tokens: int,
                         fixed_shape: bool = True) -> tuple[MicroBatchPlan, list[dict]]:
    """This DP rank's micro-batches of a ``PolicyBatch`` (with ``old`` or else ``engine``, and ``ref``)."""
    fields = {"input_ids": batch.input_ids.long(), "mask": batch.response_mask.float(),
              "advantages": batch.advantages.float()}
    if batch.old_logprobs is not None:
        fields["old"] = batch.old_logprobs.float()
    elif batch.engine_logprobs is not None:
        fields["engine"] = batch.engine_logprobs.float()
    if batch.ref_logprobs is not None:
        fields["ref"] = batch.ref_logprobs.float()
    plan, _, micro = split_policy_rows(fields, batch.response_mask, dp_size, dp_rank, micro_batch_tokens, fixed_shape)
    return plan, micro
