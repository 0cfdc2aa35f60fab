#!/usr/bin/env bash
# The GPU node smoke check: one command on one GPU node, to run before submitting a long job.
# It trains the small built-in model (SmolLM2-135M) for a few RL steps on the cluster path,
# every GPU of the node its own rank: NCCL, bfloat16 with megatron's distributed optimizer,
# one vLLM engine per GPU (external launcher, CUDA graphs, sleep level 2 between rollouts),
# HistoSpec drafting, live HistoPipe across the engines, every collective audited for its
# device. Run 1 trains 3 steps, run 2 resumes from its checkpoint to step 4; then
# tests/gpu/node_checks.py prints one PASS/FAIL line per check and a verdict (exit 1 on a FAIL).
#
#   bash tests/gpu/node_smoke.sh [--dry-run] [OUT_DIR] [key.sub=value ...]
#   sbatch tests/gpu/node_smoke.sbatch          (from the repository root)
#
# --dry-run runs anywhere, without a GPU (the login node first): it writes the config for the
# node, checks it (--print-config, then the model's shape, the world size and the memory plan),
# prints the commands the real run would run and the checks it would make, and exits 0.
# The node: SMOKE_GPUS GPUs (default: those this machine sees, else 8) of SMOKE_DEVICE_GB
# each (default: GPU 0's total, else 85, what an 80 GB H100 reports). key.sub=value overrides
# go into the config (e.g. rollout.gpu_memory_utilization=0.2). PYTHON: the interpreter
# (default .venv/bin/python, from launch/setup.sh). The real run needs two or more GPUs.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
OUT=runs/gpu-node-smoke
if [[ $# -gt 0 && "$1" != *=* ]]; then OUT=$1; shift; fi
EXTRA=("$@")
# Bounds on each invocation (seconds), so that a rank stuck in a collective fails the check
# instead of holding the node: with the checks before them, even a hung run ends within about
# ten minutes. A slow shared file system (imports, compile cache) may need more: raise them
# with SMOKE_RUN1_TIMEOUT_S / SMOKE_RUN2_TIMEOUT_S.
RUN1_TIMEOUT_S=${SMOKE_RUN1_TIMEOUT_S:-300}
RUN2_TIMEOUT_S=${SMOKE_RUN2_TIMEOUT_S:-210}

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

GPU_FACTS=$("$PY" -c "import torch
n = torch.cuda.device_count()
print(n, round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1) if n else 0)")
read -r SEEN SEEN_GB <<< "$GPU_FACTS"
GPUS=${SMOKE_GPUS:-$SEEN}
DEVICE_GB=${SMOKE_DEVICE_GB:-$SEEN_GB}
if (( DRY )) && [[ "$GPUS" == 0 ]]; then GPUS=8; fi
if [[ "$DEVICE_GB" == 0 ]]; then DEVICE_GB=85; fi
if (( ! DRY && GPUS < 2 )); then
  echo "node smoke: this machine shows $GPUS GPU(s); the check needs 2 or more (one rank each, live HistoPipe across them)" >&2
  exit 2
fi
# At least one prompt per data-parallel rank; every prompt is revisited each step (data.size ==
# prompts per step), so HistoSpec has history to draft from at every step after the first.
PROMPTS=$(( GPUS > 8 ? GPUS : 8 ))

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CFG=$OUT/node-smoke.yaml
echo "== node: $GPUS GPUs of $DEVICE_GB GB (seen here: $SEEN); OUT=$OUT"

echo "== config: configs/tiny-cpu.yaml + tests/gpu/node-smoke.yaml -> $CFG"
"$PY" tests/gpu/node_plan.py config configs/tiny-cpu.yaml tests/gpu/node-smoke.yaml "$CFG" \
  "run.output_dir=$OUT/run" "parallel.world_size=$GPUS" "data.prompts_per_step=$PROMPTS" "data.size=$PROMPTS" \
  ${EXTRA[@]+"${EXTRA[@]}"}
echo "== --print-config (keys, data, tasks, lengths) -> $OUT/print-config.yaml"
"$PY" -m rhymerl train "$CFG" "memory.device_gb=$DEVICE_GB" --print-config > "$OUT/print-config.yaml"
grep '^#' "$OUT/print-config.yaml" || true
echo "== plan (model shape, world size, engine layout, memory of one $DEVICE_GB GB GPU)"
"$PY" tests/gpu/node_plan.py plan "$CFG" "$DEVICE_GB"

TORCHRUN=("$PY" -m torch.distributed.run --standalone "--nproc_per_node=$GPUS" tests/gpu/audited_rank.py)
RUN1=(timeout -k 30 "$RUN1_TIMEOUT_S" "${TORCHRUN[@]}" "$OUT/ranks-run1" "$CFG" run.max_steps=3)
RUN2=(timeout -k 30 "$RUN2_TIMEOUT_S" "${TORCHRUN[@]}" "$OUT/ranks-run2" "$CFG" run.max_steps=4)
CHECK=("$PY" tests/gpu/node_checks.py "$OUT")
echo "== commands"
echo "  run 1 (3 steps, fresh):       $(printf '%q ' "${RUN1[@]}")| tee $OUT/run1.log"
echo "  run 2 (resumes, to 4 steps):  $(printf '%q ' "${RUN2[@]}")| tee $OUT/run2.log"
echo "  checks:                       $(printf '%q ' "${CHECK[@]}")"
echo "== checks"
"$PY" tests/gpu/node_checks.py --list
if (( DRY )); then
  echo "dry run: config and plan checked, nothing started"
  exit 0
fi

run_logged() {  # run_logged NAME CMD...: the command's output to OUT/NAME.log and the console, its status to OUT/NAME.rc
  local name=$1 rc
  shift
  echo "== $name"
  set +e
  "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  echo "$rc" > "$OUT/$name.rc"
  echo "== $name exited $rc"
  return "$rc"
}

nvidia-smi -L || true
# Only what this script writes: a fresh run must not resume an earlier smoke run's checkpoints.
rm -rf "$OUT/run" "$OUT/ranks-run1" "$OUT/ranks-run2" "$OUT/metrics-run1.jsonl" "$OUT/checkpoints-run1.txt" \
  "$OUT/run1.log" "$OUT/run2.log" "$OUT/run1.rc" "$OUT/run2.rc"
t0=$SECONDS
rc1=0
run_logged run1 "${RUN1[@]}" || rc1=$?
# What run 1 left, before run 2 rewrites the run folder.
cp "$OUT/run/metrics.jsonl" "$OUT/metrics-run1.jsonl" 2>/dev/null || true
ls "$OUT/run/checkpoints" > "$OUT/checkpoints-run1.txt" 2>/dev/null || true
if (( rc1 == 0 )); then run_logged run2 "${RUN2[@]}" || true; fi
echo "== checks (runs took $(( SECONDS - t0 )) s)"
"${CHECK[@]}"
