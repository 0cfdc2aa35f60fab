"""`rhymerl export`: which checkpoint a run folder designates, what the export carries and who may
read it. Checkpoints are written by the real CheckpointManager with a backend save that writes the
backend protocol's files (no model weights needed to choose one)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from rhymerl.outputs.checkpoint import CheckpointManager
from rhymerl.config import CheckpointConfig
from rhymerl.resharding.hf_export import ExportError, _share_like_umask, _step_of_backend, find_backend_checkpoint
from rhymerl.training.backend_checkpoint import BACKEND_META, hf_side_files

pytestmark = pytest.mark.cpu


def _save(mgr: CheckpointManager, step: int) -> Path:
    def backend_save(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "state.pt").write_bytes(b"weights-%d" % step * 100)
        (folder / BACKEND_META).write_text(json.dumps({"kind": "deepspeed", "steps": step}))

    return mgr.save(step, {"counters": {"step": step}}, backend_save=backend_save, config={})


def test_run_folder_exports_the_latest_verified_checkpoint_not_the_newest_file(tmp_path):
    mgr = CheckpointManager(CheckpointConfig(keep_last=3), run_dir=tmp_path)
    _save(mgr, 2)
    newest = _save(mgr, 4)
    # Step 2's files touched after step 4 was written (a copy, a backup tool, an rsync).
    future = newest.stat().st_mtime + 1000
    for p in (tmp_path / "checkpoints" / "step-000002").rglob("*"):
        os.utime(p, (future, future))
    for root in (tmp_path, tmp_path / "checkpoints"):
        assert find_backend_checkpoint(root) == newest / "backend"
    # The step the export reports having used.
    assert _step_of_backend(find_backend_checkpoint(tmp_path)) == "step-000004"


def test_truncated_checkpoint_is_skipped_or_refused_with_its_name(tmp_path):
    mgr = CheckpointManager(CheckpointConfig(keep_last=3), run_dir=tmp_path)
    _save(mgr, 2)
    newest = _save(mgr, 4)
    f = newest / "backend" / "state.pt"
    f.write_bytes(f.read_bytes()[:10])
    with pytest.warns(UserWarning, match="step-000004"):
        assert find_backend_checkpoint(tmp_path).parent.name == "step-000002"
    with pytest.raises(ExportError, match=r"step-000004 is incomplete or damaged"):
        find_backend_checkpoint(newest)
    with pytest.raises(ExportError, match="no step-\\* checkpoint"):
        find_backend_checkpoint(tmp_path / "checkpoints" / "step-000002" / "state")


def test_export_folder_and_files_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        folder = Path(tempfile.mkdtemp(dir=tmp_path))  # how atomic_folder creates it: 0700
        (folder / "model.safetensors").write_bytes(b"x")
        (folder / "model.safetensors").chmod(0o600)
        _share_like_umask(folder)
    finally:
        os.umask(old)
    assert folder.stat().st_mode & 0o777 == 0o750
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o640


def test_checkpoints_carry_every_tokenizer_side_file(tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "added_tokens.json",
                 "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in hf_side_files(tmp_path)] == [
        "added_tokens.json", "chat_template.jinja", "config.json", "tokenizer.json", "tokenizer_config.json"]


def test_model_without_chat_template_is_refused_when_the_run_wants_one(tiny_model_dir, tmp_path):
    from rhymerl.models import ModelError, check_model_use

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    check_model_use(d, "megatron", chat_template=True)
    tok = json.loads((d / "tokenizer_config.json").read_text())
    tok.pop("chat_template")
    (d / "tokenizer_config.json").write_text(json.dumps(tok))
    with pytest.raises(ModelError, match="has no chat template .* data.chat_template=false"):
        check_model_use(d, "megatron", chat_template=True)
    check_model_use(d, "megatron", chat_template=False)
