#!/usr/bin/env bash
# The README's main-job command: installs what it needs, then trains.
#   bash launch/run.sh [CONFIG] [key.sub=value ...]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bash launch/setup.sh
config="${1:-configs/tiny-cpu.yaml}"
[ $# -gt 0 ] && shift
# The venv setup.sh made: .venv, or RHYMERL_VENV (relative to the repo root).
exec "${RHYMERL_VENV:-.venv}/bin/python" -m rhymerl train "$config" "$@"
