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


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The deterministic tiny Llama (built once into the repo's .cache)."""
    from rhymerl.config import ModelConfig
    from rhymerl.models import resolve_model

    return resolve_model(ModelConfig(path="builtin:tiny"))
