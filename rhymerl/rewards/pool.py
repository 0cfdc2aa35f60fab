"""A process pool that scores responses with a hard per-item timeout (a stuck thread cannot be stopped)."""

from __future__ import annotations

import importlib
import logging
import math
import pickle
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, Optional, Sequence

from rhymerl.launch.child_signals import shield_this_process, shielded_start
from rhymerl.config import RewardConfig
from rhymerl.rewards.scorers import BUILTIN_SCORERS, RewardItem, RewardResult, Scorer, resolve_kind

# Imported before a worker reports ready, so the first item's timeout is not spent importing SymPy.
DEFAULT_PRELOAD = ("math_verify", "reasoning_gym")
_MAX_START_FAILURES = 3  # a worker that cannot start this many times in a row is fatal
_START_TIMEOUT_S = 120.0
_MAX_CHUNK = 16
FUNCTION_KIND = "function"  # the scorer name under which ``reward.function`` runs

log = logging.getLogger("rhymerl.rewards")


class RewardSetupError(RuntimeError):
    """The scorers cannot run (a verifier or the user's reward function does not import)."""


class RewardErrorRate(RuntimeError):
    """Too many items of one step failed to score: the rewards would be meaningless."""


def import_error_text(name: str, e: BaseException) -> str:
    return (f"cannot import {name!r} for the reward scorers: {type(e).__name__}: {e}. "
            f"Every reward would be 0; fix the installation (or reward.function) and rerun.")


def preload_modules(names: Sequence[str]) -> Optional[str]:
    """Import ``names``; the first failure's message, or None when all import."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:
            return import_error_text(name, e)
    return None


def load_function(spec: str) -> Scorer:
    """Resolve ``reward.function`` ("module:callable"), a module-level name so it pickles to the workers."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise RewardSetupError(f"reward.function: {spec!r} is not of the form 'module:callable'")
    try:
        mod = importlib.import_module(module)
    except Exception as e:
        raise RewardSetupError(f"reward.function: {import_error_text(module, e)}") from e
    fn: Any = mod
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise RewardSetupError(f"reward.function: module {module!r} has no attribute {attr!r}")
    if not callable(fn):
        raise RewardSetupError(f"reward.function: {spec!r} is not callable")
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise RewardSetupError(f"reward.function: {spec!r} cannot be sent to the reward workers "
                               f"(use a module-level function): {type(e).__name__}: {e}") from e
    return fn


def check_error_rate(results: Sequence[RewardResult], max_rate: float) -> None:
    """Raise :class:`RewardErrorRate` when more than ``max_rate`` of a step's items failed (all-zero rewards)."""
    failed = [r for r in results if r.error is not None]
    if results and len(failed) / len(results) > max_rate:
        examples = "; ".join(sorted({r.error for r in failed})[:3])
        raise RewardErrorRate(f"{len(failed)} of {len(results)} rewards of this step failed to score "
                              f"(reward.max_error_rate={max_rate:g}); first errors: {examples}")


def score_one(item: RewardItem, kind: str, scorers: dict[str, Scorer]) -> RewardResult:
    """Run one scorer in this process, turning any exception into a 0 score."""
    t0 = time.perf_counter()
    try:
        fn = scorers.get(kind)
        if fn is None:
            raise KeyError(f"no reward scorer named {kind!r}; known: {', '.join(sorted(scorers))}")
        out = fn(item)
        res = out if isinstance(out, RewardResult) else RewardResult(score=float(out), correct=float(out) >= 1.0)
        if not math.isfinite(res.score):
            raise ValueError(f"scorer {kind!r} returned a non-finite score {res.score!r}")
    except Exception as e:  # a broken verifier must never crash the run
        res = RewardResult(score=0.0, correct=False, error=f"{type(e).__name__}: {e}"[:500])
    res.elapsed_s = time.perf_counter() - t0
    return res


def _worker_main(conn: Connection, scorers: dict[str, Scorer], preload: Sequence[str]) -> None:
    shield_this_process()  # Job-wide signals (Ctrl-C, Slurm's USR1/TERM) are the trainer's; workers end with it.
    failed = preload_modules(preload)
    if failed is not None:  # the parent aborts with this message
        conn.send(("failed", failed))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        # Each result goes back at once so the parent can restart the timeout per item.
        for seq, item, kind in msg:
            res = score_one(item, kind, scorers)
            try:
                conn.send((seq, res))
            except Exception as e:  # e.g. an unpicklable field in a custom result
                conn.send((seq, RewardResult(error=f"cannot send result: {type(e).__name__}: {e}"[:500])))


