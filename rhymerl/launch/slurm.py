"""`python -m rhymerl slurm render|submit CONFIG [overrides] [--dry-run]`: the sbatch script of a config."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from rhymerl.config import ConfigError, ParallelConfig, SlurmConfig, load_config, redact_secrets
from rhymerl.launch.preflight import preflight

DEFAULT_ENTRY = ("-m", "rhymerl.launch.rank_main")
# Below Linux's ephemeral range, so no outgoing connection can hold the port we are about to listen on.
PORT_BASE, PORT_SPAN = 15000, 17000
PORT_BLOCK = 64  # a block per job id: jobs starting together on one node probed the same free port


def master_port_block(job_id: int) -> range:
    """The ports a job's rendezvous probes, first free one taken."""
    base = PORT_BASE + (job_id % (PORT_SPAN // PORT_BLOCK)) * PORT_BLOCK
    return range(base, base + PORT_BLOCK)


_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_slurm_time(text: str) -> Optional[int]:
    """Seconds in a Slurm --time value (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S); None if unlimited or empty."""
    t = text.strip()
    if t.upper() in ("", "UNLIMITED", "INFINITE"):
        return None
    m = _TIME_RE.match(t)
    if not m:
        raise ConfigError(f"slurm.time: {text!r} is not a Slurm time (M, M:S, H:M:S, D-H, D-H:M or D-H:M:S)")
    days, a, b, c = m.groups()
    if days is not None:  # D-H[:M[:S]]
        h, mi, s = int(a), int(b or 0), int(c or 0)
        return ((int(days) * 24 + h) * 60 + mi) * 60 + s
    if c is not None:  # H:M:S
        return (int(a) * 60 + int(b)) * 60 + int(c)
    if b is not None:  # M:S
        return int(a) * 60 + int(b)
    return int(a) * 60  # M


def layout(slurm: SlurmConfig, parallel: ParallelConfig) -> tuple[int, int]:
    """(tasks per node, world size), checked against the parallel section."""
    if slurm.nodes < 1:
        raise ConfigError("slurm.nodes: must be >= 1")
    if slurm.gpus_per_node < 0:
        raise ConfigError("slurm.gpus_per_node: must be >= 0 (0 = CPU-only tasks with gloo)")
    if slurm.gpus_per_node > 0:
        if slurm.tasks_per_node not in (1, slurm.gpus_per_node):
            raise ConfigError(f"slurm.tasks_per_node: {slurm.tasks_per_node} conflicts with gpus_per_node="
                              f"{slurm.gpus_per_node}; GPU jobs run one task per GPU (leave tasks_per_node at 1)")
        per_node = slurm.gpus_per_node
    else:
        if slurm.tasks_per_node < 1:
            raise ConfigError("slurm.tasks_per_node: must be >= 1")
        per_node = slurm.tasks_per_node
    world = slurm.nodes * per_node
    mp = parallel.tensor_parallel * parallel.pipeline_parallel
    if parallel.world_size and parallel.world_size != world:
        raise ConfigError(f"parallel.world_size: {parallel.world_size} but the Slurm layout starts {world} ranks "
                          f"(slurm.nodes={slurm.nodes} x {per_node} tasks per node)")
    if world % mp:
        raise ConfigError(f"parallel.tensor_parallel: TP*PP={mp} does not divide the {world} ranks of "
                          f"slurm.nodes={slurm.nodes} x {per_node} tasks per node")
    if slurm.cpus_per_task < 1:
        raise ConfigError("slurm.cpus_per_task: must be >= 1")
    return per_node, world


def _rendezvous_host_lines(nodes: int) -> list[str]:
    """Shell lines that set MASTER_ADDR: where rank 0 (the batch host) listens."""
    if nodes == 1:
        return ["# Rendezvous: the first host of the allocation (where this script runs) hosts rank 0.",
                'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)']
    # Across nodes: the batch host's NodeAddr (a host name may resolve only locally).
    return [
        "# Rendezvous: the first host of the allocation (where this script runs) hosts rank 0,",
        "# reached by the other nodes at its Slurm NodeAddr. RHYMERL_MASTER_ADDR overrides.",
        'MASTER_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        'if [[ -n "${RHYMERL_MASTER_ADDR:-}" ]]; then',
        '    MASTER_ADDR=$RHYMERL_MASTER_ADDR',
        'else',
        '    MASTER_ADDR=$(scontrol show node "$MASTER_HOST" -o 2>/dev/null | sed -n \'s/.* NodeAddr=\\([^ ]*\\).*/\\1/p\')',
        '    MASTER_ADDR=${MASTER_ADDR:-$MASTER_HOST}',
        'fi',
    ]


def _socket_interface_lines(slurm: SlurmConfig) -> list[str]:
    """Shell lines for the gloo/NCCL socket interface: the configured one, or a note that ranks find it."""
    name = slurm.socket_ifname
    if name:
        return ["# gloo/NCCL sockets on slurm.socket_ifname; a GLOO_/NCCL_SOCKET_IFNAME set at submission wins.",
                f"export GLOO_SOCKET_IFNAME=${{GLOO_SOCKET_IFNAME:-{name}}}",
                f"export NCCL_SOCKET_IFNAME=${{NCCL_SOCKET_IFNAME:-{name}}}"]
    if slurm.nodes == 1:
        return []
    # Left to the host name, gloo/NCCL often pick the wrong network (or a loopback address) and hang.
    return ["# gloo/NCCL sockets: each rank (rank_main, rhymerl.launch.netif) takes the interface that",
            "# routes to MASTER_ADDR and logs it, unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME are set;",
            "# slurm.socket_ifname exports both here."]


def _srun_lines(slurm: SlurmConfig, per_node: int) -> list[str]:
    """The comment and first line of the srun command (the task command follows)."""
    lines = ["# One task per rank; rank_main reads SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID.",
             "# --kill-on-bad-exit: a crashed rank ends the step instead of leaving the rest in a collective.",
             "# --cpus-per-task again: since Slurm 22.05 srun does not inherit it from sbatch."]
    cpus = f"--cpus-per-task={slurm.cpus_per_task}"
    if slurm.gpus_per_node == 0:
        return lines + [f'srun --kill-on-bad-exit=1 {cpus} --open-mode=append --output="$JOB_LOG_DIR/rank-%t.log" \\']
    # On the srun line: a site default GPU binding would split the GPUs and cuda:LOCAL_RANK be wrong.
    return lines + [
        f"# GPU binding: {per_node} tasks per node, each seeing all {slurm.gpus_per_node} GPUs of its node in the same",
        "# order (--gpu-bind=none, so no site default splits them); a task uses cuda:LOCAL_RANK,",
        "# LOCAL_RANK = SLURM_LOCALID (set by rank_main; vLLM's external launcher reads it too).",
        f"srun --kill-on-bad-exit=1 {cpus} --ntasks-per-node={per_node} --gpus-per-node={slurm.gpus_per_node} "
        '--gpu-bind=none --open-mode=append --output="$JOB_LOG_DIR/rank-%t.log" \\',
    ]


def render_script(slurm: SlurmConfig, parallel: ParallelConfig, *, job_name: str, config_path: Path,
                  overrides: Sequence[str] = (), workdir: Optional[Path] = None, python: Optional[str] = None,
                  entry: Sequence[str] = DEFAULT_ENTRY, setup_lines: Sequence[str] = ()) -> str:
    """The sbatch script (absolute paths); ``entry`` follows the interpreter, ``setup_lines`` precede srun."""
    per_node, world = layout(slurm, parallel)
    limit = parse_slurm_time(slurm.time)
    if slurm.signal_lead_s < 0 or slurm.signal_lead_s > 65535:
        raise ConfigError("slurm.signal_lead_s: must be in [0, 65535] seconds (0 = no warning signal)")
    if limit is not None and slurm.signal_lead_s and slurm.signal_lead_s >= limit:
        raise ConfigError(f"slurm.signal_lead_s: {slurm.signal_lead_s} s is not shorter than slurm.time="
                          f"{slurm.time!r} ({limit} s); the job would be told to stop as soon as it starts")
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", job_name):
        raise ConfigError(f"run.name: {job_name!r} is used as the Slurm job name; use letters, digits, _ . + -")
    if slurm.socket_ifname and not re.fullmatch(r"[A-Za-z0-9_.:@-]+", slurm.socket_ifname):
        raise ConfigError(f"slurm.socket_ifname: {slurm.socket_ifname!r} is not an interface name such as eth0; "
                          "leave it empty to let each rank find the interface that routes to MASTER_ADDR")
    workdir = Path(workdir or Path.cwd()).resolve()
    config_path = Path(config_path)
    config_abs = (config_path if config_path.is_absolute() else workdir / config_path).resolve()
    log_dir = Path(slurm.log_dir)
    log_dir = (log_dir if log_dir.is_absolute() else workdir / log_dir).resolve()
    python = python or sys.executable
    q = shlex.quote
    gpu = slurm.gpus_per_node > 0

    sb = [f"--job-name={job_name}", f"--nodes={slurm.nodes}", f"--ntasks-per-node={per_node}",
          f"--cpus-per-task={slurm.cpus_per_task}", f"--time={slurm.time}",
          f"--output={log_dir}/%x-%j.out", "--open-mode=append", f"--chdir={workdir}"]
    if gpu:
        sb.append(f"--gpus-per-node={slurm.gpus_per_node}")
    if slurm.partition:
        sb.append(f"--partition={slurm.partition}")
    if slurm.account:
        sb.append(f"--account={slurm.account}")
    if slurm.signal_lead_s:
        # "B:" sends it to the batch shell, whose trap leaves a notice file; else to every task.
        sb.append(f"--signal={'B:' if slurm.signal_batch else ''}USR1@{slurm.signal_lead_s}")
    sb.append("--requeue" if slurm.requeue else "--no-requeue")
    for extra in slurm.extra_sbatch:
        extra = extra.strip()
        if extra.startswith("#SBATCH"):
            extra = extra[len("#SBATCH"):].strip()
        if not extra.startswith("-"):
            raise ConfigError(f"slurm.extra_sbatch: {extra!r} must be an sbatch option such as --exclusive")
        sb.append(extra)

    task_cmd = " ".join(['"$PYTHON"', *map(q, entry), q(str(config_abs)), *map(q, overrides)])
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {o}" for o in sb]
    lines += [
        f"# Rendered by `python -m rhymerl slurm render` for {world} ranks ({slurm.nodes} node(s) x {per_node} {'GPU' if gpu else 'CPU'} task(s)).",
        "# Preemption: USR1 -> checkpoint at the next step end -> `scontrol requeue` -> this script",
        "# runs again (SLURM_RESTART_COUNT=1, 2, ...) and the trainer resumes (checkpoint.resume=auto).",
        "set -uo pipefail",
        "# First, before anything can take time: a USR1 to this shell (`--signal=B:USR1@...`, which",
        "# Slurm may send up to ~60 s early, or `scancel --batch --signal=USR1`) must not kill it.",
        "# It becomes a notice file that rank 0 polls at each step end (RHYMERL_PREEMPT_NOTICE),",
        "# not a signal forwarded to tasks that may not have installed their handlers yet.",
        "PREEMPT_NOTICE=",
        "PREEMPT_PENDING=0",
        "trap 'PREEMPT_PENDING=1; echo \"[rhymerl-slurm] batch shell got USR1; notice to the tasks: checkpoint"
        " and requeue at the next step end\"; [[ -n \"$PREEMPT_NOTICE\" ]] && : > \"$PREEMPT_NOTICE\"' USR1",
        "",
        f"PYTHON=${{RHYMERL_PYTHON:-{q(python)}}}",
        f"LOG_ROOT={q(str(log_dir))}",
        'JOB_LOG_DIR="$LOG_ROOT/${SLURM_JOB_NAME}-${SLURM_JOB_ID}"',
        'mkdir -p "$JOB_LOG_DIR"',
        'export RHYMERL_JOB_LOG_DIR="$JOB_LOG_DIR"',
        'RESTART=${SLURM_RESTART_COUNT:-0}',
        "# One notice file per start, so a requeued job does not see its predecessor's.",
        'export RHYMERL_PREEMPT_NOTICE="$JOB_LOG_DIR/preempt-notice.restart-$RESTART"',
        'rm -f "$RHYMERL_PREEMPT_NOTICE"',
        'PREEMPT_NOTICE=$RHYMERL_PREEMPT_NOTICE',
        'if (( PREEMPT_PENDING )); then : > "$PREEMPT_NOTICE"; fi',
        'echo "[rhymerl-slurm] job $SLURM_JOB_ID restart $RESTART on $SLURM_JOB_NODELIST at $(date -Is)"',
        "",
        *_rendezvous_host_lines(slurm.nodes),
        "# Port block derived from the job id (stable across requeues; master_port_block), probed for",
        "# its first free port, so jobs sharing a node do not collide. RHYMERL_MASTER_PORT overrides.",
        f"BASE_PORT=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN // PORT_BLOCK} * {PORT_BLOCK} ))",
        'if [[ -n "${RHYMERL_MASTER_PORT:-}" ]]; then',
        '    MASTER_PORT=$RHYMERL_MASTER_PORT',
        'else',
        '    MASTER_PORT=$("$PYTHON" - "$BASE_PORT" <<\'PY\'',
        "import socket, sys",
        "base = int(sys.argv[1])",
        f"for port in range(base, base + {PORT_BLOCK}):",
        "    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)",
        "    try:",
        "        s.bind((\"\", port))",
        "    except OSError:",
        "        continue",
        "    finally:",
        "        s.close()",
        "    print(port)",
        "    break",
        "else:",
        f"    sys.exit(\"no free port in [%d, %d)\" % (base, base + {PORT_BLOCK}))",
        "PY",
        ")",
        "fi",
        'if [[ -z "$MASTER_PORT" ]]; then echo "[rhymerl-slurm] could not choose MASTER_PORT" >&2; exit 1; fi',
        "export MASTER_ADDR MASTER_PORT",
        f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{slurm.cpus_per_task}}}",
    ]
    if gpu:
        lines += [
            "# NCCL: report problems, fail fast instead of hanging in a collective after a rank dies.",
            'export NCCL_DEBUG=${NCCL_DEBUG:-WARN}',
            'export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}',
            "# Set NCCL_IB_HCA here if the cluster needs a specific fabric.",
        ]
    else:
        lines += [
            "# CPU-only tasks use gloo (parallel.dist_backend=auto). If the host name resolves to a",
            "# loopback address on a multi-node job, set GLOO_SOCKET_IFNAME to the cluster interface.",
        ]
    lines += _socket_interface_lines(slurm)
    if setup_lines:
        lines += ["", "# setup", *setup_lines]
    lines += [
        'echo "[rhymerl-slurm] MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT ntasks=$SLURM_NTASKS'
        ' logs=$JOB_LOG_DIR"',
        "",
        *_srun_lines(slurm, per_node),
        f"    {task_cmd} &",
        "SRUN_PID=$!",
        "while true; do",
        '    wait "$SRUN_PID"; rc=$?',
        '    kill -0 "$SRUN_PID" 2>/dev/null || break  # wait returns early when a trap ran',
        "done",
        'echo "[rhymerl-slurm] srun finished with exit code $rc at $(date -Is)"',
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


def write_script(text: str, log_dir: Path, job_name: str) -> Path:
    scripts = log_dir / "scripts"
    scripts.mkdir(parents=True, exist_ok=True)
    path = scripts / f"{job_name}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    n = 1
    while path.exists():
        path = scripts / f"{job_name}-{time.strftime('%Y%m%d-%H%M%S')}-{n}.sbatch"
        n += 1
    path.write_text(text)
    return path


def sbatch(script: Path, text: Optional[str] = None) -> str:
    """Submit ``script`` (or ``text`` on stdin); returns the job id, or raises RuntimeError with sbatch's message."""
    try:
        args = ["sbatch", "--parsable"] + ([] if text is not None else [str(script)])
        res = subprocess.run(args, input=text, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise RuntimeError("sbatch not found: run this on a Slurm login node (or use `render`)") from None
    if res.returncode != 0:
        raise RuntimeError(f"sbatch {script} failed (rc={res.returncode}): {res.stderr.strip()}")
    return res.stdout.strip().split(";")[0]


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="rhymerl slurm", description="Render or submit the sbatch script of a config.")
    p.add_argument("action", choices=["render", "submit"])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--no-check", action="store_true", help="skip the checks of the model, data and tasks")
    args = p.parse_args(list(argv))
    try:
        cfg = load_config(args.config, args.overrides)
        if not args.no_check:
            # What would fail at start-up fails here, before the job waits in the queue.
            preflight(cfg, layout(cfg.slurm, cfg.parallel)[1])
        text = render_script(cfg.slurm, cfg.parallel, job_name=cfg.run.name, config_path=Path(args.config),
                             overrides=args.overrides, python=cfg.slurm.python or None, setup_lines=cfg.slurm.setup)
    except ConfigError as e:
        print(f"rhymerl: config error: {e}", file=sys.stderr)
        return 2
    if args.action == "render":
        sys.stdout.write(text)
        return 0
    log_dir = Path(cfg.slurm.log_dir).resolve()
    if args.dry_run:
        sys.stdout.write(text)
        print(f"[dry-run] would write the script under {log_dir}/scripts/ and run: sbatch --parsable <script>",
              file=sys.stderr)
        return 0
    log_dir.mkdir(parents=True, exist_ok=True)
    # The saved copy carries no credentials from slurm.setup; sbatch gets the real script on stdin.
    script = write_script(redact_secrets(text), log_dir, cfg.run.name)
    try:
        job_id = sbatch(script, None if redact_secrets(text) == text else text)
    except RuntimeError as e:
        print(f"rhymerl: {e}", file=sys.stderr)
        return 1
    print(job_id)
    print(f"submitted job {job_id}: script {script}\n  batch log {log_dir}/{cfg.run.name}-{job_id}.out\n"
          f"  rank logs {log_dir}/{cfg.run.name}-{job_id}/rank-*.log", file=sys.stderr)
    return 0
