"""Each megatron patch is needed: the operation that hits its call site fails without it and
works with it (all other patches applied). Real megatron-core 0.16.1 on gloo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.integration, pytest.mark.slow]

PROBE = Path(__file__).with_name("megatron_patch_probe.py")

# patch -> the operation that reaches its call site (single process).
SINGLE = {
    "cuda_current_device": "forward",
    "cpu_rng_tracker": "build",
    "schedules_device": "forward",
    "optimizer_device": "train",
    "causal_mask_device": "forward_unfused",
    "grad_clip_cpu": "train",
    "checkpoint_rng": "train_recompute",
    "checkpoint_without_output_te": "train_recompute_norms",
}
# Pipeline-only call sites: 2 ranks at PP=2 with tied embeddings.
PIPELINE = {"cuda_synchronize": "forward", "tensor_cuda": "build"}


def _rows(text: str) -> dict:
    rows = [json.loads(line[len("PROBE "):]) for line in text.splitlines() if line.startswith("PROBE ")]
    return {r["patch"]: r for r in rows}


@pytest.fixture(scope="module")
def single_rows(tiny_model_dir) -> dict:
    spec = ",".join(f"{p}:{op}" for p, op in SINGLE.items())
    done = subprocess.run([sys.executable, str(PROBE), str(tiny_model_dir), "1", "1", spec],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return _rows(done.stdout)


@pytest.fixture(scope="module")
def pipeline_rows(tmp_path_factory) -> dict:
    from rhymerl.config import ModelConfig
    from rhymerl.models.tiny import TinyShape
    from rhymerl.models import resolve_model
    from rhymerl.training.local_launch import run_ranks

    tied = resolve_model(ModelConfig(path="builtin:tiny"), TinyShape(architecture="qwen2", tie_word_embeddings=True))
    logs = tmp_path_factory.mktemp("probe")
    spec = ",".join(f"{p}:{op}" for p, op in PIPELINE.items())
    run_ranks(PROBE, [str(tied), "1", "2", spec], 2, timeout_s=180, log_dir=logs)
    return _rows((logs / "rank0.log").read_text())


def test_every_patch_is_probed():
    import megatron_patches

    assert set(SINGLE) | set(PIPELINE) == set(megatron_patches.PATCHES)


@pytest.mark.parametrize("patch", sorted(SINGLE))
def test_patch_needed_single_process(single_rows, patch):
    row = single_rows[patch]
    assert row["with"] == "ok"
    assert row["without"] != "ok", f"{patch} is not needed by {row['op']} any more: drop it"


@pytest.mark.parametrize("patch", sorted(PIPELINE))
def test_patch_needed_pipeline(pipeline_rows, patch):
    row = pipeline_rows[patch]
    assert row["with"] == "ok"
    assert row["without"] != "ok", f"{patch} is not needed by {row['op']} any more: drop it"
