"""vLLM rollout engine: generate with a speculative method, in-place weight updates, metrics."""

from rhymerl.rollout.engine import Response, RolloutEngine, RolloutError, RolloutResult, SamplingSpec

__all__ = ["Response", "RolloutEngine", "RolloutError", "RolloutResult", "SamplingSpec"]
