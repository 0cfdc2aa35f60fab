"""The interface every training backend (Megatron, DeepSpeed) implements; the trainer talks only to it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Iterator, Optional, Protocol

import torch


@dataclass
class PolicyBatch:
    """One padded rollout batch (prompt then response per row; CPU tensors, only responses trained)."""

    input_ids: torch.Tensor          # [B, T] int64, prompt + response, right-padded
    response_mask: torch.Tensor      # [B, T] float, 1 where the token at t is a response token
    advantages: torch.Tensor         # [B] float, one per response
    # [B, T] log p_old at response positions; None: on-policy, the loss takes its own forward's.
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None   # [B, T], for a KL term
    engine_logprobs: Optional[torch.Tensor] = None  # [B, T], from the rollout engine (correctness signal)

    def rows(self, index: torch.Tensor) -> "PolicyBatch":
        """The batch of rows ``index`` (a 1-D index tensor): every field is one per row."""
        return replace(self, **{f.name: None if (t := getattr(self, f.name)) is None else t[index]
                                for f in fields(self)})


@dataclass
class StepMetrics:
    loss: float
    grad_norm: float
    lr: float
    extra: dict = field(default_factory=dict)


class TrainingBackend(Protocol):
    def compute_logprobs(self, input_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] log p(token_t | tokens_<t) at response positions (0 elsewhere), the same on every rank."""

    def train_step(self, batch: PolicyBatch) -> StepMetrics:
        """One optimiser step (micro-batched by token budget) on the policy loss."""

    def export_hf_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named tensors in buckets of at most ``bucket_bytes``. Collective: every rank iterates it."""

    def save_checkpoint(self, folder: Path) -> None:
        """Model + optimizer + LR scheduler state into ``folder`` (collective)."""

    def load_checkpoint(self, folder: Path) -> None:
        """Inverse of save_checkpoint; may reshard (a different TP/PP than at save time)."""
