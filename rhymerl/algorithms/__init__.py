"""GRPO/DAPO advantages (pure NumPy) and the clipped policy loss (torch, on log-probs)."""

from rhymerl.algorithms.advantages import (DynamicSamplingBuffer, GroupFilter, compute_advantages, filter_groups,
                                           group_advantages, overlong_penalty, shape_overlong)

__all__ = ["DynamicSamplingBuffer", "GroupFilter", "compute_advantages", "filter_groups", "group_advantages",
           "overlong_penalty", "shape_overlong", "policy_loss", "logprob_mismatch", "update_gain"]


def __getattr__(name):
    # torch is imported only when the loss is used, so pure-logic callers stay light.
    if name in ("policy_loss", "logprob_mismatch", "update_gain"):
        from rhymerl.algorithms import losses

        return getattr(losses, name)
    raise AttributeError(name)