def describe_exit(code: Optional[int]) -> str:
    """A process's end as multiprocessing reports it: "killed by SIGKILL", "exit code 3"."""
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Worker:
    __slots__ = ("proc", "conn", "pid", "ready", "jobs", "deadline")

    def __init__(self, proc, conn):
        self.proc = proc
        self.conn = conn
        self.pid: int = proc.pid
        self.ready = False
        self.jobs: deque[int] = deque()  # sent, not yet answered; jobs[0] is being scored
        self.deadline = 0.0


class RewardPool:
    """Scores :class:`RewardItem` batches in ``cfg.workers`` processes; a timeout or error scores 0.
    ``cfg.workers == 0`` scores in-process without timeout (tests only). ``scorers`` adds named scorers."""

    def __init__(self, cfg: RewardConfig, scorers: Optional[dict[str, Scorer]] = None, *,
                 start_method: str = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn",
                 preload: Sequence[str] = DEFAULT_PRELOAD):
        self.cfg = cfg
        self.scorers: dict[str, Scorer] = {**BUILTIN_SCORERS, **(scorers or {})}
        self.preload = tuple(preload)
        function = cfg.function
        if function:
            self.scorers[FUNCTION_KIND] = load_function(function)
            self.preload += (function.partition(":")[0],)
        if cfg.workers == 0:
            failed = preload_modules(self.preload)
            if failed is not None:
                raise RewardSetupError(failed)
        self.stats: dict[str, Any] = {"items": 0, "errors": 0, "timeouts": 0, "restarts": 0,
                                      "calls": 0, "wall_s": 0.0, "scorer_s": 0.0, "killed_pids": []}
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # Imported once by the fork server, so replacement workers fork ready in milliseconds.
            self._ctx.set_forkserver_preload(["rhymerl.rewards.pool", *self.preload])
        self._workers: list[_Worker] = []
        self.last_restarts = 0  # workers replaced during the last score() call
        self._start_failures = 0
        self._closed = False
        for _ in range(cfg.workers):
            self._workers.append(self._spawn())

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(child, self.scorers, self.preload),
                                 name="rhymerl-reward", daemon=True)
        with shielded_start():
            proc.start()
        child.close()
        return _Worker(proc, parent)

    def _kill(self, w: _Worker) -> None:
        try:
            w.proc.kill()
        except Exception:
            pass
        w.proc.join(5)
        w.conn.close()

    def _replace(self, w: _Worker, why: str) -> _Worker:
        """Kill ``w`` (if it still runs) and start its replacement; ``why``: what happened to it."""
        self._kill(w)
        nw = self._spawn()
        self._workers[self._workers.index(w)] = nw
        self.stats["restarts"] += 1
        self.last_restarts += 1
        log.warning("reward worker pid %d %s; started a replacement (pid %d; %d replaced in this run)",
                    w.pid, why, nw.pid, self.stats["restarts"])
        return nw

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    def wait_ready(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Block until every worker has started (imports done)."""
        self._run([], timeout_s)

    def score(self, items: Sequence[RewardItem]) -> list[RewardResult]:
        if self._closed:
            raise RuntimeError("RewardPool.score called after close()")
        t0 = time.perf_counter()
        self.last_restarts = 0
        if self.cfg.function:
            kinds = [FUNCTION_KIND] * len(items)
        else:
            kinds = [resolve_kind(it, self.cfg.kind) for it in items]
        if not self._workers:
            results = [score_one(it, k, self.scorers) for it, k in zip(items, kinds)]
        else:
            results = self._run(list(zip(items, kinds)), None)
        self.stats["calls"] += 1
        self.stats["items"] += len(results)
        self.stats["wall_s"] += time.perf_counter() - t0
        for r in results:
            self.stats["scorer_s"] += r.elapsed_s
            self.stats["errors"] += int(r.error is not None)
            self.stats["timeouts"] += int(r.timed_out)
        return results

    def _run(self, jobs: list[tuple[RewardItem, str]], start_timeout: Optional[float]) -> list[RewardResult]:
        results: list[Optional[RewardResult]] = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        timeout = self.cfg.timeout_s
        start_limit = start_timeout or _START_TIMEOUT_S
        start_deadline = time.monotonic() + start_limit
        single = False  # set after an unpicklable item: send one by one to isolate it
        while True:
            now = time.monotonic()
            for w in list(self._workers):
                while w.ready and not w.jobs and pending:
                    # Chunks cut the per-item round trip; small enough to keep workers balanced.
                    k = 1 if single else max(1, min(_MAX_CHUNK, -(-len(pending) // (2 * len(self._workers)))))
                    chunk = [pending.popleft() for _ in range(min(k, len(pending)))]
                    try:
                        w.conn.send([(i, jobs[i][0], jobs[i][1]) for i in chunk])
                    except (BrokenPipeError, ConnectionResetError, EOFError):
                        # Died while idle: nothing of the chunk ran, so requeue it.
                        pending.extendleft(reversed(chunk))
                        w.proc.join(5)
                        w = self._replace(w, f"had died while idle ({describe_exit(w.proc.exitcode)})")
                        continue
                    except Exception as e:  # unpicklable: pickling fails before any byte is written
                        if len(chunk) > 1:
                            pending.extendleft(reversed(chunk))
                            single = True
                        else:
                            results[chunk[0]] = RewardResult(
                                error=f"cannot send item to a worker: {type(e).__name__}: {e}"[:500])
                        continue
                    w.jobs.extend(chunk)
                    w.deadline = now + timeout
            busy = [w for w in self._workers if w.jobs]
            starting = [w for w in self._workers if not w.ready]
            if not pending and not busy and (jobs or not starting):
                break
            if not busy and now > start_deadline:
                raise RuntimeError(f"reward workers did not start within {start_limit:.0f} s")
            wake = min((w.deadline for w in busy), default=start_deadline)
            watched = busy + starting
            by_conn = {id(w.conn): w for w in watched}
            for c in wait([w.conn for w in watched], timeout=max(0.0, wake - now)):
                w = by_conn[id(c)]
                while w in self._workers:
                    try:
                        if not c.poll():
                            break
                        msg = c.recv()
                    except (EOFError, OSError):
                        self._on_death(w, results, pending)
                        break
                    if msg[0] == "failed":
                        self.close()
                        raise RewardSetupError(msg[1])
                    if msg[0] == "ready":
                        w.ready = True
                        self._start_failures = 0
                    elif w.jobs and msg[0] == w.jobs[0]:
                        results[w.jobs.popleft()] = msg[1]
                        w.deadline = time.monotonic() + timeout
            now = time.monotonic()
            for w in list(self._workers):
                if w.jobs and now >= w.deadline:
                    results[w.jobs.popleft()] = RewardResult(
                        score=0.0, timed_out=True, elapsed_s=timeout,
                        error=f"timed out after {timeout:g} s (worker pid {w.pid} killed)")
                    pending.extendleft(reversed(w.jobs))
                    self.stats["killed_pids"].append(w.pid)
                    self._replace(w, f"overran reward.timeout_s={timeout:g} s on an item (scored 0) and was killed")
        return [r if r is not None else RewardResult(error="lost") for r in results]

    def _on_death(self, w: _Worker, results: list[Optional[RewardResult]], pending: deque) -> None:
        w.proc.join(5)
        code = w.proc.exitcode
        how = describe_exit(code)
        why = f"died ({how})"
        if w.jobs:
            results[w.jobs.popleft()] = RewardResult(score=0.0, error=f"reward worker pid {w.pid} died ({how})")
            pending.extendleft(reversed(w.jobs))
            why = f"died ({how}) while scoring an item (scored 0; the rest of its items go to other workers)"
        elif not w.ready:
            self._start_failures += 1
            if self._start_failures >= _MAX_START_FAILURES:
                raise RuntimeError(f"reward worker failed to start {self._start_failures} times "
                                   f"(last exit code {code}); check the scorers and preload modules")
            why = f"died while starting ({how})"
        self._replace(w, why)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                if not w.jobs and w.ready:
                    w.conn.send(None)
            except Exception:
                pass
        for w in self._workers:
            if not w.ready:
                w.proc.kill()  # still importing: nothing to finish
            w.proc.join(1)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(5)
            w.conn.close()
        self._workers = []

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
