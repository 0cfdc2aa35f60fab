#!/usr/bin/env bash
# Stop the test cluster started by .ci/slurm-up.sh, by the PIDs it recorded (never by name).
set -uo pipefail
S="${RHYMERL_SLURM_DIR:-/tmp/rhymerl-slurm}"

source "$(dirname "${BASH_SOURCE[0]}")/slurm-lib.sh"

if [[ -f "$S/slurm.conf" && -f "$S/slurmctld.pid" ]]; then
  # Cancel our test jobs first so their steps do not outlive slurmd.
  SLURM_CONF="$S/slurm.conf" timeout 5 scancel --full --quiet --user=root 2>/dev/null || true
fi
slurm_stop slurmd "$S/slurmd.pid"
slurm_stop slurmctld "$S/slurmctld.pid"
slurm_stop munged "$S/munged.pid"
rm -f "$S/munge-run/munged.pid"
echo "[slurm-down] stopped ($S)" >&2
