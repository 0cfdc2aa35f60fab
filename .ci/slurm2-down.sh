#!/usr/bin/env bash
# Stop the two-node test cluster of .ci/slurm2-up.sh by the PIDs it recorded (never by name),
# then remove its network namespaces (which removes the veth pair) and their hosts files.
set -uo pipefail
S="${RHYMERL_SLURM2_DIR:-/tmp/rhymerl-slurm2}"
NS=(rhymerl-mn0 rhymerl-mn1)

source "$(dirname "${BASH_SOURCE[0]}")/slurm-lib.sh"

if [[ -x "$S/login" && -f "$S/slurmctld.pid" ]] && kill -0 "$(cat "$S/slurmctld.pid")" 2>/dev/null; then
  # Cancel our test jobs first so their steps do not outlive slurmd.
  timeout 5 "$S/login" scancel --full --quiet --user=root 2>/dev/null || true
fi
slurm_stop slurmd-rmn0 "$S/slurmd-rmn0.pid"
slurm_stop slurmd-rmn1 "$S/slurmd-rmn1.pid"
slurm_stop slurmctld "$S/slurmctld.pid"
slurm_stop munged "$S/munged.pid"
rm -f "$S/munge-run/munged.pid"
for ns in "${NS[@]}"; do
  [[ -e "/run/netns/$ns" ]] && ip netns del "$ns"
  rm -rf "/etc/netns/$ns"
done
echo "[slurm2-down] stopped ($S)" >&2
