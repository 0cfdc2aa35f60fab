"""How much history a rank keeps, and which visits go first when it is full."""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

STORED_BYTES_PER_TOKEN = 4  # token ids are kept as int32 arrays (see store.py)


@dataclass(frozen=True)
class BudgetPlan:
    token_budget: int
    needed_tokens: int  # epochs_kept visits of every prompt, every response at max_tokens
    memory_tokens: int  # what the memory allowance holds
    covers_dataset: bool

    def describe(self) -> str:
        if self.covers_dataset:
            return (f"history budget {self.token_budget:,} tokens: every prompt's last visits fit "
                    f"(worst case {self.needed_tokens:,}; memory allows {self.memory_tokens:,})")
        return (f"history budget {self.token_budget:,} tokens (memory-bound): a full dataset of history may need "
                f"{self.needed_tokens:,}; prompts whose visits are evicted get no history drafts or length predictions")


def available_memory_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - psutil is a dependency, but sysconf is enough where it fails
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def plan_token_budget(num_prompts: int, n: int, max_tokens: int, epochs_kept: int, available_bytes: int,
                      ranks_per_node: int = 1, memory_fraction: float = 0.25,
                      bytes_per_token: int = STORED_BYTES_PER_TOKEN) -> BudgetPlan:
    if min(num_prompts, n, max_tokens, epochs_kept, ranks_per_node, bytes_per_token) < 1:
        raise ValueError("plan_token_budget: prompts, n, max_tokens, epochs_kept, ranks_per_node and "
                         "bytes_per_token must all be >= 1")
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"histospec.memory_fraction must be in (0, 1] (got {memory_fraction})")
    needed = num_prompts * n * max_tokens * epochs_kept
    memory = int(memory_fraction * max(0, available_bytes) / ranks_per_node / bytes_per_token)
    budget = max(1, min(needed, memory))
    return BudgetPlan(budget, needed, memory, needed <= memory)


class VisitBudget:
    """(prompt, epoch) visits in insertion order with their token counts; evicts oldest first."""

    def __init__(self, token_budget: int):
        if token_budget < 1:
            raise ValueError(f"history token budget must be >= 1 (got {token_budget})")
        self.token_budget = int(token_budget)
        self._visits: OrderedDict[tuple[int, int], int] = OrderedDict()
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._visits)

    def __iter__(self):
        return iter(self._visits)

    def __contains__(self, visit: tuple[int, int]) -> bool:
        return visit in self._visits

    def add(self, key: int, epoch: int, num_tokens: int) -> list[tuple[int, int]]:
        """Record a visit (or more tokens of one); returns the visits to evict, oldest first."""
        v = (int(key), int(epoch))
        self._visits[v] = self._visits.get(v, 0) + int(num_tokens)
        self.num_tokens += int(num_tokens)
        return self._over_budget(keep=v)

    def load(self, key: int, epoch: int, num_tokens: int) -> None:
        """Record a visit read from a file (``evict_over_budget`` runs once all are read)."""
        v = (int(key), int(epoch))
        self._visits[v] = self._visits.get(v, 0) + int(num_tokens)
        self.num_tokens += int(num_tokens)

    def remove(self, key: int, epoch: int) -> None:
        self.num_tokens -= self._visits.pop((int(key), int(epoch)), 0)

    def _over_budget(self, keep: Optional[tuple[int, int]]) -> list[tuple[int, int]]:
        out = []
        visits = self._visits
        while self.num_tokens > self.token_budget and len(visits) > 1:
            v = next(iter(visits))
            if v == keep:
                visits.move_to_end(v)  # the newest visit stays even when it alone exceeds the budget
                continue
            out.append(v)
            self.remove(*v)
        return out

    def evict_over_budget(self) -> list[tuple[int, int]]:
        return self._over_budget(keep=None)
