"""Save and resume everything a run needs to continue exactly.

Layout of one checkpoint (``<dir>/step-000012/``)::

    backend/            written by the training backend's own collective save
    state/<key>.bin     opaque blobs given as bytes (history store, ...)
    state/<key>.json    other state (counters, sampler, predictor; rhymerl.outputs.state_json)
    ranks/rank-00003.json  per-rank state (RNG of python/numpy/torch, ...)
    config.yaml         the resolved run config
    manifest.json       sha256 and size of every file above; written LAST

A folder is a checkpoint only if its manifest exists, parses and matches every file:
anything else (killed mid-save, truncated by a full disk, manifest deleted) is
incomplete and skipped with a warning. Saves go to ``.tmp-step-000012`` and are
renamed into place only after everything is fsynced, so a step folder never holds a
partial save, and an existing valid checkpoint is never overwritten. ``latest`` names
the newest verified step folder; it is written after the verification and is only a
hint (the newest valid folder wins if they disagree, e.g. after a crash between the
rename and the pointer update).

Multi-rank protocol (shared filesystem): rank 0 creates the temp folder, barrier,
every rank runs the backend's collective save and writes its own rank file, barrier,
rank 0 writes the blobs, the manifest, renames, verifies, updates ``latest`` and prunes
beyond ``keep_last``, barrier. No rank returns before the checkpoint is final, so a
rank may exit (or requeue the job) right after ``save`` returns.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import yaml

from rhymerl.outputs import state_json
from rhymerl.outputs.atomic import atomic_write_text, fsync_dir, fsync_tree
from rhymerl.config import CheckpointConfig

log = logging.getLogger("rhymerl.outputs.checkpoint")

# 2: state as JSON (rhymerl.outputs.state_json). 1 pickled it; pickles can run code when loaded,
# so those checkpoints are refused rather than read.
FORMAT_VERSION = 2
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
    """Which rank hashes which file (relative path -> size): each rank the files it wrote
    (``ranks/rank-K.*``, megatron-core's ``__K_*.distcp``), the rest by size to the least
    loaded rank, so that every byte is read once and the ranks finish together."""
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
    """None if ``path`` is a complete checkpoint, else the reason it is not.

    ``hashes=False`` checks presence and sizes only (fast, for listing); ``only``: hash just
    these files (this rank's share), still checking every file's presence and size.
    """
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


# --------------------------------------------------------------------------- RNG


def capture_rng_state() -> dict:
    """RNG state of python, numpy and torch (CPU and every visible CUDA device)."""
    import random

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
    import random

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


# --------------------------------------------------------------------------- compatibility

# Keys whose change makes the saved state meaningless for the new run: the weights'
# shape/dtype, the kind of optimizer/algorithm state, and what the sampler position indexes.
_REFUSE_EXACT = {
    "model.path", "model.dtype", "parallel.backend", "algo.name", "algo.dynamic_sampling",
    "data.source", "data.path", "data.tasks", "data.task_args", "data.size", "data.seed", "data.shuffle",
}
_REFUSE_PREFIXES = ("model.tiny.",)


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
    return key in _REFUSE_EXACT or key.startswith(_REFUSE_PREFIXES)


def check_compatible(saved: Mapping, new: Mapping) -> None:
    """Raise IncompatibleCheckpoint listing every critical key that differs.

    Parallel layout (TP/PP/DP, world size), run length, logging and rollout-speed knobs
    may change: the backend reshards on load and the rest is not part of the state.
    """
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


# --------------------------------------------------------------------------- manager


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    state: dict[str, Any]
    # This rank's own entry (None if the checkpoint had fewer ranks: a resharded resume).
    rank_state: Optional[dict]
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
                 barrier: Callable[[], None] = _noop, *,
                 broadcast_object: Optional[Callable[[Any], Any]] = None,
                 all_gather_object: Optional[Callable[[Any], list]] = None):
        """``broadcast_object(obj) -> rank 0's obj`` (e.g. via ``dist.broadcast_object_list``): when
        given, rank 0 decides which checkpoint ``find_resume`` tries and every rank gets its answer
        or its error. ``all_gather_object(obj) -> [every rank's obj]``: when given, saves and
        verifications hash in parallel, each rank its share of the files; without it rank 0
        hashes what it saves, and every rank verifies what it loads on its own."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.root = Path(cfg.dir) if cfg.dir else self.run_dir / "checkpoints"
        self.rank = rank
        self.world_size = world_size
        self.barrier = barrier
        self.broadcast_object = broadcast_object
        self.all_gather_object = all_gather_object

    # ---------------------------------------------------------------- queries

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
        """(checkpoints to try, newest first; what to say if none verifies; whether the one
        candidate was named exactly; whether no candidate means a fresh start). Raises CheckpointError."""
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
        """None if ``path`` is complete; else the reason. Collective when ``all_gather_object`` was
        given: every rank checks sizes and hashes its share of the files (``assign_files``), so the
        checkpoint is read once, in parallel; every rank gets the same answer."""
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
        """The verified checkpoint to resume from, per ``cfg.resume``; None = start fresh.

        ``auto``: newest complete one in the checkpoint folder; none there = fresh start, but a
        folder whose checkpoints are all broken is an error. ``never``: fresh start, refused if
        the folder holds checkpoints (unless ``cfg.overwrite``, which deletes them). Anything
        else is a path: a step folder (must be valid) or a checkpoint folder (must contain a valid
        one). Collective when ``broadcast_object`` was given: rank 0 decides what to try, every
        rank gets its answer or its error.
        """
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

    # ---------------------------------------------------------------- save

    def save(self, step: int, state: Mapping[str, Any], rank_state: Optional[Mapping[str, Any]] = None,
             backend_save: Optional[Callable[[Path], None]] = None, *, config: Optional[Mapping] = None) -> Path:
        """Write checkpoint ``step`` collectively; every rank calls this. Returns the final folder.

        ``state`` (rank 0's copy is written): bytes are stored as-is, anything else as JSON.
        ``rank_state``: this rank's private state (e.g. ``capture_rng_state()``).
        ``backend_save(folder)``: the backend's collective save into ``<ckpt>/backend``.
        ``config``: the resolved config dict (stored as YAML; used by ``check_compatible``).
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        for key in state:
            if not _KEY_RE.match(key):
                raise ValueError(f"checkpoint state key {key!r}: use letters, digits, '_', '-', '.'")
        final = self.root / step_dirname(step)
        tmp = self.root / f".tmp-{step_dirname(step)}"
        skip = False
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            if final.exists():
                reason = verify_checkpoint(final)
                if reason is None:
                    # Re-saving the step we resumed from: the existing one is complete; keep it.
                    skip = True
                else:
                    aside = final.with_name(f"{final.name}.incomplete-{int(time.time())}")
                    self._warn(f"{final} is incomplete ({reason}); moving it to {aside.name} and saving again")
                    os.rename(final, aside)
            if not skip:
                tmp.mkdir(parents=True)
            fsync_dir(self.root)
        self.barrier()
        # Rank 0 created the temp folder only if it decided to write.
        if self.rank != 0:
            skip = not tmp.is_dir()
        if skip:
            self.barrier()
            return final
        error: Optional[BaseException] = None
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
        self.barrier()
        t_write = time.perf_counter() - t0
        files, hash_error = self._hash_collectively(tmp, error)
        if error is None and hash_error is not None:
            error = hash_error
        if error is not None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"saving checkpoint {final} failed on rank {self.rank}: {error!r}") from error
        if self.rank == 0:
            try:
                self._finish_on_rank0(step, kinds, config is not None, tmp, final, rank_state is not None, files)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                self.barrier()
                raise
            nbytes = sum(m["size"] for m in files.values())
            log.info("saved checkpoint %s: wrote %s, hashed in %.2f s on %d rank(s)", final.name,
                     _rate(nbytes, t_write), time.perf_counter() - t0 - t_write,
                     self.world_size if self._collective else 1)
        self.barrier()
        if not final.is_dir() or not (final / MANIFEST).is_file():
            raise CheckpointError(f"checkpoint {final} was not completed by rank 0 (see rank 0's log)")
        return final

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

    def _hash_collectively(self, tmp: Path, write_error: Optional[BaseException]
                           ) -> tuple[dict[str, dict], Optional[BaseException]]:
        """Size and sha256 of every file under ``tmp`` (on rank 0; {} elsewhere), each rank
        hashing its share when collective; any rank's error comes back on every rank."""
        if not self._collective:
            if self.rank != 0 or write_error is not None:
                return {}, None
            try:
                return {f.relative_to(tmp).as_posix(): {"size": f.stat().st_size, "sha256": _sha256(f)}
                        for f in _files_under(tmp)}, None
            except OSError as e:
                return {}, e
        mine: dict[str, dict] = {}
        err: Optional[str] = None if write_error is None else f"rank {self.rank}: {write_error!r}"
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
        manifest = {
            "format": FORMAT_VERSION, "step": step, "world_size": self.world_size, "created": time.time(),
            "state": kinds, "has_config": has_config, "has_backend": (tmp / "backend").is_dir(),
            "has_rank_state": with_ranks, "files": files,
        }
        _write_fsynced(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        fsync_tree(tmp)
        os.rename(tmp, final)
        fsync_dir(self.root)
        # The manifest hashes were computed by reading every file back after the backend
        # wrote it; after the rename, check that every listed file is there with its size
        # before anything older is deleted (re-hashing would mostly read the page cache).
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

    # ---------------------------------------------------------------- load

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
                                saved_world_size=int(manifest.get("world_size", 1)), config=config,
                                manifest=manifest)


def _step_of(p: Path) -> int:
    m = _STEP_RE.match(p.name)
    return int(m.group(1)) if m else -1


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj

