"""The interface every training backend (Megatron, DeepSpeed) implements.

The trainer only talks to this interface, so the RL loop, checkpointing and
resharding are backend-agnostic. Process groups are passed in explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Iterator, Optional, Protocol

import torch


@dataclass
class PolicyBatch:
    """One rollout batch as the trainer sees it, already padded.

    Row i is prompt tokens followed by response tokens; only response positions are
    trained. All tensors live on CPU; backends move them where they need them.
    """

    input_ids: torch.Tensor          # [B, T] int64, prompt + response, right-padded
    response_mask: torch.Tensor      # [B, T] float, 1 where the token at t is a response token
    advantages: torch.Tensor         # [B] float, one per response
    # [B, T] float, log p_old(token_t | <t) at response positions (0 elsewhere). None: the step is
    # on-policy and the loss takes them, detached, from its own forward (no separate pass).
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
        """[B, T] log p(token_t | tokens_<t) under the current weights (0 at non-response positions).
        Identical on every rank of the model-parallel group after the call."""

    def train_step(self, batch: PolicyBatch) -> StepMetrics:
        """One optimiser step (micro-batched by token budget) on the policy loss."""

    def export_hf_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named tensors in buckets of at most ``bucket_bytes`` (one tensor may exceed it alone).
        Collective: every rank must iterate it; all ranks receive the same buckets."""

    def save_checkpoint(self, folder: Path) -> None:
        """Model + optimizer + LR scheduler state into ``folder`` (collective)."""

    def load_checkpoint(self, folder: Path) -> None:
        """Inverse of save_checkpoint; may reshard (a different TP/PP than at save time)."""
