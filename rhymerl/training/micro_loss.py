"""The policy loss of one micro-batch, shared by every training backend.

On-policy steps (one optimiser update per rollout batch) carry no old log-probs: the
policy that sampled is the one being trained, so the old log-probs are this forward's own,
detached. The ratio is then exactly 1 and the gradient the one a separate no-grad pass
would give, without that pass. The engine/trainer log-prob check then also reads this
forward.
"""

from __future__ import annotations

from typing import Callable

import torch

from rhymerl.algorithms.losses import policy_loss, rows_without_loss
from rhymerl.config import AlgorithmConfig
from rhymerl.training.microbatch import row_lengths

# Keys of the engine/trainer agreement in a micro-batch's metrics (merged as max / token mean).
ENGINE_DIFF_MAX = "engine_lp_diff_max"
ENGINE_DIFF_MEAN = "engine_lp_diff_mean"


def micro_batch_loss(loss_fn: Callable, logprobs: torch.Tensor, mb: dict, cfg: AlgorithmConfig,
                     num_tokens: float, num_sequences: float) -> tuple[torch.Tensor, dict[str, float]]:
    """``loss_fn`` (``policy_loss``'s signature) on one micro-batch from ``policy_micro_batches``."""
    dev = logprobs.device
    mask = mb["mask"].to(dev)
    old = mb["old"].to(dev) if "old" in mb else logprobs.detach()
    loss, metrics = loss_fn(logprobs, old, mb["advantages"].to(dev), mask, cfg,
                            mb["ref"].to(dev) if "ref" in mb else None,
                            num_tokens=num_tokens, num_sequences=num_sequences)
    metrics = {k: float(v) for k, v in metrics.items()}
    if "engine" in mb:
        with torch.no_grad():
            valid = mask > 0
            d = (mb["engine"].to(dev, torch.float64) - logprobs.detach().double()).abs()[valid]
            if d.numel():
                mx, mean = torch.stack([d.max(), d.mean()]).tolist()
            else:
                mx = mean = 0.0
        metrics[ENGINE_DIFF_MAX] = mx
        metrics[ENGINE_DIFF_MEAN] = mean
    return loss, metrics


def rows_to_train(batch, cfg: AlgorithmConfig, loss_fn: Callable):
    """The part of ``batch`` (a ``PolicyBatch``) a train step runs, and how many rows it
    leaves out. With the built-in ``policy_loss`` and ``cfg.skip_zero_advantage_rows``, rows
    whose loss term and gradient are zero whatever the weights (``rows_without_loss``: zero
    advantage, no KL term) are not run; the caller takes the loss's normalisers from the whole
    batch first, so the gradient is the whole batch's. If no row is left, the shortest one
    stays (its loss and gradient are zero): the step then still runs its schedule, the same
    collectives on every rank, the optimiser's update (Adam's moments move the weights even
    at a zero gradient) and the engine/trainer log-prob check, at the price of one row."""
    if loss_fn is not policy_loss or not cfg.skip_zero_advantage_rows:
        return batch, 0
    idle = rows_without_loss(batch.advantages, batch.response_mask, cfg, batch.ref_logprobs is not None)
    if not bool(idle.any()):
        return batch, 0
    keep = (~idle).nonzero().flatten()
    if keep.numel() == 0:
        keep = row_lengths(batch.response_mask).argmin().reshape(1)
    return batch.rows(keep), int(idle.shape[0] - keep.numel())


def engine_mismatch(extra: dict) -> dict[str, float]:
    """Take the engine/trainer agreement out of a step's merged metrics, in the shape of
    ``logprob_mismatch`` (max_abs, mean_abs, tokens)."""
    return {"max_abs": float(extra.pop(ENGINE_DIFF_MAX, 0.0)), "mean_abs": float(extra.pop(ENGINE_DIFF_MEAN, 0.0)),
            "tokens": float(extra.get("tokens", 0.0))}
