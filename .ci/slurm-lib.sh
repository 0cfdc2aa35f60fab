# Functions for the test-cluster scripts (.ci/slurm-up.sh, slurm-down.sh, slurm2-up.sh,
# slurm2-down.sh): install, munged, the slurm.conf settings every test cluster needs, stop by
# recorded PID.
# Source it; the functions use only their arguments.

slurm_alive() {  # slurm_alive PIDFILE: the process it names is running
  [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

slurm_install() {  # install Debian's Slurm and munge unless present (hosts without systemd: nothing starts)
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
     || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    echo "[slurm] installing slurmctld slurmd slurm-client munge (apt-get)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge >/dev/null
  fi
}

slurm_start_munged() {  # slurm_start_munged DIR: munged with its key, socket and PID file under DIR
  local s=$1
  mkdir -p "$s"/{munge,munge-run}
  # munged runs as the munge user and checks permissions: the key folder private, the socket
  # folder searchable by everyone (clients), neither writable by others.
  chown munge:munge "$s/munge" "$s/munge-run"
  chmod 0700 "$s/munge"
  chmod 0755 "$s/munge-run"
  if [[ ! -s "$s/munge/munge.key" ]]; then
    dd if=/dev/urandom of="$s/munge/munge.key" bs=1024 count=1 status=none
  fi
  chown munge:munge "$s/munge/munge.key"
  chmod 0400 "$s/munge/munge.key"
  slurm_alive "$s/munged.pid" && return 0
  runuser -u munge -- munged --key-file="$s/munge/munge.key" --socket="$s/munge-run/munge.socket" \
    --pid-file="$s/munge-run/munged.pid" --log-file="$s/munge/munged.log" --seed-file="$s/munge/munged.seed"
  for _ in $(seq 50); do [[ -s "$s/munge-run/munged.pid" ]] && break; sleep 0.1; done
  cp "$s/munge-run/munged.pid" "$s/munged.pid"
}

slurm_common_conf() {  # slurm_common_conf DIR: the slurm.conf lines every test cluster shares
  local s=$1
  cat <<CONF
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=10: a requeued job may restart after ~12 s instead of ~128 s.
AuthInfo=socket=$s/munge-run/munge.socket,cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without a default, a job without --mem takes the whole node and jobs serialise.
DefMemPerCPU=1000
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$s/log/jobcomp.txt
SchedulerParameters=bf_interval=1,sched_interval=2
MailProg=/bin/true
ReturnToService=2
KillWait=10
MinJobAge=600
StateSaveLocation=$s/state
SlurmctldPidFile=$s/slurmctld.pid
SlurmctldLogFile=$s/log/slurmctld.log
CONF
}

slurm_stop() {  # slurm_stop NAME PIDFILE: TERM, wait up to 10 s, then KILL; removes PIDFILE
  local name=$1 pidfile=$2 pid
  [[ -f "$pidfile" ]] || return 0
  pid=$(cat "$pidfile")
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "[slurm] $name ($pid) ignored TERM; killing" >&2
      kill -KILL "$pid" 2>/dev/null
    fi
  fi
  rm -f "$pidfile"
}
