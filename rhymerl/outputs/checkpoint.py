"""Save and resume everything a run needs to continue exactly: each ``step-N/`` is written in a temp folder,
its manifest (sizes, sha256) last, and renamed into place; a folder is a checkpoint only if it verifies."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import secrets
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import yaml

from rhymerl.outputs import state_json
from rhymerl.outputs.atomic import atomic_write_text, fsync_dir, fsync_tree
from rhymerl.outputs.disk_space import NEARLY_FULL_BYTES, folder_bytes, free_bytes, full_message, ran_out, says_full
from rhymerl.config import CheckpointConfig

log = logging.getLogger("rhymerl.outputs.checkpoint")

FORMAT_VERSION = 2  # state as JSON; 1 pickled it, and pickles can run code when loaded: refused
MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_RE = re.compile(r"^step-(\d{6,})$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved, found or loaded; the message says which file and why."""


class IncompatibleCheckpoint(CheckpointError):
    """The checkpoint was written by a run whose model/algorithm differs from this config."""


def step_dirname(step: int) -> str:
    return f"step-{step:06d}"


def _sha256(path: Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def _files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _write_fsynced(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


_OWNED_RE = re.compile(r"(?:^|/)(?:rank-(\d+)\.[a-z]+|__(\d+)_\d+\.distcp)$")


def assign_files(files: Mapping[str, int], world_size: int) -> list[list[str]]:
    """Which rank hashes which file: each rank those it wrote, the rest by size to the least loaded."""
    out: list[list[str]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    rest = []
    for rel, size in files.items():
        m = _OWNED_RE.search(rel)
        owner = int(m.group(1) or m.group(2)) if m else -1
        if 0 <= owner < world_size:
            out[owner].append(rel)
            load[owner] += size
        else:
            rest.append((size, rel))
    for size, rel in sorted(rest, key=lambda x: (-x[0], x[1])):
        r = min(range(world_size), key=lambda i: (load[i], i))
        out[r].append(rel)
        load[r] += size
    return out


def _rate(nbytes: int, secs: float) -> str:
    return f"{nbytes / 1e6:.1f} MB in {secs:.2f} s ({nbytes / 1e6 / secs:.0f} MB/s)" if secs > 0 else \
        f"{nbytes / 1e6:.1f} MB"


def verify_checkpoint(path: Path, *, hashes: bool = True, only: Optional[set] = None) -> Optional[str]:
    """None if ``path`` is a complete checkpoint, else why (``hashes=False``: sizes only; ``only``: hash these)."""
    path = Path(path)
    if not path.is_dir():
        return f"{path} does not exist or is not a folder"
    mpath = path / MANIFEST
    if not mpath.is_file():
        return f"{mpath} is missing (the save did not finish)"
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{mpath} is unreadable: {e}"
    if manifest.get("format") == 1:
        return (f"{mpath}: written by an older RhymeRL that pickled its state; pickles can run code when "
                "loaded, so it is not read. Resume from a newer checkpoint or start over")
    if manifest.get("format") != FORMAT_VERSION:
        return f"{mpath}: unknown format {manifest.get('format')!r} (this RhymeRL writes {FORMAT_VERSION})"
    for rel, meta in files.items():
        f = path / rel
        if not f.is_file():
            return f"{f} is listed in the manifest but missing"
        size = f.stat().st_size
        if size != meta["size"]:
            return f"{f} has {size} bytes, the manifest says {meta['size']} (truncated or overwritten)"
    for rel, meta in files.items():
        if hashes and (only is None or rel in only) and _sha256(path / rel) != meta["sha256"]:
            f = path / rel
            return f"{f} does not match its sha256 in the manifest (corrupt)"
    return None


def read_manifest(path: Path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


def capture_rng_state() -> dict:
    """RNG state of python, numpy and torch (CPU and every visible CUDA device)."""
    state: dict[str, Any] = {"python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    try:
        import torch

        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["torch_cuda"] = torch.cuda.get_rng_state_all()
    except ImportError:
        pass
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:

    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "torch" in state:
        import torch

        torch.set_rng_state(state["torch"])
        if "torch_cuda" in state and torch.cuda.is_available():
            cuda_states = state["torch_cuda"]
            if len(cuda_states) != torch.cuda.device_count():
                warnings.warn(f"checkpoint has CUDA RNG states for {len(cuda_states)} devices, this process sees "
                              f"{torch.cuda.device_count()}; restoring the overlapping ones")
            for i, s in enumerate(cuda_states[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)


# Keys whose change makes the saved state meaningless (weights, optimizer/algorithm state, sampler).
_REFUSE_EXACT = {"model.path", "model.dtype", "parallel.backend", "algo.name", "algo.dynamic_sampling", "data.source",
                 "data.path", "data.tasks", "data.task_args", "data.size", "data.seed", "data.shuffle"}


def _flatten(d: Mapping, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v and not key.startswith("data.task_args"):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = list(v) if isinstance(v, tuple) else v
    return out


def _is_critical(key: str) -> bool:
    return key in _REFUSE_EXACT


def check_compatible(saved: Mapping, new: Mapping) -> None:
    """Raise IncompatibleCheckpoint listing every critical key that differs (the layout may change)."""
    a, b = _flatten(saved), _flatten(new)
    diffs = []
    for key in sorted(set(a) | set(b)):
        if not _is_critical(key):
            continue
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            diffs.append(f"  {key}: checkpoint has {a.get(key, '<unset>')!r}, this config has {b.get(key, '<unset>')!r}")
    # DeepSpeed ZeRO partitions optimizer state by stage; its checkpoints do not convert.
    if a.get("parallel.backend") == "deepspeed" and a.get("parallel.zero_stage") != b.get("parallel.zero_stage"):
        diffs.append(f"  parallel.zero_stage: checkpoint has {a.get('parallel.zero_stage')!r}, "
                     f"this config has {b.get('parallel.zero_stage')!r}")
    if diffs:
        raise IncompatibleCheckpoint(
            "cannot resume: the checkpoint was written with a different model or algorithm:\n" + "\n".join(diffs)
            + "\nStart a new run (another checkpoint.dir or checkpoint.resume=never), or restore these values.")


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    state: dict[str, Any]
    rank_state: Optional[dict]  # None if the checkpoint had fewer ranks
    saved_world_size: int
    config: Optional[dict]
    manifest: dict = field(repr=False, default_factory=dict)

    @property
    def backend_dir(self) -> Path:
        return self.path / "backend"


def _noop() -> None:
    return None


class CheckpointManager:
    """Atomic, verified, rotating checkpoints of one run (see the module docstring)."""

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, rank: int = 0, world_size: int = 1,
                 barrier: Callable[[], None] = _noop, *, broadcast_object: Optional[Callable[[Any], Any]] = None,
                 all_gather_object: Optional[Callable[[Any], list]] = None):
        """``broadcast_object(obj) -> rank 0's obj``: rank 0 decides what ``find_resume`` tries.
        ``all_gather_object(obj) -> [every rank's obj]``: ranks hash their share of the files in parallel."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.root = Path(cfg.dir) if cfg.dir else self.run_dir / "checkpoints"
        self.rank = rank
        self.world_size = world_size
        self.barrier = barrier
        self.broadcast_object = broadcast_object
        self.all_gather_object = all_gather_object
        self._last_bytes: Optional[int] = None

    def should_save(self, step: int) -> bool:
        return self.cfg.every_steps > 0 and step > 0 and step % self.cfg.every_steps == 0

    def step_folders(self) -> list[tuple[int, Path]]:
        """All ``step-*`` folders (valid or not), oldest first."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir():
                out.append((int(m.group(1)), p))
        return sorted(out)

    def latest_pointer(self) -> Optional[str]:
        p = self.root / LATEST
        try:
            return p.read_text().strip() or None
        except FileNotFoundError:
            return None

    def _warn(self, msg: str) -> None:
        if self.rank == 0:
            warnings.warn(msg, stacklevel=3)

    def _pointer_warnings(self, root: Path, folders: list[tuple[int, Path]]) -> None:
        pointer = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
        if pointer and not (root / pointer).is_dir():
            self._warn(f"checkpoint pointer {root / LATEST} names {pointer}, which does not exist; "
                       "looking for the newest valid checkpoint instead")
        elif pointer and _STEP_RE.match(pointer) and folders and _step_of(Path(pointer)) < folders[-1][0]:
            self._warn(f"{root / LATEST} names {pointer} but {folders[-1][1].name} is newer; using it if it is complete")

    def newest_valid(self) -> Optional[Path]:
        """The newest complete checkpoint in this folder (one process); warns about each newer broken one."""
        folders = self.step_folders()
        self._pointer_warnings(self.root, folders)
        for _, path in reversed(folders):
            reason = self.verify(path)
            if reason is None:
                return path
            self._warn(f"skipping incomplete checkpoint {path}: {reason}")
        return None

    def _folders_under(self, root: Path) -> list[tuple[int, Path]]:
        if root == self.root:
            return self.step_folders()
        return CheckpointManager(CheckpointConfig(dir=str(root)), self.run_dir).step_folders()

    def _candidates(self) -> tuple[list[str], str, bool, bool]:
        """(checkpoints to try, newest first; message if none verifies; named exactly; none = fresh start)."""
        mode = self.cfg.resume.strip()
        if mode in ("never", ""):
            used = self.step_folders()
            if used and not self.cfg.overwrite:
                raise CheckpointError(
                    f"checkpoint.resume=never, but {self.root} holds the checkpoints of another run "
                    f"({', '.join(p.name for _, p in used[-3:])}): a new run would mix with them. Resume it "
                    "(checkpoint.resume=auto), give this run its own run.output_dir or checkpoint.dir, or "
                    "delete them with checkpoint.overwrite=true")
            if used and self.rank == 0:
                self._warn(f"checkpoint.overwrite=true: deleting the {len(used)} checkpoints of the previous run "
                           f"in {self.root} ({', '.join(p.name for _, p in used)})")
                for _, p in used:
                    shutil.rmtree(p)
                (self.root / LATEST).unlink(missing_ok=True)
                fsync_dir(self.root)
            return [], "", False, True
        if mode == "auto":
            folders = self.step_folders()
            self._pointer_warnings(self.root, folders)
            return ([str(p) for _, p in reversed(folders)],
                    f"checkpoint.resume=auto: none of the {len(folders)} checkpoint folders in {self.root} is "
                    "complete (see the warnings above). Repair or remove them, point checkpoint.resume at a good "
                    "one, or start over with checkpoint.resume=never checkpoint.overwrite=true", False, True)
        path = Path(mode).expanduser()
        if not path.is_absolute() and not path.exists():
            path = self.run_dir / path
        if not path.exists():
            raise CheckpointError(f"checkpoint.resume={mode!r}: {path} does not exist")
        if (path / MANIFEST).exists() or _STEP_RE.match(path.name):
            return [str(path)], f"checkpoint.resume={mode!r} is not a valid checkpoint", True, False
        folders = self._folders_under(path)
        self._pointer_warnings(path, folders)
        return ([str(p) for _, p in reversed(folders)], f"checkpoint.resume={mode!r}: no valid checkpoint under {path}",
                False, False)

    @property
    def _collective(self) -> bool:
        return self.world_size > 1 and self.all_gather_object is not None

    def verify(self, path: Path) -> Optional[str]:
        """None if ``path`` is complete, else the reason (collective with ``all_gather_object``)."""
        path = Path(path)
        t0 = time.perf_counter()
        reason, mine, nbytes = None, None, 0
        try:
            files = {rel: int(m["size"]) for rel, m in read_manifest(path)["files"].items()}
            if self._collective:
                mine = set(assign_files(files, self.world_size)[self.rank])
            nbytes = sum(files[r] for r in (mine if mine is not None else files))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # verify_checkpoint says why
        reason = verify_checkpoint(path, only=mine)
        if self._collective:
            answers = self.all_gather_object((reason, nbytes))
            reason = next((r for r, _ in answers if r is not None), None)
            nbytes = sum(n for _, n in answers)
        if reason is None and self.rank == 0:
            log.info("verified checkpoint %s: %s on %d rank(s)", path.name, _rate(nbytes, time.perf_counter() - t0),
                     self.world_size if self._collective else 1)
        return reason

    def find_resume(self) -> Optional[Path]:
        """The verified checkpoint to resume from per ``cfg.resume`` (auto, never, or a path); None = fresh."""
        if self.broadcast_object is not None and self.world_size > 1:
            answer: tuple[str, Any] = ("ok", None)
            if self.rank == 0:
                try:
                    answer = ("ok", self._candidates())
                except CheckpointError as e:
                    answer = ("error", str(e))
            kind, value = self.broadcast_object(answer)
            if kind == "error":
                raise CheckpointError(value)
            candidates, none_valid, exact, fresh_ok = value
        else:
            candidates, none_valid, exact, fresh_ok = self._candidates()
        first_reason = None
        for cand in candidates:
            reason = self.verify(Path(cand))
            if reason is None:
                return Path(cand)
            if exact:
                raise CheckpointError(f"{none_valid}: {reason}")
            first_reason = first_reason or reason
            self._warn(f"skipping incomplete checkpoint {cand}: {reason}")
        if candidates:
            raise CheckpointError(f"{none_valid} (newest: {first_reason})")
        if not fresh_ok:
            raise CheckpointError(none_valid)
        return None

    def save(self, step: int, state: Mapping[str, Any], rank_state: Optional[Mapping[str, Any]] = None,
             backend_save: Optional[Callable[[Path], None]] = None, *, config: Optional[Mapping] = None,
             expected_bytes: Optional[int] = None) -> Path:
        """Write checkpoint ``step`` collectively; every rank calls this. Returns the final folder.
        ``state`` (rank 0's): bytes as-is, else JSON. ``rank_state``: this rank's own. ``backend_save(folder)``:
        the backend's collective save. ``expected_bytes``: size estimate for the first free-space check."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        for key in state:
            if not _KEY_RE.match(key):
                raise ValueError(f"checkpoint state key {key!r}: use letters, digits, '_', '-', '.'")
        final = self.root / step_dirname(step)
        plan: tuple[str, str, Optional[int]] = ("", "", None)
        if self.rank == 0:
            plan = self._plan_save(step, final, expected_bytes)
        # Rank 0's decision reaches every rank; it is also the barrier after rank 0's preparation.
        kind, detail, need = self._from_rank0(plan)
        if kind == "refuse":
            raise CheckpointError(detail)
        if kind == "skip":
            self.barrier()
            return final
        tmp = self.root / detail
        error: Optional[BaseException] = None
        error_text: Optional[str] = None
        t0 = time.perf_counter()
        try:
            if backend_save is not None:
                (tmp / "backend").mkdir(exist_ok=True)
                backend_save(tmp / "backend")
            if rank_state is not None:
                _write_fsynced(tmp / "ranks" / f"rank-{self.rank:05d}.json",
                               state_json.dumps(dict(rank_state), f"rank_state of rank {self.rank}"))
            if self.rank == 0:
                kinds = self._write_state(tmp, state, config)
        except BaseException as e:  # noqa: BLE001 - reraised after the other ranks are released
            error = e
            # Before rank 0 deletes the temp folder, whose size tells a full disk.
            error_text = self._describe_write_error(e, tmp, need)
        self.barrier()
        t_write = time.perf_counter() - t0
        files, hash_error = self._hash_collectively(tmp, error_text)
        if error is None and hash_error is not None:
            error = hash_error
        if error is not None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            details = str(hash_error) if hash_error is not None else f"rank {self.rank}: {error_text}"
            raise CheckpointError(f"saving checkpoint {final} failed: {details}; {self._intact_hint()}") from error
        if self.rank == 0:
            try:
                self._finish_on_rank0(step, kinds, config is not None, tmp, final, rank_state is not None, files)
            except BaseException as e:
                text = self._describe_write_error(e, tmp, need) if isinstance(e, OSError) else None
                shutil.rmtree(tmp, ignore_errors=True)
                self.barrier()
                if text is not None:
                    raise CheckpointError(f"saving checkpoint {final} failed: rank 0: {text}; "
                                          f"{self._intact_hint()}") from e
                raise
            nbytes = sum(m["size"] for m in files.values())
            self._last_bytes = nbytes
            log.info("saved checkpoint %s: wrote %s, hashed in %.2f s on %d rank(s)", final.name,
                     _rate(nbytes, t_write), time.perf_counter() - t0 - t_write,
                     self.world_size if self._collective else 1)
        self.barrier()
        if not final.is_dir() or not (final / MANIFEST).is_file():
            raise CheckpointError(f"checkpoint {final} was not completed by rank 0 (see rank 0's log)")
        return final

    def _plan_save(self, step: int, final: Path, expected_bytes: Optional[int]) -> tuple[str, str, Optional[int]]:
        """Rank 0: ("write", temp folder, bytes needed), ("skip", "", None) or ("refuse", reason, None)."""
        need: Optional[int] = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if final.exists():
                reason = verify_checkpoint(final)
                if reason is None:
                    # Re-saving the step we resumed from: the existing one is complete; keep it.
                    return "skip", "", None
                aside = final.with_name(f"{final.name}.incomplete-{int(time.time())}")
                self._warn(f"{final} is incomplete ({reason}); moving it to {aside.name} and saving again")
                os.rename(final, aside)
            need = self._expected_bytes(expected_bytes)
            free = free_bytes(self.root)
            if need is not None and free < need:
                return "refuse", (f"checkpoint {final} not saved: {full_message(self.root, free, need)}; "
                                  f"{self._intact_hint()}"), None
            # A folder of this attempt's own: no other writer can delete or add files in it.
            tmp = self.root / f".tmp-{step_dirname(step)}-{secrets.token_hex(4)}"
            tmp.mkdir()
            fsync_dir(self.root)
            return "write", tmp.name, need
        except OSError as e:
            if says_full(e) or free_bytes(self.root) < NEARLY_FULL_BYTES:
                e_text = full_message(self.root, free_bytes(self.root), need)
            else:
                e_text = repr(e)
            return "refuse", f"saving checkpoint {final} failed: rank 0: {e_text}; {self._intact_hint()}", None

    def _from_rank0(self, plan: tuple[str, str, Optional[int]]) -> tuple[str, str, Optional[int]]:
        if self.world_size == 1:
            return plan
        if self.broadcast_object is not None:
            return self.broadcast_object(plan)
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("CheckpointManager.save on several ranks needs broadcast_object (or torch.distributed)")
        box = [plan]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _expected_bytes(self, expected_bytes: Optional[int]) -> Optional[int]:
        """The newest checkpoint's size when there is one, else the caller's estimate."""
        if self._last_bytes is None:
            pointer = self.latest_pointer()
            try:
                if pointer and _STEP_RE.match(pointer):
                    self._last_bytes = sum(int(m["size"]) for m in read_manifest(self.root / pointer)["files"].values())
            except (OSError, ValueError, KeyError, TypeError):
                pass
        return self._last_bytes if self._last_bytes is not None else expected_bytes

    def _describe_write_error(self, e: BaseException, tmp: Path, need: Optional[int]) -> str:
        try:
            free, written = free_bytes(self.root), folder_bytes(tmp)
        except OSError:
            return repr(e)
        return full_message(self.root, free, need) if ran_out(e, written, free, need) else repr(e)

    def _intact_hint(self) -> str:
        pointer = self.latest_pointer()
        kept = f"the newest checkpoint, {pointer}, is intact" if pointer else "no earlier checkpoint exists"
        return f"{kept}; free space (or set checkpoint.dir to a larger filesystem) and resume"

    def _write_state(self, tmp: Path, state: Mapping[str, Any], config: Optional[Mapping]) -> dict[str, str]:
        kinds = {}
        for key, value in state.items():
            if isinstance(value, (bytes, bytearray, memoryview)):
                _write_fsynced(tmp / "state" / f"{key}.bin", bytes(value))
                kinds[key] = "bytes"
            else:
                _write_fsynced(tmp / "state" / f"{key}.json", state_json.dumps(value, f"state[{key!r}]"))
                kinds[key] = "json"
        if config is not None:
            _write_fsynced(tmp / "config.yaml", yaml.safe_dump(_plain(config), sort_keys=False).encode())
        return kinds

    def _hash_collectively(self, tmp: Path, write_error: Optional[str]
                           ) -> tuple[dict[str, dict], Optional[BaseException]]:
        """Size and sha256 of every file under ``tmp`` (rank 0; {} elsewhere), and any rank's error."""
        if not self._collective:
            if self.rank != 0 or write_error is not None:
                return {}, None
            try:
                return {f.relative_to(tmp).as_posix(): {"size": f.stat().st_size, "sha256": _sha256(f)}
                        for f in _files_under(tmp)}, None
            except OSError as e:
                return {}, e
        mine: dict[str, dict] = {}
        err: Optional[str] = None if write_error is None else f"rank {self.rank}: {write_error}"
        if err is None:
            try:
                sizes = {f.relative_to(tmp).as_posix(): f.stat().st_size for f in _files_under(tmp)}
                for rel in assign_files(sizes, self.world_size)[self.rank]:
                    mine[rel] = {"size": sizes[rel], "sha256": _sha256(tmp / rel)}
            except OSError as e:
                err = f"rank {self.rank}: {e!r}"
        parts = self.all_gather_object((mine, err))
        errors = [e for _, e in parts if e is not None]
        if errors:
            return {}, CheckpointError("; ".join(errors))
        return {rel: meta for part, _ in parts for rel, meta in part.items()}, None

    def _finish_on_rank0(self, step: int, kinds: dict[str, str], has_config: bool, tmp: Path,
                         final: Path, with_ranks: bool, files: dict[str, dict]) -> None:
        if with_ranks:
            have = sorted(p.name for p in (tmp / "ranks").glob("rank-*.json"))
            if len(have) != self.world_size:
                raise CheckpointError(f"checkpoint {final}: expected {self.world_size} rank files, found {len(have)} "
                                      "(is the checkpoint folder on a filesystem every rank shares?)")
        manifest = {"format": FORMAT_VERSION, "step": step, "world_size": self.world_size, "created": time.time(),
                    "state": kinds, "has_config": has_config, "has_backend": (tmp / "backend").is_dir(),
                    "has_rank_state": with_ranks, "files": files}
        _write_fsynced(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        fsync_tree(tmp)
        os.rename(tmp, final)
        fsync_dir(self.root)
        # Files were hashed after writing; check presence and sizes before deleting anything older.
        reason = verify_checkpoint(final, hashes=False)
        if reason is not None:
            bad = final.with_name(f"{final.name}.incomplete-{int(time.time())}")
            os.rename(final, bad)
            raise CheckpointError(f"checkpoint {final} failed verification after writing: {reason}; "
                                  f"kept as {bad.name}, older checkpoints untouched")
        atomic_write_text(self.root / LATEST, final.name + "\n")
        self._prune(keep=final)

    def _prune(self, keep: Path) -> None:
        folders = self.step_folders()
        valid = [p for _, p in folders if verify_checkpoint(p, hashes=False) is None]
        kept = set(valid[-self.cfg.keep_last:]) | {keep}
        oldest_kept = min(_step_of(p) for p in kept)
        for step, p in folders:
            # Incomplete folders newer than the oldest kept one are left for inspection.
            if p not in kept and (p in valid or step < oldest_kept):
                shutil.rmtree(p, ignore_errors=True)
        for p in self.root.glob(".tmp-step-*"):
            shutil.rmtree(p, ignore_errors=True)
        fsync_dir(self.root)

    def load(self, path: Path, *, verify: bool = True) -> LoadedCheckpoint:
        path = Path(path)
        if verify:
            reason = self.verify(path)
            if reason is not None:
                raise CheckpointError(f"cannot load {path}: {reason}")
        manifest = read_manifest(path)
        state: dict[str, Any] = {}
        for key, kind in manifest.get("state", {}).items():
            if kind == "bytes":
                state[key] = (path / "state" / f"{key}.bin").read_bytes()
            else:
                state[key] = state_json.loads((path / "state" / f"{key}.json").read_bytes())
        rank_state = None
        rfile = path / "ranks" / f"rank-{self.rank:05d}.json"
        if rfile.is_file():
            rank_state = state_json.loads(rfile.read_bytes())
        config = None
        if (path / "config.yaml").is_file():
            config = yaml.safe_load((path / "config.yaml").read_text())
        return LoadedCheckpoint(path=path, step=int(manifest["step"]), state=state, rank_state=rank_state,
                                saved_world_size=int(manifest.get("world_size", 1)), config=config, manifest=manifest)


def _step_of(p: Path) -> int:
    m = _STEP_RE.match(p.name)
    return int(m.group(1)) if m else -1


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj

