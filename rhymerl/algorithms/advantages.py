"""Advantages for GRPO/DAPO on per-response verifiable rewards (pure NumPy); a group is one prompt's."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable, Sequence

import numpy as np

if TYPE_CHECKING:
    from rhymerl.config import AlgorithmConfig


def _group_index(group_ids: Sequence[Hashable]) -> tuple[np.ndarray, int]:
    """Map arbitrary group ids to 0..G-1 in order of first appearance."""
    seen: dict[Hashable, int] = {}
    idx = np.empty(len(group_ids), dtype=np.int64)
    for i, g in enumerate(group_ids):
        idx[i] = seen.setdefault(g, len(seen))
    return idx, len(seen)


def group_advantages(rewards: Sequence[float] | np.ndarray, group_ids: Sequence[Hashable] | None = None, *,
                     scale_by_std: bool = True, eps: float = 1e-6) -> np.ndarray:
    """GRPO advantages ``(r - mean_group) / (std_group + eps)`` (ddof=1), float64 of the input's shape.
    ``rewards`` is flat with ``group_ids``, or 2-D ``[groups, n]`` with None. ``scale_by_std=False`` only
    centres (Dr. GRPO). Singleton groups and groups of equal rewards get exactly 0."""
    r = np.asarray(rewards, dtype=np.float64)
    if group_ids is None:
        if r.ndim != 2:
            raise ValueError(f"rewards of shape {r.shape}: pass group_ids, or a 2-D [groups, n] array")
        flat = group_advantages(r.reshape(-1), np.repeat(np.arange(r.shape[0]), r.shape[1]),
                                scale_by_std=scale_by_std, eps=eps)
        return flat.reshape(r.shape)
    if r.ndim != 1 or len(group_ids) != r.shape[0]:
        raise ValueError(f"rewards ({r.shape}) and group_ids ({len(group_ids)}) must be flat and equally long")
    if r.size == 0:
        return r.copy()
    idx, g = _group_index(group_ids)
    count = np.bincount(idx, minlength=g).astype(np.float64)
    mean = np.bincount(idx, weights=r, minlength=g) / count
    centred = r - mean[idx]
    if not scale_by_std:
        out = centred
    else:
        sq = np.bincount(idx, weights=centred * centred, minlength=g)
        std = np.sqrt(sq / np.maximum(count - 1.0, 1.0))
        out = centred / (std[idx] + eps)
    out[count[idx] < 2] = 0.0
    # Exactly 0 for equal rewards (the mean can differ in the last bit), so training can skip the rows.
    lo = np.full(g, np.inf)
    hi = np.full(g, -np.inf)
    np.minimum.at(lo, idx, r)
    np.maximum.at(hi, idx, r)
    out[(lo == hi)[idx]] = 0.0
    return out


def overlong_penalty(lengths: Sequence[int] | np.ndarray, max_tokens: int, buffer: int,
                     penalty: float = 1.0) -> np.ndarray:
    """DAPO's soft overlong punishment: 0 up to ``max_tokens - buffer``, then linearly down to ``-penalty``."""
    n = np.asarray(lengths, dtype=np.float64)
    if buffer <= 0:
        return np.zeros_like(n)
    if buffer >= max_tokens:
        raise ValueError(f"overlong buffer {buffer} must be smaller than max_tokens {max_tokens}")
    start = max_tokens - buffer
    return -penalty * np.clip((n - start) / buffer, 0.0, 1.0)


def shape_overlong(rewards: Sequence[float] | np.ndarray, lengths: Sequence[int] | np.ndarray, max_tokens: int,
                   buffer: int, penalty: float = 1.0) -> np.ndarray:
    """``rewards + overlong_penalty(lengths, ...)``."""
    r = np.asarray(rewards, dtype=np.float64)
    return r + overlong_penalty(lengths, max_tokens, buffer, penalty)


