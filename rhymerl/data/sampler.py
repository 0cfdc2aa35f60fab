"""Resumable epoch sampler: each epoch's order is a function of (seed, epoch); state is (epoch, position)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Batch:
    epoch: int
    step_in_epoch: int
    indices: list[int]


class EpochSampler:
    def __init__(self, num_items: int, batch_size: int, seed: int, shuffle: bool = True):
        if num_items < 1:
            raise ValueError("EpochSampler: the dataset is empty")
        if batch_size < 1:
            raise ValueError("EpochSampler: batch_size must be >= 1")
        self.num_items = num_items
        # A batch larger than the dataset is clamped: every epoch visits every prompt once.
        self.batch_size = min(batch_size, num_items)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    @property
    def steps_per_epoch(self) -> int:
        # Full batches only, so every step has the same shape; the tail rotates with the order.
        return self.num_items // self.batch_size

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_items))
        rng = np.random.default_rng([self.seed, epoch])
        return rng.permutation(self.num_items).tolist()

    @property
    def next_epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self.epoch + 1 if self.position >= self.steps_per_epoch else self.epoch

    def next_batch(self) -> Batch:
        if self.position >= self.steps_per_epoch:
            self.epoch += 1
            self.position = 0
        start = self.position * self.batch_size
        idx = self.order(self.epoch)[start:start + self.batch_size]
        b = Batch(self.epoch, self.position, idx)
        self.position += 1
        return b

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "num_items": self.num_items,
                "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_items", "batch_size", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state was saved with {key}={state[key]!r}, now {getattr(self, key)!r}: "
                                 f"the dataset or data config changed since the checkpoint")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
