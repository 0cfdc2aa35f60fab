"""The policy loss of one micro-batch, shared by every training backend."""

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
    """``loss_fn`` on one micro-batch; on-policy, this forward's detached log-probs are the old ones."""
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
    """(rows to run, rows skipped): ``rows_without_loss`` are skipped, keeping the shortest if none is left."""
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
    """Take the engine/trainer agreement out of a step's metrics, shaped as ``logprob_mismatch``'s."""
    return {"max_abs": float(extra.pop(ENGINE_DIFF_MAX, 0.0)), "mean_abs": float(extra.pop(ENGINE_DIFF_MEAN, 0.0)),
            "tokens": float(extra.get("tokens", 0.0))}
