"""A checkpoint folder on a real, small filesystem (a 1 MB tmpfs, mounted here: needs root),
written by torch's own distributed-checkpoint writer: a save that cannot fit is refused before
it writes, one that runs out of space anyway says so, and either way the previous checkpoint,
``latest`` and resume stay right."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from rhymerl.config import CheckpointConfig
from rhymerl.outputs.checkpoint import CheckpointError, CheckpointManager, verify_checkpoint

pytestmark = [pytest.mark.cpu, pytest.mark.integration]


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _dcp_writer(nbytes: int):
    """A backend save through torch.distributed.checkpoint, as the Megatron backend's."""
    import torch
    import torch.distributed.checkpoint as dcp

    def save(folder: Path) -> None:
        dcp.save({"w": torch.ones(nbytes // 4)}, checkpoint_id=str(folder))

    return save


def _used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_save_that_runs_out_of_space_says_so_and_keeps_the_previous(small_fs, tmp_path):
    mgr = CheckpointManager(CheckpointConfig(dir=str(small_fs)), tmp_path)
    first = mgr.save(1, {"trainer": {"step": 1}}, backend_save=_dcp_writer(100_000))
    # The estimate (the newest checkpoint's size) fits; the writer then needs more than is left.
    with pytest.raises(CheckpointError) as e:
        mgr.save(2, {"trainer": {"step": 2}}, backend_save=_dcp_writer(2_000_000))
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert f"No space left on device in {small_fs}" in msg and "free" in msg, msg
    assert "step-000001, is intact" in msg, msg
    assert verify_checkpoint(first) is None
    assert (small_fs / "latest").read_text().strip() == "step-000001"
    assert not list(small_fs.glob(".tmp-*"))
    assert mgr.find_resume() == first


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_save_that_cannot_fit_is_refused_before_writing(small_fs, tmp_path):
    mgr = CheckpointManager(CheckpointConfig(dir=str(small_fs)), tmp_path)
    first = mgr.save(1, {"trainer": {"step": 1}}, backend_save=_dcp_writer(600_000))
    used = _used(small_fs)
    with pytest.raises(CheckpointError) as e:
        mgr.save(2, {"trainer": {"step": 2}}, backend_save=_dcp_writer(600_000))
    msg = str(e.value)
    assert f"checkpoint {small_fs / 'step-000002'} not saved: No space left on device in {small_fs}" in msg, msg
    assert re.search(r"\(4\d\d\.\d KB free, the checkpoint needs about 6\d\d\.\d KB\)", msg), msg
    assert _used(small_fs) == used and not list(small_fs.glob(".tmp-*"))
    assert verify_checkpoint(first) is None and mgr.find_resume() == first
    # The first save of a folder takes the caller's estimate.
    fresh = CheckpointManager(CheckpointConfig(dir=str(small_fs / "other")), tmp_path)
    with pytest.raises(CheckpointError, match=r"not saved: No space left on device .*needs about 5.0 MB"):
        fresh.save(1, {"trainer": {}}, backend_save=_dcp_writer(100), expected_bytes=5_000_000)
