"""Shared fixtures. Every test declares the hardware it needs with a marker:
`cpu` (any machine) or `gpu` (a CUDA device; skipped elsewhere)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("RHYMERL_CACHE", str(REPO / ".cache" / "models"))
# Single-threaded torch is much faster for tiny models on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
os.environ.setdefault("WANDB_DIR", str(REPO / ".cache" / "wandb"))
os.environ.setdefault("WANDB_CACHE_DIR", str(REPO / ".cache" / "wandb-cache"))

HARDWARE_MARKERS = {"cpu", "gpu"}


def pytest_collection_modifyitems(config, items):
    missing = [it.nodeid for it in items if not HARDWARE_MARKERS & {m.name for m in it.iter_markers()}]
    if missing:
        raise pytest.UsageError("tests without a hardware marker (cpu or gpu): " + ", ".join(missing[:10]))
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for it in items:
            if it.get_closest_marker("gpu"):
                it.add_marker(skip)


@pytest.fixture
def one_rank_gloo(tmp_path):
    """torch.distributed as a one-rank gloo world in this process, destroyed afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("torch.distributed already runs in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The deterministic tiny Llama (built once into the repo's .cache)."""
    from rhymerl.config import ModelConfig
    from rhymerl.models import resolve_model

    return resolve_model(ModelConfig(path="builtin:tiny"))


# Every process the suite starts (subprocesses, Slurm jobs through sbatch's exported
# environment) carries this marker; any still alive at the end was left running.
SESSION_MARKER = "RHYMERL_TEST_SESSION"
os.environ.setdefault(SESSION_MARKER, f"{os.getpid()}-{os.urandom(4).hex()}")


def _marked_processes() -> list[tuple[int, str]]:
    """Marked processes that are not descendants of this one (those end with it)."""
    want = f"{SESSION_MARKER}={os.environ[SESSION_MARKER]}".encode()
    parent, found = {}, []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if want in (d / "environ").read_bytes().split(b"\0"):
                found.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]))
        except (OSError, ValueError, IndexError):
            continue

    def ours(pid: int) -> bool:
        while pid > 1:
            if pid == os.getpid():
                return True
            pid = parent.get(pid, 0)
        return False

    return [(pid, cmd) for pid, cmd in found if not ours(pid)]


def pytest_sessionfinish(session, exitstatus):
    """The suite leaves nothing running: fail if a process it started outlives it."""
    if not Path("/proc/self/environ").exists() or os.environ[SESSION_MARKER].split("-")[0] != str(os.getpid()):
        return
    import time

    deadline = time.monotonic() + 15  # helpers exit within seconds of their parent
    left = _marked_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _marked_processes()
    if left:
        print("\nprocesses started by the tests are still running:\n"
              + "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in left))
        session.exitstatus = 1
