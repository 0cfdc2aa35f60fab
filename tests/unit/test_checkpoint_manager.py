"""CheckpointManager: atomic saves, rotation, verification, resume selection, corruption."""

from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path

import pytest

from rhymerl.outputs.checkpoint import (
    CheckpointError, CheckpointManager, capture_rng_state, restore_rng_state, verify_checkpoint,
)
from rhymerl.config import CheckpointConfig

pytestmark = pytest.mark.cpu


def _mgr(tmp_path: Path, **kw) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(**kw), run_dir=tmp_path)


def _save(mgr: CheckpointManager, step: int, payload: bytes = b"", **kw) -> Path:
    def backend_save(folder: Path) -> None:
        (folder / "model.pt").write_bytes(b"weights-%d-" % step + payload)
        (folder / "sub").mkdir()
        (folder / "sub" / "optim.pt").write_bytes(os.urandom(64))

    return mgr.save(step, {"history": b"hist-%d" % step, "counters": {"step": step, "epoch": step // 3}},
                    rank_state={"rng": capture_rng_state()}, backend_save=backend_save,
                    config={"model": {"path": "builtin:tiny"}}, **kw)


def test_roundtrip_writes_every_part_and_manifest_last(tmp_path):
    mgr = _mgr(tmp_path)
    path = _save(mgr, 12, b"x" * 1000)
    assert path == tmp_path / "checkpoints" / "step-000012"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-000012"
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"backend/model.pt", "backend/sub/optim.pt", "state/history.bin",
                                      "state/counters.json", "ranks/rank-00000.json", "config.yaml"}
    assert verify_checkpoint(path) is None
    loaded = mgr.load(mgr.find_resume())
    assert loaded.step == 12
    assert loaded.state == {"history": b"hist-12", "counters": {"step": 12, "epoch": 4}}
    assert loaded.config == {"model": {"path": "builtin:tiny"}}
    assert (loaded.backend_dir / "model.pt").read_bytes().startswith(b"weights-12-")
    assert set(loaded.rank_state) == {"rng"}
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_keep_last_deletes_only_older_verified(tmp_path):
    mgr = _mgr(tmp_path, keep_last=2)
    for s in (1, 2, 3, 4):
        _save(mgr, s)
    assert [p.name for _, p in mgr.step_folders()] == ["step-000003", "step-000004"]


def test_truncated_newest_falls_back_with_warning_and_deletes_nothing(tmp_path):
    mgr = _mgr(tmp_path, keep_last=3)
    _save(mgr, 2)
    newest = _save(mgr, 4, b"y" * 4096)
    f = newest / "backend" / "model.pt"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.warns(UserWarning, match=r"step-000004.*truncated"):
        assert mgr.find_resume().name == "step-000002"
    assert newest.is_dir() and f.stat().st_size == 100


def test_same_size_corruption_is_caught_by_checksum(tmp_path):
    mgr = _mgr(tmp_path)
    _save(mgr, 1)
    newest = _save(mgr, 2)
    f = newest / "state" / "history.bin"
    data = bytearray(f.read_bytes())
    data[0] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="sha256"):
        assert mgr.find_resume().name == "step-000001"


def test_missing_manifest_means_incomplete(tmp_path):
    mgr = _mgr(tmp_path)
    _save(mgr, 1)
    newest = _save(mgr, 2)
    (newest / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="manifest.json is missing"):
        assert mgr.find_resume().name == "step-000001"


def test_latest_pointing_at_missing_folder_falls_back(tmp_path):
    mgr = _mgr(tmp_path)
    _save(mgr, 1)
    (tmp_path / "checkpoints" / "latest").write_text("step-000009\n")
    with pytest.warns(UserWarning, match="step-000009, which does not exist"):
        assert mgr.find_resume().name == "step-000001"


def test_half_written_temp_folder_is_ignored(tmp_path):
    mgr = _mgr(tmp_path)
    _save(mgr, 1)
    partial = tmp_path / "checkpoints" / ".tmp-step-000002"
    (partial / "backend").mkdir(parents=True)
    (partial / "backend" / "model.pt").write_bytes(b"half")
    assert mgr.find_resume().name == "step-000001"
    _save(mgr, 3)  # a later save sweeps stale temp folders
    assert not partial.exists()


