#!/usr/bin/env bash
# The README's test command: installs what it needs, starts a local one-node Slurm
# when it can (root + Debian packages), runs the whole suite, stops what it started.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bash launch/setup.sh
stop_clusters=()  # run on exit: the stop scripts of the clusters this run started
trap 'for s in "${stop_clusters[@]}"; do bash "$s" || true; done' EXIT
if [ "${RHYMERL_SLURM:-auto}" != off ] && [ -f .ci/slurm-up.sh ]; then
  if bash .ci/slurm-up.sh; then
    stop_clusters+=(.ci/slurm-down.sh)
  else
    echo "[test] local Slurm could not start; Slurm tests will be skipped" >&2
  fi
fi
# The two-node cluster (two slurmd in network namespaces) for the multi-node test; without it
# (not root, no netns support) that test skips and says why.
if [ "${RHYMERL_SLURM:-auto}" != off ] && [ -f .ci/slurm2-up.sh ]; then
  if bash .ci/slurm2-up.sh; then
    stop_clusters+=(.ci/slurm2-down.sh)
  else
    echo "[test] two-node Slurm could not start; the multi-node Slurm test will be skipped" >&2
    bash .ci/slurm2-down.sh || true
  fi
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# The slowest tests, so a suite creeping toward its 30-minute budget shows where.
"${RHYMERL_VENV:-.venv}/bin/python" -m pytest --durations=25 "$@"
