"""megatron_patches bookkeeping: version pin, revert, no-op on CUDA hosts."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cpu


def test_version_pin_refuses_other_release(monkeypatch):
    import megatron_patches

    monkeypatch.setattr(megatron_patches, "megatron_version", lambda: "0.17.0")
    with pytest.raises(megatron_patches.PatchVersionError, match="0.16.1 but 0.17.0"):
        megatron_patches.apply("cuda_synchronize")
    assert "cuda_synchronize" not in megatron_patches.applied()


def test_apply_and_revert_restore_torch():
    import torch

    import megatron_patches

    orig_sync, orig_cuda = torch.cuda.synchronize, torch.Tensor.cuda
    megatron_patches.apply("cuda_synchronize")
    megatron_patches.apply("tensor_cuda")
    try:
        t = torch.ones(2)
        assert t.cuda() is t
        assert torch.cuda.synchronize() is None
    finally:
        megatron_patches.revert("cuda_synchronize")
        megatron_patches.revert("tensor_cuda")
    assert torch.cuda.synchronize is orig_sync and torch.Tensor.cuda is orig_cuda


def test_cuda_host_needs_no_patches():
    import megatron_patches

    assert megatron_patches.apply_all("cuda") == []


def test_every_patch_has_a_reason():
    import megatron_patches

    for p in megatron_patches.PATCHES.values():
        assert p.reason and "\n" not in p.reason
        assert f"``{p.name}``" in megatron_patches.__doc__
