#!/usr/bin/env bash
# The README's test command: installs what it needs, starts a local one-node Slurm
# when it can (root + Debian packages), runs the whole suite, stops what it started.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bash launch/setup.sh
if [ "${RHYMERL_SLURM:-auto}" != off ] && [ -f .ci/slurm-up.sh ]; then
  if bash .ci/slurm-up.sh; then
    trap 'bash .ci/slurm-down.sh || true' EXIT
  else
    echo "[test] local Slurm could not start; Slurm tests will be skipped" >&2
  fi
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/python -m pytest "$@"