def test_explicit_resume_path_must_be_valid(tmp_path):
    mgr = _mgr(tmp_path)
    good = _save(mgr, 1)
    bad = _save(mgr, 2)
    (bad / "manifest.json").unlink()
    assert _mgr(tmp_path, resume=str(good)).find_resume() == good
    with pytest.raises(CheckpointError, match=r"checkpoint.resume=.*step-000002.*manifest.json is missing"):
        _mgr(tmp_path, resume=str(bad)).find_resume()
    with pytest.raises(CheckpointError, match="does not exist"):
        _mgr(tmp_path, resume=str(tmp_path / "nope")).find_resume()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no valid checkpoint under"):
        _mgr(tmp_path, resume=str(empty)).find_resume()


def test_resume_never_and_fresh_auto(tmp_path):
    assert _mgr(tmp_path).find_resume() is None
    assert _mgr(tmp_path, resume="never").find_resume() is None


def test_resume_never_in_a_used_folder_is_refused_unless_overwrite(tmp_path):
    _save(_mgr(tmp_path), 1)
    _save(_mgr(tmp_path), 2)
    root = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError, match=rf"resume=never, but {root} holds .*step-000002.*checkpoint.overwrite=true"):
        _mgr(tmp_path, resume="never").find_resume()
    assert len(_mgr(tmp_path).step_folders()) == 2
    with pytest.warns(UserWarning, match="deleting the 2 checkpoints"):
        assert _mgr(tmp_path, resume="never", overwrite=True).find_resume() is None
    assert _mgr(tmp_path).step_folders() == [] and not (root / "latest").exists()
    # The new run's step 1 is its own, not the old one kept because it was valid.
    fresh = _save(_mgr(tmp_path, resume="never"), 1, b"new-run")
    assert (fresh / "backend" / "model.pt").read_bytes() == b"weights-1-new-run"


def test_all_corrupt_folder_under_auto_is_an_error(tmp_path):
    for step in (1, 2):
        p = _save(_mgr(tmp_path), step)
        f = p / "state" / "history.bin"
        f.write_bytes(b"X" * f.stat().st_size)
    with pytest.warns(UserWarning, match="skipping incomplete"):
        with pytest.raises(CheckpointError, match=r"resume=auto: none of the 2 checkpoint folders .* is complete"):
            _mgr(tmp_path).find_resume()


def test_assign_files_gives_each_rank_its_own_and_balances_the_rest():
    from rhymerl.outputs.checkpoint import assign_files

    files = {"ranks/rank-00001.pkl": 10, "ranks/rank-00000.pkl": 10, "backend/__1_0.distcp": 1000,
             "backend/__0_0.distcp": 900, "backend/common.pt": 500, "state/history.bin": 400,
             "config.yaml": 5, "backend/.metadata": 50}
    out = assign_files(files, 2)
    assert sorted(out[0] + out[1]) == sorted(files)
    assert {"ranks/rank-00000.pkl", "backend/__0_0.distcp"} <= set(out[0])
    assert {"ranks/rank-00001.pkl", "backend/__1_0.distcp"} <= set(out[1])
    loads = [sum(files[f] for f in part) for part in out]
    assert max(loads) - min(loads) <= 500
    # More ranks than files: every file still exactly once.
    assert sorted(f for part in assign_files(files, 16) for f in part) == sorted(files)


