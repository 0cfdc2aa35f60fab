"""Clipped policy-gradient loss (GRPO / DAPO) on sampled tokens' log-probs, never logits (both backends)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from rhymerl.config import AlgorithmConfig


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cfg: AlgorithmConfig, ref_logprobs: Optional[torch.Tensor] = None, *,
                num_tokens: Optional[float] = None,
                num_sequences: Optional[float] = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped loss with DAPO's clip-higher, plus ``kl_coef`` x k3(ref || current) given ``ref_logprobs``.
    ``cfg.loss_agg``: "token" (DAPO) or "sequence" (GRPO) mean; ``advantages``: [batch] or [batch, tokens].
    Split batch: pass global ``num_tokens``/``num_sequences`` for this shard's share. Returns (loss, float metrics)."""
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} "
                         f"and mask {tuple(mask.shape)} must have the same [batch, tokens] shape")
    if logprobs.dim() != 2:
        raise ValueError(f"expected [batch, tokens] log-probs, got shape {tuple(logprobs.shape)}")
    # bf16 cannot count past 256 tokens exactly nor hold ratios near 1 finely: work in >= fp32.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    logprobs = logprobs.to(dtype)
    old_logprobs = old_logprobs.to(dtype)
    if ref_logprobs is not None:
        ref_logprobs = ref_logprobs.to(dtype)
    mask = mask.to(dtype)
    adv = advantages.to(device=logprobs.device, dtype=dtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    elif adv.shape != logprobs.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [batch] or [batch, tokens]")
    old = old_logprobs.detach()

    log_ratio = logprobs - old
    ratio = torch.exp(log_ratio)
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, lo, hi)
    per_token = torch.maximum(unclipped, clipped)

    kl_ref = None
    if ref_logprobs is not None:
        d = ref_logprobs.detach() - logprobs
        kl_ref = torch.exp(d) - d - 1.0
        if cfg.kl_coef:
            per_token = per_token + cfg.kl_coef * kl_ref

    seq_tokens = mask.sum(dim=1)
    if cfg.loss_agg == "token":
        denom = float(num_tokens) if num_tokens is not None else seq_tokens.sum().clamp_min(1.0)
        loss = _masked_sum(per_token, mask) / denom
    elif cfg.loss_agg == "sequence":
        per_seq = (per_token * mask).sum(dim=1) / seq_tokens.clamp_min(1.0)
        denom = float(num_sequences) if num_sequences is not None else max(logprobs.shape[0], 1)
        loss = per_seq.sum() / denom
    else:
        raise ValueError(f"algo.loss_agg: unknown aggregation {cfg.loss_agg!r}; allowed: 'token', 'sequence'")

    with torch.no_grad():
        n = mask.sum().clamp_min(1.0)
        # The clip is active (zero gradient) where the clipped branch is strictly larger.
        active = (clipped > unclipped).to(mask.dtype) * mask
        low = active * (ratio < lo).to(mask.dtype)
        high = active * (ratio > hi).to(mask.dtype)
        k3_old = torch.exp(-log_ratio) - 1.0 + log_ratio
        big = torch.finfo(ratio.dtype).max
        valid = mask > 0
        stats = [active.sum() / n, low.sum() / n, high.sum() / n, _masked_sum(k3_old, mask) / n,
                 _masked_sum(ratio, mask) / n, torch.where(valid, ratio, torch.full_like(ratio, -big)).max(),
                 torch.where(valid, ratio, torch.full_like(ratio, big)).min(),
                 -_masked_sum(logprobs.detach(), mask) / n, mask.sum()]
        # entropy: mean NLL of the sampled tokens, a cheap estimate.
        names = ["clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl",
                 "ratio_mean", "ratio_max", "ratio_min", "entropy", "tokens"]
        if kl_ref is not None:
            stats.append(_masked_sum(kl_ref.detach(), mask) / n)
            names.append("kl_ref")
        values = torch.stack([s.float() for s in stats]).tolist()
    metrics = dict(zip(names, values))
    if not valid.any():
        metrics["ratio_max"] = metrics["ratio_min"] = float("nan")
    return loss, metrics


def rows_without_loss(advantages: torch.Tensor, mask: torch.Tensor, cfg: AlgorithmConfig,
                      has_reference: bool = False) -> torch.Tensor:
    """[B] bool: rows whose ``policy_loss`` term and gradient are zero whatever the weights."""
    if has_reference and cfg.kl_coef:
        return torch.zeros(mask.shape[0], dtype=torch.bool)
    if advantages.dim() == 1:
        return advantages == 0
    return ((advantages != 0) & (mask > 0)).sum(dim=1) == 0


def logprob_mismatch(engine_logprobs: Any, trainer_logprobs: Any, mask: Any) -> dict[str, float]:
    """Max and mean |engine - trainer| log-prob over masked tokens (large: a wrong resharding map)."""
    e = torch.as_tensor(engine_logprobs, dtype=torch.float64)
    t = torch.as_tensor(trainer_logprobs, dtype=torch.float64, device=e.device)
    m = torch.as_tensor(mask, device=e.device) > 0
    if e.shape != t.shape or e.shape != m.shape:
        raise ValueError(f"engine {tuple(e.shape)}, trainer {tuple(t.shape)} and mask {tuple(m.shape)} must match")
    if not m.any():
        return {"max_abs": 0.0, "mean_abs": 0.0, "tokens": 0.0}
    d = (e - t).abs()[m]
    mx, mean = torch.stack([d.max(), d.mean()]).tolist()
    return {"max_abs": mx, "mean_abs": mean, "tokens": float(m.sum().item())}


def update_gain(advantages: Any, before: Any, after: Any, mask: Any) -> float:
    """sum(mask * A * (after - before)) / sum(mask): negative reveals a sign error in advantages or loss."""
    b = torch.as_tensor(before, dtype=torch.float64)
    a = torch.as_tensor(after, dtype=torch.float64, device=b.device)
    m = torch.as_tensor(mask, dtype=torch.float64, device=b.device)
    adv = torch.as_tensor(advantages, dtype=torch.float64, device=b.device)
    if adv.dim() == 1:
        adv = adv[:, None]
    if a.shape != b.shape or m.shape != b.shape or adv.shape[0] != b.shape[0]:
        raise ValueError(f"before {tuple(b.shape)}, after {tuple(a.shape)}, mask {tuple(m.shape)} and "
                         f"advantages {tuple(adv.shape)} must agree on [batch, tokens]")
    n = m.sum()
    if n <= 0:
        return 0.0
    return float((m * adv * (a - b)).sum() / n)