def compute_advantages(rewards: Sequence[float] | np.ndarray, group_ids: Sequence[Hashable],
                       lengths: Sequence[int] | np.ndarray, cfg: "AlgorithmConfig", max_tokens: int, *,
                       eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """Overlong shaping, then GRPO normalisation. Returns ``(advantages, shaped_rewards)``."""
    shaped = shape_overlong(rewards, lengths, max_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
    return group_advantages(shaped, group_ids, scale_by_std=cfg.scale_by_std, eps=eps), shaped


@dataclass
class GroupFilter:
    """Which groups dynamic sampling keeps, and what it dropped."""

    keep_mask: np.ndarray  # per response, True where its group is kept
    kept_groups: list[Hashable]
    dropped_groups: list[Hashable]
    # Dropped groups by their common reward: all-solved vs all-failed.
    dropped_by_reward: dict[float, int] = field(default_factory=dict)

    @property
    def num_dropped(self) -> int:
        return len(self.dropped_groups)


def filter_groups(rewards: Sequence[float] | np.ndarray, group_ids: Sequence[Hashable], *,
                  tol: float = 0.0) -> GroupFilter:
    """DAPO dynamic sampling: drop groups whose rewards are all equal (within ``tol``): no gradient."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or len(group_ids) != r.shape[0]:
        raise ValueError(f"rewards ({r.shape}) and group_ids ({len(group_ids)}) must be flat and equally long")
    idx, g = _group_index(group_ids)
    order: list[Hashable] = [None] * g  # type: ignore[list-item]
    for i, gid in zip(idx, group_ids):
        order[i] = gid
    hi = np.full(g, -np.inf)
    lo = np.full(g, np.inf)
    np.maximum.at(hi, idx, r)
    np.minimum.at(lo, idx, r)
    keep_group = (hi - lo) > tol
    dropped_by: dict[float, int] = {}
    for j in np.flatnonzero(~keep_group):
        key = float(lo[j])
        dropped_by[key] = dropped_by.get(key, 0) + 1
    return GroupFilter(keep_mask=keep_group[idx], kept_groups=[order[j] for j in range(g) if keep_group[j]],
                       dropped_groups=[order[j] for j in range(g) if not keep_group[j]], dropped_by_reward=dropped_by)


class DynamicSamplingBuffer:
    """Gathers informative groups until ``target_groups`` or ``max_rounds``; drops overflow (off-policy next step)."""

    def __init__(self, target_groups: int, max_rounds: int, *, keep_overflow: bool = False, tol: float = 0.0):
        if target_groups < 1:
            raise ValueError(f"target_groups must be >= 1, got {target_groups}")
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
        self.target_groups = target_groups
        self.max_rounds = max_rounds
        self.keep_overflow = keep_overflow
        self.tol = tol
        self._groups: list[Any] = []
        self._rounds = 0
        self._step_seen = 0
        self._step_dropped = 0
        self.totals = {"seen_groups": 0, "kept_groups": 0, "dropped_groups": 0, "rounds": 0, "short_steps": 0}
        self.last_step: dict[str, float] = {}

    @classmethod
    def from_config(cls, cfg: "AlgorithmConfig", target_groups: int) -> "DynamicSamplingBuffer":
        """``target_groups``: the step's prompt count; up to ``1 + cfg.max_refill_rounds`` batches are drawn."""
        return cls(target_groups, 1 + cfg.max_refill_rounds)

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def rounds(self) -> int:
        """Rollout batches added in the current step."""
        return self._rounds

    @property
    def ready(self) -> bool:
        return len(self._groups) >= self.target_groups or self._rounds >= self.max_rounds

    def begin_step(self) -> None:
        self._rounds = 0
        self._step_seen = 0
        self._step_dropped = 0

    def add(self, groups: Sequence[Any], rewards: Sequence[Sequence[float]]) -> GroupFilter:
        """Add one rollout batch; keeps groups with non-constant rewards. Returns the filter."""
        if len(groups) != len(rewards):
            raise ValueError(f"{len(groups)} groups but {len(rewards)} reward lists")
        flat = [float(x) for rs in rewards for x in rs]
        ids = [i for i, rs in enumerate(rewards) for _ in rs]
        f = filter_groups(flat, ids, tol=self.tol)
        kept = set(f.kept_groups)
        self._groups.extend(g for i, g in enumerate(groups) if i in kept)
        self._rounds += 1
        self._step_seen = self._step_seen + len(groups)
        self._step_dropped = self._step_dropped + f.num_dropped
        self.totals["seen_groups"] += len(groups)
        self.totals["kept_groups"] += len(kept)
        self.totals["dropped_groups"] += f.num_dropped
        self.totals["rounds"] += 1
        return f

    def take(self) -> list[Any]:
        """The step's batch: up to ``target_groups`` groups, in the order they were kept."""
        batch, rest = self._groups[: self.target_groups], self._groups[self.target_groups :]
        self._groups = rest if self.keep_overflow else []
        if len(batch) < self.target_groups:
            self.totals["short_steps"] += 1
        seen = self._step_seen
        self.last_step = {"rounds": float(self._rounds), "kept_groups": float(len(batch)),
                          "dropped_groups": float(self._step_dropped),
                          "drop_fraction": float(self._step_dropped) / seen if seen else 0.0}
        self.begin_step()
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"target_groups": self.target_groups, "max_rounds": self.max_rounds, "keep_overflow": self.keep_overflow,
                "groups": copy.deepcopy(self._groups), "rounds": self._rounds, "step_seen": self._step_seen,
                "step_dropped": self._step_dropped, "totals": dict(self.totals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("target_groups", "max_rounds"):
            if state[key] != getattr(self, key):
                # A resumed run with another batch size would silently train on a mixed batch.
                raise ValueError(f"dynamic-sampling checkpoint has {key}={state[key]}, "
                                 f"this run has {getattr(self, key)}")
        self._groups = copy.deepcopy(list(state["groups"]))
        self._rounds = int(state["rounds"])
        self._step_seen = int(state.get("step_seen", 0))
        self._step_dropped = int(state.get("step_dropped", 0))
        self.totals = dict(state["totals"])
