#!/usr/bin/env bash
# Stop the test cluster started by .ci/slurm-up.sh, by the PIDs it recorded (never by name).
set -uo pipefail
S="${RHYMERL_SLURM_DIR:-/tmp/rhymerl-slurm}"

stop() {  # stop NAME PIDFILE: TERM, wait up to 10 s, then KILL
  local name=$1 pidfile=$2 pid
  [[ -f "$pidfile" ]] || return 0
  pid=$(cat "$pidfile")
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "[slurm-down] $name ($pid) ignored TERM; killing" >&2
      kill -KILL "$pid" 2>/dev/null
    fi
  fi
  rm -f "$pidfile"
}

if [[ -f "$S/slurm.conf" && -f "$S/slurmctld.pid" ]]; then
  # Cancel our test jobs first so their steps do not outlive slurmd.
  SLURM_CONF="$S/slurm.conf" timeout 5 scancel --full --quiet --user=root 2>/dev/null || true
fi
stop slurmd "$S/slurmd.pid"
stop slurmctld "$S/slurmctld.pid"
stop munged "$S/munged.pid"
rm -f "$S/munge-run/munged.pid"
echo "[slurm-down] stopped ($S)" >&2
