"""One owner per run folder: rank 0's POSIX lock on ``.owner.lock``, plus an ``owner.json`` heartbeat."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from rhymerl.outputs.atomic import atomic_write_text

log = logging.getLogger("rhymerl")

LOCK_NAME = ".owner.lock"
OWNER_NAME = "owner.json"
HEARTBEAT_S = 5.0
STALE_S = 30.0  # an owner on another host whose heartbeat is older than this is gone
# A requeued segment's wait for its predecessor: longer than STALE_S, to outwait one killed elsewhere.
REQUEUE_WAIT_S = 90.0
GRACE_S = 2.0  # anyone else's wait: covers a release in progress and an owner not yet written


class RunFolderBusy(RuntimeError):
    """Another run owns the folder; the message names it and what to do."""


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    pid_start: int       # start time in clock ticks (a reused pid is not the owner); 0 = unknown
    job_id: str          # "" outside Slurm
    restart: int         # SLURM_RESTART_COUNT of the segment
    started: float       # wall clock
    heartbeat: float     # wall clock of the last beat

    def describe(self, now: float) -> str:
        job = f"Slurm job {self.job_id} (restart {self.restart}), " if self.job_id else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (f"{job}host {self.host}, pid {self.pid}, started {when}, "
                f"heartbeat {max(0.0, now - self.heartbeat):.0f} s ago")


def _proc_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (state first); [] if it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def process_start_ticks(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot; 0 if it cannot be read."""
    fields = _proc_stat(pid)
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else 0


def pid_alive(pid: int, start_ticks: int) -> bool:
    """Whether process ``pid`` (started at ``start_ticks``, 0 = unknown) still runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    fields = _proc_stat(pid)
    if fields and fields[0] in ("Z", "X"):
        return False  # ended, not yet reaped by its parent
    if start_ticks and len(fields) > 19:
        return fields[19] == str(start_ticks)
    return True


def this_owner(env: Optional[dict] = None) -> Owner:
    env = os.environ if env is None else env
    now = time.time()
    pid = os.getpid()
    return Owner(host=socket.gethostname(), pid=pid, pid_start=process_start_ticks(pid),
                 job_id=env.get("SLURM_JOB_ID", ""), restart=int(env.get("SLURM_RESTART_COUNT", "0") or 0),
                 started=now, heartbeat=now)


def verdict(locked: bool, owner: Optional[Owner], me: Owner, now: float,
            alive: Callable[[int, int], bool] = pid_alive, stale_s: float = STALE_S) -> str:
    """"take", "wait" (this job's previous segment, or letting go) or "refuse"."""
    same_job = bool(me.job_id) and owner is not None and owner.job_id == me.job_id
    if not locked:
        return "wait" if same_job or owner is None else "refuse"
    if owner is None or (owner.host == me.host and owner.pid == me.pid):
        return "take"
    if owner.host == me.host:
        running = alive(owner.pid, owner.pid_start)
    else:  # another host: only its heartbeat tells (the lock may be node-local)
        running = now - owner.heartbeat < stale_s
    if not running:
        return "take"
    return "wait" if same_job else "refuse"


def read_owner(folder: Path) -> Optional[Owner]:
    try:
        data = json.loads((Path(folder) / OWNER_NAME).read_text())
        return Owner(**{k: data[k] for k in Owner.__dataclass_fields__})
    except (OSError, ValueError, KeyError, TypeError):
        return None


_warned_no_locks: set = set()


def _try_lock(fd: int, folder: Path) -> bool:
    """True when this process holds the lock, or the filesystem has no file locks (owner file decides)."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if folder not in _warned_no_locks:
            _warned_no_locks.add(folder)
            log.warning("run folder %s: file locks are not available (%s); relying on %s and its heartbeat", folder, e,
                        OWNER_NAME)
        return True


def _unlock(fd: int) -> None:
    try:
        fcntl.lockf(fd, fcntl.LOCK_UN)
    except OSError:
        pass  # never locked (no file locks on this filesystem)


class RunFolderLock:
    """The lock of one or more folders (the run folder, a checkpoint folder outside it)."""

    def __init__(self, folders: Sequence[Path]):
        # Deduplicated, sorted: two runs naming the same folders lock them in the same order.
        self.folders = sorted({Path(f).resolve() for f in folders})
        self.me = this_owner()
        self._fds: dict[Path, int] = {}
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None

    def acquire(self, requeue_wait_s: float = REQUEUE_WAIT_S, grace_s: float = GRACE_S) -> "RunFolderLock":
        """Lock every folder or raise RunFolderBusy (releasing what it took)."""
        try:
            for folder in self.folders:
                self._acquire_one(folder, requeue_wait_s, grace_s)
        except BaseException:
            self.release()
            raise
        self._write_owner()
        self._beat = threading.Thread(target=self._heartbeat, name="rhymerl-owner-heartbeat", daemon=True)
        self._beat.start()
        return self

    def _acquire_one(self, folder: Path, requeue_wait_s: float, grace_s: float) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        t0 = time.monotonic()
        waited_for: Optional[Owner] = None
        while True:
            locked = _try_lock(fd, folder)
            owner = read_owner(folder)
            now = time.time()
            decision = verdict(locked, owner, self.me, now)
            if decision == "take":
                self._fds[folder] = fd
                if owner is not None and waited_for is None and (owner.host, owner.pid) != (self.me.host, self.me.pid):
                    log.info("run folder %s: its previous owner (%s) is gone; taking it", folder, owner.describe(now))
                return
            if locked:
                _unlock(fd)
            same_job = decision == "wait" and owner is not None
            limit = requeue_wait_s if same_job else grace_s
            if decision == "refuse" or time.monotonic() - t0 >= limit:
                os.close(fd)
                who = owner.describe(now) if owner is not None else "a process that has not written its owner file"
                hint = ("its previous segment did not let go within "
                        f"{limit:.0f} s; make sure it has ended, then requeue" if same_job else
                        "wait for that run to end or stop it, or give this run another run.output_dir "
                        "(or checkpoint.dir)")
                raise RunFolderBusy(f"{folder} is in use by another run ({who}); {hint}")
            if same_job and waited_for is None:
                waited_for = owner
                log.warning("run folder %s: waiting up to %.0f s for this job's previous segment to let go (%s)",
                            folder, limit, owner.describe(now))
            time.sleep(0.2)

    def _record(self) -> str:
        return json.dumps({**asdict(self.me), "heartbeat": time.time()}, indent=1) + "\n"

    def _write_owner(self) -> None:
        for folder in self._fds:
            atomic_write_text(folder / OWNER_NAME, self._record())

    def _heartbeat(self) -> None:
        warned = False
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write_owner()
            except OSError as e:
                if not warned:
                    warned = True
                    log.warning("run folder: cannot refresh %s (%s); another host may take the folder "
                                "over in %.0f s if its lock is node-local", OWNER_NAME, e, STALE_S)

    def release(self) -> None:
        """Drop the owner file, then the lock (in that order, so a waiter never takes us for a live owner)."""
        self._stop.set()
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join(HEARTBEAT_S + 5)
        for folder, fd in list(self._fds.items()):
            owner = read_owner(folder)
            if owner is not None and (owner.host, owner.pid) == (self.me.host, self.me.pid):
                (folder / OWNER_NAME).unlink(missing_ok=True)
            _unlock(fd)
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "RunFolderLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
