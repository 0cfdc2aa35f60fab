#!/usr/bin/env bash
# One-GPU smoke check of the colocated cluster path, a few minutes end to end:
#   1. an NCCL group with real collectives through rhymerl.collectives (and NCCL refusing a CPU tensor);
#   2. the vLLM engine's sleep (level 2) / wake with device memory measured before and after;
#   3. one colocated RL step of the tiny model, every collective audited for its device;
#   4. bench rollout --quick.
# Usage: bash tests/gpu/smoke.sh [OUT_DIR]     (needs a CUDA device and the GPU install: launch/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-runs/gpu-smoke}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export RHYMERL_CACHE=${RHYMERL_CACHE:-$PWD/.cache/models}
mkdir -p "$OUT"
nvidia-smi -L
step() { echo "== $1"; shift; "$@" | tee -a "$OUT/smoke.jsonl"; }

step "nccl collectives" "$PY" tests/gpu/smoke_checks.py nccl
step "engine sleep/wake" "$PY" tests/gpu/smoke_checks.py sleep
echo "== colocated RL step (tiny model)"
rm -rf "$OUT/step"
RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-29517} \
  "$PY" tests/integration/colocated_step_worker.py "$OUT/step" configs/tiny-cpu.yaml model.path=builtin:tiny \
  "run.output_dir=$OUT/step/run" run.max_steps=1 data.size=4 data.prompts_per_step=2 rollout.n=2 \
  rollout.max_tokens=16 rollout.gpu_memory_utilization=0.3 reward.workers=0 tracking.wandb=disabled \
  checkpoint.every_steps=1 > "$OUT/step.log" 2>&1 || { tail -50 "$OUT/step.log"; exit 1; }
cat "$OUT/step/rank0.json"; echo
step "colocated step metrics" "$PY" tests/gpu/smoke_checks.py step "$OUT/step/run"
echo "== bench rollout --quick"
"$PY" -m rhymerl bench rollout --quick --json --model builtin:tiny | tee "$OUT/bench-rollout.json"
echo "gpu smoke: all checks passed ($OUT)"
