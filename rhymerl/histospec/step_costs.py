"""The step-cost prior the goodput rule prices drafts with before (or instead of) measuring."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepCosts:
    """A step-time prior in milliseconds (``goodput.StepCostModel``'s terms), and where it comes from."""
    fixed_ms: float
    per_request_ms: float
    per_token_ms: float
    per_drafting_request_ms: float = 0.0
    # CPU time the proposer spends finding one request's chain (the host's, whatever the device).
    search_us: float = 12.0
    source: str = ""


# The embedded run's host (``bench step --calibrate``: rows at 256-token contexts, drafts up to 8
# tokens), a row at its sampled cost.
CPU_PRIOR = StepCosts(fixed_ms=30.25, per_request_ms=1.25, per_token_ms=1.882, per_drafting_request_ms=0.0191,
                      source="the CPU prior")


def roofline_costs(cm, context_tokens: float) -> StepCosts:
    """The step costs of a decode roofline (``DecodeCostModel``) at rows of ``context_tokens``."""
    return StepCosts(fixed_ms=round(1e3 * cm.a, 3), per_request_ms=round(1e3 * cm.c * context_tokens, 4),
                     per_token_ms=round(1e3 * cm.b, 4),
                     source=f"the decode roofline at a {int(context_tokens)}-token context")
