"""Exact resume: 4 uninterrupted steps == 2 steps, SIGKILL after the checkpoint, resume, 2 more.

Real trainer processes (vLLM + HistoSpec rollouts, megatron-core training, reward pool) on
the tiny model; the killed process gets no chance to clean up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rhymerl.outputs.checkpoint import verify_checkpoint

pytestmark = [pytest.mark.cpu, pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BASE = ["model.path=builtin:tiny", "run.max_steps=4", "run.epochs=4", "data.size=8", "data.prompts_per_step=4",
        "rollout.max_tokens=16", "checkpoint.every_steps=2", "checkpoint.keep_last=3", "reward.workers=1",
        "tracking.wandb=offline", "algo.lr=1e-4"]
# Figures that depend only on the computation (not on wall time).
EXACT_KEYS = ("reward/mean", "response/len_mean", "train/loss", "train/grad_norm", "train/entropy",
              "histospec/draft_proposed", "histospec/draft_accepted", "histopipe/pred_len_mean")


def _cmd(out: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "rhymerl", "train", str(REPO / "configs/tiny-cpu.yaml"), f"run.output_dir={out}",
            *BASE, *extra]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _rows(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _export(ckpt: Path, dest: Path) -> dict:
    from safetensors.torch import load_file

    res = subprocess.run([sys.executable, "-m", "rhymerl", "export", str(ckpt), "--hf", str(dest)], cwd=REPO,
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = {}
    for f in sorted(dest.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["sampled", "greedy"])
def test_sigkill_after_checkpoint_then_resume_is_exact(tmp_path, temperature):
    # Token-exact replay of sampled rollouts needs draft lengths that do not depend on timings.
    extra = [f"rollout.temperature={temperature}", "histospec.step_cost=prior"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    res = subprocess.run(_cmd(full, extra), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]

    log = open(tmp_path / "cut.log", "w")
    proc = subprocess.Popen(_cmd(cut, extra), cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    ckpt2 = cut / "checkpoints" / "step-000002"
    deadline = time.monotonic() + 300
    while not ((ckpt2 / "manifest.json").is_file() and verify_checkpoint(ckpt2, hashes=False) is None):
        assert proc.poll() is None, (tmp_path / "cut.log").read_text()[-4000:]
        assert time.monotonic() < deadline, "no checkpoint at step 2"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (cut / "checkpoints" / "step-000004").exists()

    res = subprocess.run(_cmd(cut, extra), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resumed from" in res.stderr

    a, b = _rows(full), _rows(cut)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3]
    for step in (2, 3):
        for k in EXACT_KEYS:
            assert a[step][k] == b[step][k], f"step {step} {k}: {a[step][k]} uninterrupted vs {b[step][k]} resumed"
    assert any(a[s]["histospec/draft_proposed"] > 0 for s in (2, 3)), "epoch 2 should draft from history"
    wa = _export(full / "checkpoints" / "step-000004", tmp_path / "hf-full")
    wb = _export(cut / "checkpoints" / "step-000004", tmp_path / "hf-cut")
    assert wa.keys() == wb.keys()
    diff = [k for k in wa if not (wa[k] == wb[k]).all()]
    assert not diff, f"final weights differ in {diff[:5]}"
    # The resumed run continued the same W&B run id.
    ids = {p.name.rsplit("-", 1)[-1] for p in (cut / "wandb").glob("offline-run-*")}
    assert len(ids) == 1, ids


def test_bad_resume_path_ends_every_rank_with_the_message(tmp_path):
    """Two ranks as srun starts them (no torchrun agent to kill the survivors): both exit, quickly,
    naming the path, instead of rank 1 waiting for rank 0's broadcast until the collective timeout."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bad = tmp_path / "no-such-checkpoint"
    cmd = [sys.executable, "-m", "rhymerl.launch.rank_main", str(REPO / "configs/tiny-cpu.yaml"), "model.path=builtin:tiny",
           "parallel.tensor_parallel=2", f"run.output_dir={tmp_path / 'run'}", f"checkpoint.resume={bad}",
           "tracking.wandb=disabled"]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**_env(), "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode != 0, out[-3000:]
        assert f"checkpoint.resume='{bad}'" in out and "does not exist" in out, f"rank {rank}:\n{out[-3000:]}"
