"""Start N local ranks of a script on loopback (its ``__main__`` guard is needed: megatron re-imports it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchError(RuntimeError):
    pass


def run_ranks(script: Path, args: Sequence[str], nproc: int, timeout_s: float = 300.0,
              env: Optional[dict] = None, log_dir: Optional[Path] = None) -> None:
    """Run ``python script *args`` on ``nproc`` ranks; raise LaunchError with the failing rank's log tail."""
    port = free_port()
    log_dir = Path(log_dir) if log_dir else None
    procs, logs = [], []
    for rank in range(nproc):
        e = dict(os.environ)
        e.update(env or {})
        e.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port))
        e.setdefault("OMP_NUM_THREADS", "1")
        if log_dir:
            log_dir.mkdir(parents=True, exist_ok=True)
            f = open(log_dir / f"rank{rank}.log", "w+b")
        else:
            f = tempfile.TemporaryFile()
        logs.append(f)
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=e, stdout=f, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    failed = None
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                failed = ("timeout", None)
                break
            bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                failed = ("exit", bad[0])
                break
            time.sleep(0.05)
        if failed is None:
            bad = [i for i, p in enumerate(procs) if p.returncode != 0]
            if bad:
                failed = ("exit", bad[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failed is not None:
        kind, rank = failed
        rank = 0 if rank is None else rank
        logs[rank].seek(0)
        tail = logs[rank].read().decode(errors="replace")[-6000:]
        for f in logs:
            f.close()
        what = f"timed out after {timeout_s:.0f} s" if kind == "timeout" else f"rank {rank} exited {procs[rank].returncode}"
        raise LaunchError(f"{script.name} {' '.join(args)}: {what}\n--- rank {rank} log tail ---\n{tail}")
    for f in logs:
        f.close()
