"""Verifiable rewards: math-verify, exact match / reasoning-gym scoring, and a process pool with timeouts."""

from rhymerl.rewards.pool import RewardPool, score_one
from rhymerl.rewards.scorers import (BUILTIN_SCORERS, RewardItem, RewardResult, exact_score, extract_answer, last_boxed,
                                     math_verify_score, resolve_kind)

__all__ = ["BUILTIN_SCORERS", "RewardItem", "RewardPool", "RewardResult", "exact_score", "extract_answer", "last_boxed",
           "math_verify_score", "resolve_kind", "score_one"]
