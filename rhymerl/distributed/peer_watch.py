"""Name the rank that died (gloo/NCCL do not) from heartbeats in the job's rendezvous store."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, Sequence
from rhymerl.outputs.run_lock import pid_alive

log = logging.getLogger("rhymerl")

BEAT_S = 1.0
# How long a failing rank watches the others' beats before calling the silent ones dead.
DIAGNOSE_S = 3 * BEAT_S + 1.0
STORE_TIMEOUT_S = 10.0
# Text of the errors gloo and NCCL raise when a peer's process is gone.
_PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
                "remote worker crashing", "NCCL communicator was aborted", "remote process exited",
                "Socket Timeout", "Connection timed out")


class PeerLost(RuntimeError):
    """A rank of the job died; the message names it, its host, and what to do."""


@dataclass(frozen=True)
class Peer:
    rank: int
    host: str
    pid: int

    def describe(self, note: str = "") -> str:
        return f"rank {self.rank} on host {self.host} (pid {self.pid}{note})"


def looks_like_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a collective that lost its peer."""
    seen = 0
    e: Optional[BaseException] = exc
    while e is not None and seen < 10:
        name = type(e).__name__
        if name in ("DistNetworkError", "DistBackendError", "DistStoreError"):
            return True
        if any(p in str(e) for p in _PEER_ERRORS):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


def silent_ranks(before: dict[int, str], after: dict[int, str], dead_here: set[int]) -> list[int]:
    """Ranks whose beat did not move without an exit mark, or whose pid on this host is gone."""
    out = []
    for rank, beat in sorted(after.items()):
        if rank in dead_here:
            out.append(rank)
        elif beat == before.get(rank) and not beat.startswith("exit:"):
            out.append(rank)
    return out


def lost_message(lost: Sequence[Peer], store_gone: bool, when: str) -> str:
    """The one line a surviving rank stops with."""
    note = ", which held the rendezvous store" if store_gone else ""
    who = " and ".join(p.describe(note if p.rank == 0 else "") for p in lost)
    return (f"{who} died {when}; this rank stops too, without a checkpoint of this step: find why in "
            "that rank's log (out of memory, node failure, a kill), then resume from the newest checkpoint")


