"""Collectives take tensors on their group's device (rhymerl.distributed.devices, rhymerl.distributed.collective_audit).

A one-rank gloo world is declared to take ``lazy`` tensors: a collective handed a CPU tensor
(what an NCCL group would refuse) is caught; one built through ``rhymerl.distributed.devices`` passes and
still computes the right result (bridged to gloo's CPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rhymerl.distributed import devices
from rhymerl.distributed.collective_audit import CollectiveAudit, CollectiveDeviceError, lazy_device
from rhymerl.distributed.collectives import all_reduce_max

pytestmark = pytest.mark.cpu


@pytest.fixture
def lazy_gloo(one_rank_gloo):
    devices.declare_backend_device("gloo", lazy_device())
    audit = CollectiveAudit(own_packages=("rhymerl", __name__)).install()
    try:
        yield audit
    finally:
        audit.uninstall()
        devices.declare_backend_device("gloo", None)


def test_collectives_module_puts_its_tensor_on_the_group_device(lazy_gloo):
    assert devices.collective_device() == torch.device("lazy")
    assert all_reduce_max(3) == 3
    assert lazy_gloo.summary() == {"checked": {"all_reduce/own": 1}, "bridged": 1}


def test_a_tensor_on_another_device_is_refused_with_its_call_site(lazy_gloo):
    with pytest.raises(CollectiveDeviceError, match=r"all_reduce\(tensor=...\) from .*test_devices.py.*tensor on cpu, "
                                                    r"but the group's gloo backend takes lazy"):
        dist.all_reduce(torch.ones(1))
    parts = [torch.empty(2, device="lazy")]
    dist.all_gather(parts, devices.to_collective(torch.tensor([1.0, 2.0])))
    assert parts[0].cpu().tolist() == [1.0, 2.0]


def test_backend_devices():
    assert devices.compute_device("gloo") == torch.device("cpu")
    assert devices.backend_device("gloo") == torch.device("cpu")
    devices.declare_backend_device("nccl", "cpu")
    try:
        assert devices.backend_device("nccl") == torch.device("cpu")
    finally:
        devices.declare_backend_device("nccl", None)
    with pytest.raises(ValueError, match="unknown torch.distributed backend"):
        devices.backend_device("carrier-pigeon")


def test_set_cpu_threads_works_where_torch_set_num_threads_is_a_no_op(monkeypatch):
    # What a built vLLM CPU engine leaves behind: torch.set_num_threads replaced by a no-op.
    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    want = 2 if before != 2 else 1
    try:
        torch.set_num_threads(want)
        assert torch.get_num_threads() == before
        devices.set_cpu_threads(want)
        assert torch.get_num_threads() == want
    finally:
        devices.set_cpu_threads(before)
    with pytest.raises(ValueError, match=">= 1"):
        devices.set_cpu_threads(0)


def test_a_rank_computes_on_the_gpu_its_local_rank_names():
    # Every task sees the node's 8 GPUs: rank i of the node takes cuda:i.
    assert [devices.rank_cuda_index(i, 8, "0,1,2,3,4,5,6,7") for i in range(8)] == list(range(8))
    # Per-task binding (one GPU visible): that one, whatever the local rank.
    assert devices.rank_cuda_index(5, 1, "5") == 0
    assert devices.visible_device_count("2,3", 8) == 2 and devices.visible_device_count(None, 8) == 8
    with pytest.raises(devices.DeviceBindingError, match=r"LOCAL_RANK=5 but this task sees 4 GPUs "
                                                         r"\(CUDA_VISIBLE_DEVICES=0,1,2,3\).*--gpu-bind=none"):
        devices.rank_cuda_index(5, 4, "0,1,2,3")
    with pytest.raises(devices.DeviceBindingError, match="sees no GPU"):
        devices.rank_cuda_index(0, 0, "")


@pytest.fixture
def rank_on_gpu3():
    devices.set_rank_device(torch.device("cuda", 3))
    try:
        yield
    finally:
        devices.set_rank_device(None)


def test_nccl_collectives_are_held_to_the_ranks_own_gpu_not_the_current_one(rank_on_gpu3):
    """A library that moved the current device (vLLM's worker sets it) must not move what the
    audit expects: an NCCL tensor on another GPU is this rank's error, even if it is current."""
    assert devices.native_backend_device("nccl") == torch.device("cuda", 3)
    assert devices.backend_device("nccl") == torch.device("cuda", 3)
    from rhymerl.distributed.collective_audit import _same_device

    assert not _same_device(torch.device("cuda", 0), devices.native_backend_device("nccl"))


def test_object_collectives_of_an_nccl_world_go_over_a_gloo_group(one_rank_gloo):
    """Pickled messages (HistoPipe's progress exchange, gathered samples, checkpoint votes) would
    round-trip through CUDA tensors over NCCL: the trainer's comm takes the world's gloo group."""
    from rhymerl.distributed.process_groups import cpu_world_group, world_comm

    group = cpu_world_group("nccl")
    assert group is not dist.group.WORLD and dist.get_backend(group) == "gloo"
    assert cpu_world_group("gloo") is dist.group.WORLD

    class Groups:
        rank, world_size, cpu = 0, 1, group

    comm = world_comm(Groups())
    assert comm.group is group
