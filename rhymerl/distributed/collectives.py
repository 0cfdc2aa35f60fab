"""Object collectives over an explicitly passed process group (no-ops on one process)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from rhymerl.distributed.devices import collective_device


@dataclass
class WorldComm:
    rank: int = 0
    world_size: int = 1
    group: Optional[Any] = None  # a torch.distributed ProcessGroup; None = the default group

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.is_distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.is_distributed:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def any_true(self, flag: bool) -> bool:
        if not self.is_distributed:
            return flag
        return bool(all_reduce_max(1 if flag else 0, self.group))

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier(group=self.group)


def all_reduce_max(value: int, group: Optional[Any] = None) -> int:
    """The largest ``value`` over ``group`` (a tensor all-reduce, also on a one-rank group)."""
    # NCCL refuses CPU tensors: the value travels on the group's own device.
    t = torch.tensor([int(value)], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())