class PeerWatch:
    """This rank's registration and heartbeat, and the diagnosis when a collective fails."""

    def __init__(self, store, rank: int, world_size: int, *, host: Optional[str] = None,
                 pid_alive: Optional[Callable[[int], bool]] = None, prefix: str = "rhymerl/peers/"):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.host = host or socket.gethostname()
        self.prefix = prefix
        self._alive = pid_alive or _pid_alive
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._count = 0
        self._exited = False
        # Set at the first failed store operation: torch prints a C++ backtrace for each one on a dead store.
        self._store_down = False
        self.peers: dict[int, Peer] = {}
        self._pid_visible: set[int] = set()
        self.lost: list[Peer] = []
        self._set(f"peer/{rank}", json.dumps({"host": self.host, "pid": os.getpid()}))
        self._beat()
        try:
            self._load_peers()
        except Exception:  # noqa: BLE001 - a slow rank: the heartbeat thread loads them later
            pass
        self._thread = threading.Thread(target=self._run, name="rhymerl-peer-watch", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, rank: int, world_size: int) -> Optional["PeerWatch"]:
        """A watch over the store at MASTER_ADDR:MASTER_PORT; None when there is none to reach."""
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if world_size < 2 or not addr or not port:
            return None
        try:
            import torch.distributed as dist

            store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S),
                                  wait_for_workers=False)
            # A torchrun agent keeps its store across worker restarts: each attempt has its own keys.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            return cls(store, rank, world_size, prefix=f"rhymerl/peers/{attempt}/")
        except Exception as e:  # noqa: BLE001 - without it, a lost rank is only not named
            log.warning("peer watch: cannot reach the rendezvous store at %s:%s (%s); a rank that dies will not be "
                        "named", addr, port, e)
            return None

    def _usable(self) -> bool:
        """Whether the store may still answer: not failed yet, and rank 0 alive if it is on this host."""
        if self._store_down:
            return False
        if 0 in self._pid_visible and not self._alive(self.peers[0].pid):
            self._store_down = True
        return not self._store_down

    def _op(self, fn, *args, wait_s: float = -1, may_time_out: bool = False):
        """``fn(*args)`` on the store, one operation at a time (``wait_s``: for the lock, -1 = forever). A
        failure means the store is gone, except a timeout with ``may_time_out``."""
        if not self._usable():
            raise ConnectionError("the rendezvous store is gone")
        if not self._lock.acquire(timeout=wait_s):
            raise TimeoutError("the rendezvous store is busy")
        try:
            return fn(*args)
        except Exception as e:
            if not (may_time_out and "timeout" in str(e).lower()):
                self._store_down = True
            raise
        finally:
            self._lock.release()

    def _set(self, key: str, value: str) -> None:
        self._op(self.store.set, self.prefix + key, value)

    def _get_many(self, keys: list[str]) -> list[str]:
        return [v.decode() for v in self._op(self.store.multi_get, [self.prefix + k for k in keys])]

    def _beat(self) -> None:
        self._count += 1
        self._set(f"beat/{self.rank}", str(self._count))

    def _load_peers(self) -> None:
        if len(self.peers) == self.world_size:
            return
        self._op(self.store.wait, [self.prefix + f"peer/{r}" for r in range(self.world_size)],
                 timedelta(seconds=STORE_TIMEOUT_S), may_time_out=True)
        raw = self._get_many([f"peer/{r}" for r in range(self.world_size)])
        for r, text in enumerate(raw):
            d = json.loads(text)
            self.peers[r] = Peer(r, d["host"], int(d["pid"]))
        # A same-host rank whose pid is not seen now runs in another pid namespace: only its beat can tell.
        self._pid_visible = {p.rank for p in self.peers.values()
                             if p.rank != self.rank and p.host == self.host and self._alive(p.pid)}

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beat()
                self._load_peers()
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 died)
                pass
            dead = [p for p in self._same_host_peers() if not self._alive(p.pid)]
            if dead and not self.lost:
                self.lost = dead
                log.warning("%s died; rank %d stops at its next collective", " and ".join(p.describe() for p in dead),
                            self.rank)

    def _same_host_peers(self) -> list[Peer]:
        """The other ranks of this host whose pid this process can see."""
        return [p for r, p in self.peers.items() if r in self._pid_visible]

    def diagnose(self, window_s: float = DIAGNOSE_S) -> tuple[list[Peer], bool]:
        """(dead ranks, whether the store is gone) after watching the beats up to ``window_s``."""
        self._stop.set()
        self._thread.join(STORE_TIMEOUT_S)
        try:
            self._set(f"beat/{self.rank}", "exit:lost-peer")
            self._exited = True
        except Exception:  # noqa: BLE001
            return self._store_gone()
        others = [r for r in range(self.world_size) if r != self.rank]
        try:
            self._load_peers()
            before = dict(zip(others, self._get_many([f"beat/{r}" for r in others])))
        except Exception:  # noqa: BLE001
            return self._store_gone()
        deadline = time.monotonic() + window_s
        while True:
            dead_here = {p.rank for p in self._same_host_peers() if not self._alive(p.pid)}
            time.sleep(min(BEAT_S / 2, max(0.0, deadline - time.monotonic())))
            try:
                after = dict(zip(others, self._get_many([f"beat/{r}" for r in others])))
            except Exception:  # noqa: BLE001
                return self._store_gone()
            moved = {r for r in others if after[r] != before[r] or after[r].startswith("exit:")}
            silent = silent_ranks(before, after, dead_here)
            if time.monotonic() >= deadline or set(others) <= moved | dead_here:
                return [self.peers[r] for r in silent], False

    def _store_gone(self) -> tuple[list[Peer], bool]:
        p0 = self.peers.get(0)
        return ([p0] if p0 is not None else [Peer(0, os.environ.get("MASTER_ADDR", "?"), 0)]), True

    def explain(self, exc: BaseException, when: str) -> Optional[PeerLost]:
        """A PeerLost naming the dead ranks when ``exc`` lost its peer and some rank is gone; else None."""
        if not looks_like_peer_failure(exc):
            return None
        lost, store_gone = self.diagnose()
        if not lost:
            return None
        self.lost = lost
        err = PeerLost(lost_message(lost, store_gone, when))
        err.__cause__ = exc  # the collective's own traceback goes to the error log with it
        return err

    def close(self, reason: str = "done", linger_s: float = 0.0) -> None:
        """Stop beating and mark the exit; ``linger_s``: rank 0 keeps the store up until the others exit."""
        self._stop.set()
        self._thread.join(1.0)  # not long: the job step is being torn down
        try:
            if not self._exited:
                self._op(self.store.set, self.prefix + f"beat/{self.rank}", f"exit:{reason}", wait_s=1.0)
                self._exited = True
        except Exception:  # noqa: BLE001
            return
        deadline = time.monotonic() + linger_s
        lost = {p.rank for p in self.lost}
        waiting = [r for r in range(self.world_size) if r != self.rank and r not in lost]
        while waiting and time.monotonic() < deadline:
            try:
                beats = self._get_many([f"beat/{r}" for r in waiting])
            except Exception:  # noqa: BLE001
                return
            waiting = [r for r, b in zip(waiting, beats) if not b.startswith("exit:")]
            time.sleep(0.2)


def _pid_alive(pid: int) -> bool:

    return pid_alive(pid, 0)
