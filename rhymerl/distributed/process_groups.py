"""Process groups for training (torch.distributed, megatron's TP/PP/DP), created once and passed explicitly."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rhymerl.config import ParallelConfig
from rhymerl.distributed.devices import bind_rank_device, collective_device, compute_device


@dataclass
class ProcessGroups:
    world_size: int
    rank: int
    tp: Any
    pp: Any
    dp: Any
    mp: Any              # TP x PP: the ranks that hold one full model copy
    embd: Any            # first + last pipeline stage (tied embeddings), or None
    pos_embd: Any
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    dist_backend: str
    cpu: Any = None  # gloo over the world for object collectives (on NCCL they would go through CUDA)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def collective_device(self, group: Any) -> torch.device:
        """The device ``group``'s collectives take (``device`` is where the model computes)."""
        return collective_device(group)

    def pp_global_rank(self, stage: int) -> int:
        return dist.get_process_group_ranks(self.pp)[stage]

    def megatron_collection(self):
        """megatron's ProcessGroupCollection over these groups (for schedules and grad finalisation)."""
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgc = ProcessGroupCollection()
        pgc.tp, pgc.pp, pgc.embd, pgc.pos_embd = self.tp, self.pp, self.embd, self.pos_embd
        pgc.cp = ps.get_context_parallel_group()
        pgc.dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        return pgc


def _resolve_backend(parallel_cfg: ParallelConfig) -> str:
    if parallel_cfg.dist_backend != "auto":
        return parallel_cfg.dist_backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_groups(parallel_cfg: ParallelConfig, world_size: int, rank: int,
                        apply_patches: bool = True) -> ProcessGroups:
    """Start torch.distributed if needed and build megatron's groups (on gloo, ``megatron_patches`` too)."""
    tp, pp = parallel_cfg.tensor_parallel, parallel_cfg.pipeline_parallel
    if world_size % (tp * pp) != 0:
        raise ValueError(f"parallel.tensor_parallel*pipeline_parallel={tp * pp} does not divide the world size {world_size}")
    dp = world_size // (tp * pp)
    backend = _resolve_backend(parallel_cfg)
    if not dist.is_initialized():
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if world_size > 1 and key not in os.environ:
                raise ValueError(f"{key} is not set: launch with torchrun/srun or export {key} for {world_size} ranks")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        if backend == "nccl":
            bind_rank_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, world_size=world_size, rank=rank, timeout=timedelta(minutes=10))
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ValueError(f"torch.distributed already runs with world {dist.get_world_size()} rank {dist.get_rank()}, "
                         f"not {world_size}/{rank}")
    device = compute_device(backend)
    cpu_group = cpu_world_group(backend)
    if parallel_cfg.backend == "deepspeed":
        # ZeRO is data parallel only: no megatron groups (and no megatron import).
        if tp != 1 or pp != 1:
            raise ValueError("parallel.backend: deepspeed shards with ZeRO only; set tensor_parallel=1 and pipeline_parallel=1")
        world = dist.group.WORLD
        return ProcessGroups(world_size=world_size, rank=rank, tp=None, pp=None, dp=world, mp=None, embd=None,
                             pos_embd=None, tp_size=1, pp_size=1, dp_size=world_size, tp_rank=0, pp_rank=0,
                             dp_rank=rank, device=device, dist_backend=backend, cpu=cpu_group)
    import megatron_patches
    from megatron.core import parallel_state as ps

    if backend == "gloo" and apply_patches:
        megatron_patches.apply_all("cpu")
    if ps.model_parallel_is_initialized():
        if ps.get_tensor_model_parallel_world_size() != tp or ps.get_pipeline_model_parallel_world_size() != pp:
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return ProcessGroups(
        world_size=world_size, rank=rank, tp=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(), dp=ps.get_data_parallel_group(), mp=ps.get_model_parallel_group(),
        embd=ps.get_embedding_group(check_initialized=False),
        pos_embd=ps.get_position_embedding_group(check_initialized=False), tp_size=tp, pp_size=pp, dp_size=dp,
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(), device=device, dist_backend=backend, cpu=cpu_group)


def cpu_world_group(backend: str) -> Any:
    """A gloo group over the world (the world itself on gloo). Collective: every rank calls it, in order."""
    if backend == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def world_comm(groups: ProcessGroups):
    """The trainer's object collectives, over the CPU group."""
    from rhymerl.distributed.collectives import WorldComm

    return WorldComm(rank=groups.rank, world_size=groups.world_size, group=groups.cpu)


def destroy_process_groups() -> None:

    if "megatron.core" in sys.modules:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
