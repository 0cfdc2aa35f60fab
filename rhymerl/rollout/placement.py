"""Where each rank's rollout engine runs: independent instances via vLLM's external launcher."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class EnginePlacementError(ValueError):
    """A rollout layout the ranks cannot form; the message names the key to change."""


@dataclass(frozen=True)
class EnginePlacement:
    world_size: int
    rank: int
    local_rank: int
    tensor_parallel: int

    @property
    def num_instances(self) -> int:
        return self.world_size // self.tensor_parallel

    @property
    def instance(self) -> int:
        return self.rank // self.tensor_parallel

    @property
    def engine_rank(self) -> int:
        """This rank's place inside its instance (0 speaks for the instance)."""
        return self.rank % self.tensor_parallel

    @property
    def external_launcher(self) -> bool:
        return self.world_size > 1

    def vllm_args(self) -> dict:
        """The parallel arguments of ``vllm.LLM`` for this rank's engine."""
        if not self.external_launcher:
            return {"tensor_parallel_size": self.tensor_parallel}
        # No data_parallel_size: the instances are independent (vLLM's "external DP").
        return {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": self.tensor_parallel}

    def launcher_env(self) -> dict[str, str]:
        """The environment vLLM's external launcher reads (rank, and the device index)."""
        return {"RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank), "WORLD_SIZE": str(self.world_size)}


def engine_placement(world_size: int, rank: int, local_rank: int, tensor_parallel: int,
                  ranks_per_node: Optional[int] = None) -> EnginePlacement:
    """The layout of ``rank``'s engine, checked: instances tile the world and none spans two nodes."""
    if tensor_parallel < 1:
        raise EnginePlacementError(f"rollout.tensor_parallel: must be >= 1, got {tensor_parallel}")
    if world_size % tensor_parallel:
        raise EnginePlacementError(f"rollout.tensor_parallel={tensor_parallel} does not divide the world size "
                                f"{world_size}")
    if not 0 <= rank < world_size:
        raise EnginePlacementError(f"rank {rank} is outside the world of {world_size} ranks")
    if ranks_per_node and world_size > ranks_per_node and ranks_per_node % tensor_parallel:
        raise EnginePlacementError(f"rollout.tensor_parallel={tensor_parallel} does not divide the {ranks_per_node} "
                                "ranks of a node: an engine would span two nodes; choose a divisor of the "
                                "GPUs per node")
    return EnginePlacement(world_size=world_size, rank=rank, local_rank=local_rank, tensor_parallel=tensor_parallel)