def test_failed_save_leaves_previous_checkpoint_and_pointer_untouched(tmp_path):
    mgr = _mgr(tmp_path, keep_last=1)
    good = _save(mgr, 1)
    before = {p.relative_to(good): p.read_bytes() for p in good.rglob("*") if p.is_file()}

    def exploding_backend(folder: Path) -> None:
        (folder / "model.pt").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError, match="No space left"):
        mgr.save(2, {"history": b"h"}, backend_save=exploding_backend)
    assert [p.name for _, p in mgr.step_folders()] == ["step-000001"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-000001"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert {p.relative_to(good): p.read_bytes() for p in good.rglob("*") if p.is_file()} == before


def test_existing_valid_step_is_never_overwritten(tmp_path):
    mgr = _mgr(tmp_path)
    first = _save(mgr, 5, b"original")
    original = (first / "backend" / "model.pt").read_bytes()
    _save(mgr, 5, b"second")
    assert (first / "backend" / "model.pt").read_bytes() == original


def test_incomplete_step_folder_is_moved_aside_not_overwritten(tmp_path):
    mgr = _mgr(tmp_path, keep_last=3)
    first = _save(mgr, 5, b"original")
    (first / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="incomplete"):
        _save(mgr, 5, b"second")
    asides = list((tmp_path / "checkpoints").glob("step-000005.incomplete-*"))
    assert len(asides) == 1 and (asides[0] / "backend" / "model.pt").read_bytes() == b"weights-5-original"
    assert verify_checkpoint(first) is None


def test_two_ranks_write_their_own_state(tmp_path):
    world = _ThreadWorld(2)
    bar = world.bar
    results, errors = {}, []

    def run(rank: int) -> None:
        try:
            # Rank 0 names this save's temp folder; the others learn it from its broadcast.
            mgr = CheckpointManager(CheckpointConfig(), tmp_path, rank=rank, world_size=2, barrier=bar.wait,
                                    broadcast_object=lambda obj: world.all_gather(rank, obj)[0])

            def backend_save(folder: Path) -> None:
                (folder / f"shard-{rank}.pt").write_bytes(b"shard%d" % rank)

            mgr.save(3, {"blob": b"rank0-only" if rank == 0 else b"ignored"}, rank_state={"rank": rank},
                     backend_save=backend_save)
            bar.wait()
            results[rank] = mgr.load(mgr.find_resume())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            bar.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert results[0].rank_state == {"rank": 0} and results[1].rank_state == {"rank": 1}
    assert results[1].state == {"blob": b"rank0-only"}
    assert sorted(p.name for p in results[0].backend_dir.iterdir()) == ["shard-0.pt", "shard-1.pt"]
    assert results[0].saved_world_size == 2


def test_rng_capture_restore_reproduces_draws():
    import numpy as np
    import torch

    state = capture_rng_state()
    first = (random.random(), np.random.rand(), torch.rand(3).tolist())
    restore_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(3).tolist()) == first


def test_bad_state_key_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="state key"):
        _mgr(tmp_path).save(1, {"../escape": b""})


def test_should_save_every_steps(tmp_path):
    mgr = _mgr(tmp_path, every_steps=3)
    assert [s for s in range(10) if mgr.should_save(s)] == [3, 6, 9]
    assert not any(_mgr(tmp_path).should_save(s) for s in range(10))


def test_complete_folder_newer_than_pointer_wins(tmp_path):
    # A crash between the rename and the pointer update leaves `latest` one behind.
    mgr = _mgr(tmp_path)
    _save(mgr, 1)
    _save(mgr, 2)
    (tmp_path / "checkpoints" / "latest").write_text("step-000001\n")
    with pytest.warns(UserWarning, match="step-000002 is newer; using it if it is complete"):
        assert mgr.find_resume().name == "step-000002"


