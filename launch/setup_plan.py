"""What launch/setup.sh decides before it installs anything: the device kind to install for
(RHYMERL_DEVICE, else what nvidia-smi sees), whether the venv may take that install, and
whether this node's NVIDIA driver can run the GPU stack.

    python3 launch/setup_plan.py VENV

prints the device kind (cpu or gpu) on stdout and what it decided and why on stderr; where it
refuses, its last line on stderr says why and what to do, and it exits 1. It runs with the system python before the
venv exists, so it uses the standard library only.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DEVICES = ("cpu", "gpu")
# Written into the venv by setup.sh when it makes it: one venv holds one device kind.
DEVICE_RECORD = ".rhymerl-device"
# pyproject.toml's gpu extra (vllm 0.32.0) brings a torch built for CUDA 13.0, which runs on
# NVIDIA driver branch R580 or newer; keep these in step with that extra.
GPU_STACK = "vllm 0.32.0 brings torch 2.13.0 built for CUDA 13.0"
MIN_DRIVER_BRANCH = 580
OVERRIDE = "RHYMERL_DEVICE=gpu bash launch/setup.sh"


class Refused(Exception):
    """One line saying what is wrong and what to do."""


def requested_device(value: str) -> str | None:
    if not value:
        return None
    if value not in DEVICES:
        raise Refused(f"RHYMERL_DEVICE={value!r} is not a device kind: set RHYMERL_DEVICE=cpu or "
                      "RHYMERL_DEVICE=gpu, or leave it unset to detect")
    return value


def choose_device(requested: str | None, gpus_seen: int, why_none: str,
                  venv_kind: str | None) -> tuple[str, str]:
    """(device kind, the line saying why). ``why_none``: what nvidia-smi said when it saw no GPU."""
    if requested:
        return requested, f"device: {requested} (set by RHYMERL_DEVICE)"
    if gpus_seen:
        return "gpu", f"device: gpu (nvidia-smi sees {gpus_seen} GPU(s)); RHYMERL_DEVICE=cpu installs for CPU instead"
    # A venv made for gpu on a login node (no GPU there) stays gpu when setup runs there again.
    if venv_kind == "gpu":
        return "gpu", (f"device: gpu ({why_none}, but this venv was made for gpu); RHYMERL_DEVICE=cpu with "
                       "RHYMERL_VENV=<path> makes a CPU venv beside it")
    return "cpu", (f"device: cpu ({why_none}); on a GPU cluster's login node this is the wrong install: "
                   f"run {OVERRIDE} instead")


def venv_refusal(device: str, venv: str, venv_kind: str | None, torch_version: str | None,
                 torch_build: str) -> str | None:
    """Why ``venv`` cannot take a ``device`` install, or None. ``torch_build``: cpu, cuda or unknown."""
    elsewhere = f"remove {venv} and rerun, or set RHYMERL_VENV=<path> to make a {device} venv beside it"
    if venv_kind and venv_kind != device:
        return (f"{venv} was made for {venv_kind}, not {device}, and one venv holds one device kind: "
                f"{elsewhere} (RHYMERL_DEVICE={venv_kind} keeps using it)")
    # pip counts an installed torch 2.13.0 of either build as satisfying ==2.13.0 and keeps it.
    wrong_build = {"gpu": "cpu", "cpu": "cuda"}[device]
    if torch_version and torch_build == wrong_build:
        return (f"{venv} has torch {torch_version}, a {wrong_build.upper()} build that pip would keep "
                f"for a {device} install: {elsewhere}")
    return None


def driver_check(driver_version: str | None) -> str:
    """The note for a gpu install; raises Refused where the driver is too old to run it."""
    if driver_version is None:
        return (f"no NVIDIA driver visible on this host: the GPU nodes need driver R{MIN_DRIVER_BRANCH} "
                f"or newer ({GPU_STACK})")
    if int(driver_version.split(".")[0]) < MIN_DRIVER_BRANCH:
        raise Refused(f"NVIDIA driver {driver_version} is too old: {GPU_STACK}, which needs driver "
                      f"R{MIN_DRIVER_BRANCH} or newer; update the driver, or set up and run on nodes that have it")
    return f"NVIDIA driver {driver_version} (R{MIN_DRIVER_BRANCH} or newer runs CUDA 13.0)"


def torch_build(metadata: str) -> tuple[str | None, str]:
    """(version, build kind) from a torch dist-info METADATA text."""
    version = re.search(r"^Version: *(\S+)", metadata, re.M)
    if version is None:
        return None, "unknown"
    local = version.group(1).partition("+")[2]
    if local == "cpu":
        return version.group(1), "cpu"
    if local.startswith("cu") or re.search(r"^Requires-Dist: *nvidia-", metadata, re.M):
        return version.group(1), "cuda"
    return version.group(1), "unknown"


def parse_driver_versions(text: str) -> list[str]:
    """One driver version per GPU from `nvidia-smi --query-gpu=driver_version --format=csv,noheader`."""
    return [line.strip() for line in text.splitlines() if re.match(r"\d+\.\d+", line.strip())]


def probe_nvidia_smi() -> tuple[list[str], str]:
    """(driver version per GPU seen, what nvidia-smi said when it saw none)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return [], "no nvidia-smi on this host"
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"nvidia-smi did not answer ({e})"
    versions = parse_driver_versions(out.stdout) if out.returncode == 0 else []
    said = (out.stdout + out.stderr).strip().splitlines()
    return versions, f"nvidia-smi sees no GPU: {said[0] if said else f'exit code {out.returncode}'}"


def recorded_kind(venv: Path) -> str | None:
    record = venv / DEVICE_RECORD
    if record.is_file():
        return record.read_text().strip() or None
    # Venvs made before the record existed carry only the stamp, named after their kind.
    return next((kind for kind in DEVICES if (venv / f".rhymerl-setup-{kind}").is_file()), None)


def installed_torch(venv: Path) -> tuple[str | None, str]:
    """(version, build kind) of the torch pip sees in ``venv``: its dist-info, as pip reads it."""
    metadata = next(iter(sorted(venv.glob("lib/python*/site-packages/torch-*.dist-info/METADATA"))), None)
    return torch_build(metadata.read_text(errors="replace")) if metadata else (None, "unknown")


def plan(venv: Path, requested_value: str, notes: list[str]) -> str:
    """The device kind to install into ``venv``; appends what it decided to ``notes``, raises Refused."""
    requested = requested_device(requested_value)
    drivers, why_none = probe_nvidia_smi()
    venv_kind = recorded_kind(venv)
    device, why = choose_device(requested, len(drivers), why_none, venv_kind)
    notes.append(why)
    refusal = venv_refusal(device, str(venv), venv_kind, *installed_torch(venv))
    if refusal:
        raise Refused(refusal)
    if device == "gpu":
        notes.append(driver_check(drivers[0] if drivers else None))
    return device


def main(argv: list[str]) -> int:
    notes: list[str] = []
    try:
        device = plan(Path(argv[1]), os.environ.get("RHYMERL_DEVICE", ""), notes)
    except Refused as e:
        notes.append(f"error: {e}")
        device = None
    for note in notes:
        print(f"[setup] {note}", file=sys.stderr)
    if device is None:
        return 1
    print(device)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