def test_collective_find_resume_uses_rank0s_answer(tmp_path):
    _save(_mgr(tmp_path), 1)
    good = _save(_mgr(tmp_path), 2)
    bar = threading.Barrier(2)
    box: dict = {}

    def broadcast(obj):
        # Stand-in for dist.broadcast_object_list over threads: everyone gets rank 0's object.
        if threading.current_thread().name == "rank0":
            box["v"] = obj
        bar.wait()
        return box["v"]

    out, errors = {}, []

    def run(rank: int, resume: str) -> None:
        try:
            mgr = CheckpointManager(CheckpointConfig(resume=resume), tmp_path, rank=rank, world_size=2,
                                    barrier=bar.wait, broadcast_object=broadcast)
            out[rank] = mgr.find_resume()
        except CheckpointError as e:
            out[rank] = e
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            bar.abort()

    for resume, check in (("auto", lambda v: v == good), (str(tmp_path / "missing"),
                                                          lambda v: isinstance(v, CheckpointError))):
        out.clear()
        threads = [threading.Thread(target=run, args=(r, resume), name=f"rank{r}") for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert check(out[0]) and check(out[1]), out


class _ThreadWorld:
    """Object collectives over threads, standing in for torch.distributed's."""

    def __init__(self, n: int):
        self.n, self.bar, self.box = n, threading.Barrier(n), {}

    def all_gather(self, rank: int, obj):
        self.bar.wait()
        self.box[rank] = obj
        self.bar.wait()
        out = [self.box[r] for r in range(self.n)]
        self.bar.wait()
        return out

    def manager(self, tmp_path: Path, rank: int, **cfg) -> CheckpointManager:
        return CheckpointManager(CheckpointConfig(**cfg), tmp_path, rank=rank, world_size=self.n, barrier=self.bar.wait,
                                 broadcast_object=lambda obj: self.all_gather(rank, obj)[0],
                                 all_gather_object=lambda obj: self.all_gather(rank, obj))


def _run_ranks(n: int, fn) -> dict:
    out, errors = {}, []

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_collective_save_and_verify_hash_each_file_once(tmp_path, monkeypatch):
    import rhymerl.outputs.checkpoint as ck

    world = _ThreadWorld(3)
    hashed: list[tuple[str, str]] = []
    real = ck._sha256
    monkeypatch.setattr(ck, "_sha256", lambda p, *a: hashed.append((threading.current_thread().name, str(p))) or real(p, *a))

    def save_and_resume(rank: int):
        mgr = world.manager(tmp_path, rank)

        def backend_save(folder: Path) -> None:
            (folder / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 1000)

        mgr.save(2, {"trainer": {"step": 2}}, rank_state={"rank": rank}, backend_save=backend_save)
        world.bar.wait()
        path = mgr.find_resume()
        return mgr.load(path, verify=False).rank_state

    out = _run_ranks(3, save_and_resume)
    assert out == {0: {"rank": 0}, 1: {"rank": 1}, 2: {"rank": 2}}, out
    files = json.loads((tmp_path / "checkpoints" / "step-000002" / "manifest.json").read_text())["files"]
    # Once at save, once at resume; never twice in a phase.
    assert len(hashed) == 2 * len(files)
    [tmp] = {Path(p).relative_to(tmp_path / "checkpoints").parts[0] for _, p in hashed} - {"step-000002"}
    assert tmp.startswith(".tmp-step-000002-")  # this save attempt's own temp folder
    assert sorted({p for _, p in hashed}) == sorted(str(tmp_path / "checkpoints" / n) for n in
                                                     [f"{tmp}/" + f for f in files] + ["step-000002/" + f for f in files])
    assert len({name for name, _ in hashed}) == 3, "every rank hashes its share"


def test_collective_resume_error_reaches_every_rank(tmp_path):
    world = _ThreadWorld(2)
    out = _run_ranks(2, lambda rank: world.manager(tmp_path, rank, resume=str(tmp_path / "missing")).find_resume())
    assert all(isinstance(e, CheckpointError) and "does not exist" in str(e) for e in out.values()), out


def test_collective_verify_catches_corruption_on_any_rank(tmp_path):
    world = _ThreadWorld(2)
    _run_ranks(2, lambda rank: world.manager(tmp_path, rank).save(
        1, {"trainer": {}}, rank_state={"r": rank},
        backend_save=lambda d: (d / f"__{rank}_0.distcp").write_bytes(b"w" * 100)))
    f = tmp_path / "checkpoints" / "step-000001" / "backend" / "__1_0.distcp"
    f.write_bytes(b"x" * 100)  # rank 1's own shard: only rank 1 hashes it
    out = _run_ranks(2, lambda rank: world.manager(tmp_path, rank).find_resume())
    assert all(isinstance(e, CheckpointError) and "__1_0.distcp does not match its sha256" in str(e)
               for e in out.values()), out
