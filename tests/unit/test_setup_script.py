"""launch/setup.sh says which device kind it installs for and why, keeps one kind per venv,
and refuses a driver too old for the GPU stack, before it installs anything.

The script runs for real on a copy of launch/ and pyproject.toml (so no run touches the
repository's own .venv), with RHYMERL_VENV a throw-away venv, a fake nvidia-smi on PATH that
prints what a real one prints for the case, and pip cut off from every index: no case installs.
"""

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[2]
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.")


def load_setup_plan():
    spec = importlib.util.spec_from_file_location("setup_plan", REPO / "launch" / "setup_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def repo_copy(tmp_path) -> Path:
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "launch", copy / "launch")
    shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")
    return copy


def fake_nvidia_smi(bin_dir: Path, drivers: list[str] | None) -> None:
    """An nvidia-smi answering --query-gpu=driver_version with one line per GPU; None: no driver loaded."""
    bin_dir.mkdir(exist_ok=True)
    body = (f'echo "{NO_DRIVER}"; exit 9' if drivers is None
            else "".join(f'echo "{v}"\n' for v in drivers) + "exit 0")
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)


def make_venv(path: Path, torch_metadata: str | None = None) -> Path:
    """A throw-away venv; ``torch_metadata``: the METADATA of a torch pip would see installed there."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    if torch_metadata:
        version = torch_metadata.split("Version: ")[1].split("\n")[0]
        (site_packages,) = path.glob("lib/python*/site-packages")
        dist_info = site_packages / f"torch-{version}.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(torch_metadata)
    return path


def record_kind(venv: Path, kind: str) -> None:
    (venv / ".rhymerl-device").write_text(f"{kind}\n")


def stamp_as_set_up(repo_copy: Path, venv: Path, kind: str) -> None:
    """The stamp a finished setup leaves, so the script takes its at-once path."""
    parts = [repo_copy / "launch" / "setup.sh", repo_copy / "launch" / "setup_plan.py", repo_copy / "pyproject.toml"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    (venv / f".rhymerl-setup-{kind}").write_text(digest + "\n")


def run_setup(repo_copy: Path, venv: Path, drivers: list[str] | None, device: str | None = None):
    bin_dir = repo_copy.parent / "bin"
    fake_nvidia_smi(bin_dir, drivers)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RHYMERL_", "PIP_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", RHYMERL_VENV=str(venv),
               PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS="")
    if device is not None:
        env["RHYMERL_DEVICE"] = device
    return subprocess.run(["bash", str(repo_copy / "launch" / "setup.sh")], env=env,
                          capture_output=True, text=True, timeout=120)


def last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


CPU_TORCH = "Metadata-Version: 2.4\nName: torch\nVersion: 2.13.0+cpu\nRequires-Python: >=3.10\n"
CUDA_TORCH = ("Metadata-Version: 2.4\nName: torch\nVersion: 2.13.0\nRequires-Python: >=3.10\n"
              "Requires-Dist: nvidia-cuda-runtime==13.0.96; platform_system == \"Linux\"\n")


def test_a_bad_device_kind_is_refused_in_one_line(repo_copy, tmp_path):
    venv = tmp_path / "venv"
    out = run_setup(repo_copy, venv, drivers=["580.65.06"], device="cuda")
    assert out.returncode == 1
    assert out.stderr.strip() == ("[setup] error: RHYMERL_DEVICE='cuda' is not a device kind: set "
                                  "RHYMERL_DEVICE=cpu or RHYMERL_DEVICE=gpu, or leave it unset to detect")
    assert not venv.exists()


@pytest.mark.parametrize("requested", ["gpu", None], ids=["RHYMERL_DEVICE=gpu", "detected"])
@pytest.mark.parametrize("recorded", ["record", "stamp of an earlier setup"])
def test_a_venv_made_for_cpu_is_refused_for_gpu_with_the_way_out_named(repo_copy, tmp_path, requested, recorded):
    venv = make_venv(tmp_path / "venv")
    if recorded == "record":
        record_kind(venv, "cpu")
    else:
        stamp_as_set_up(repo_copy, venv, "cpu")
    out = run_setup(repo_copy, venv, drivers=["580.65.06"] * 8, device=requested)
    assert out.returncode == 1
    assert last_line(out.stderr) == (
        f"[setup] error: {venv} was made for cpu, not gpu, and one venv holds one device kind: remove {venv} and "
        "rerun, or set RHYMERL_VENV=<path> to make a gpu venv beside it (RHYMERL_DEVICE=cpu keeps using it)")
    assert not (venv / ".rhymerl-setup-gpu").exists()


def test_gpu_setup_into_a_venv_whose_torch_is_a_cpu_build_is_refused(repo_copy, tmp_path):
    venv = make_venv(tmp_path / "venv", torch_metadata=CPU_TORCH)
    out = run_setup(repo_copy, venv, drivers=["580.65.06"], device="gpu")
    assert out.returncode == 1
    assert last_line(out.stderr) == (
        f"[setup] error: {venv} has torch 2.13.0+cpu, a CPU build that pip would keep for a gpu install: "
        f"remove {venv} and rerun, or set RHYMERL_VENV=<path> to make a gpu venv beside it")


def test_a_host_without_gpu_says_a_login_node_needs_the_gpu_override(repo_copy, tmp_path):
    # A CUDA torch in the venv stops the cpu setup before it installs, after it said what it chose.
    venv = make_venv(tmp_path / "venv", torch_metadata=CUDA_TORCH)
    out = run_setup(repo_copy, venv, drivers=None)
    assert out.returncode == 1
    chosen, refused = out.stderr.strip().splitlines()
    assert chosen == (f"[setup] device: cpu (nvidia-smi sees no GPU: {NO_DRIVER}); on a GPU cluster's login node "
                      "this is the wrong install: run RHYMERL_DEVICE=gpu bash launch/setup.sh instead")
    assert refused == (f"[setup] error: {venv} has torch 2.13.0, a CUDA build that pip would keep for a cpu "
                       f"install: remove {venv} and rerun, or set RHYMERL_VENV=<path> to make a cpu venv beside it")


def test_a_driver_older_than_r580_is_refused_before_the_venv_is_made(repo_copy, tmp_path):
    venv = tmp_path / "venv"
    out = run_setup(repo_copy, venv, drivers=["570.133.20"] * 2)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "[setup] device: gpu (nvidia-smi sees 2 GPU(s)); RHYMERL_DEVICE=cpu installs for CPU instead",
        "[setup] error: NVIDIA driver 570.133.20 is too old: vllm 0.32.0 brings torch 2.13.0 built for CUDA 13.0, "
        "which needs driver R580 or newer; update the driver, or set up and run on nodes that have it",
    ]
    assert not venv.exists()


def test_a_login_node_keeps_its_gpu_venv_and_notes_the_driver_requirement(repo_copy, tmp_path):
    venv = make_venv(tmp_path / "venv")
    record_kind(venv, "gpu")
    stamp_as_set_up(repo_copy, venv, "gpu")
    out = run_setup(repo_copy, venv, drivers=None)
    # Kept as gpu: its gpu stamp matched, so nothing is installed and a set-up venv stays quiet
    # (pip is cut off here: a cpu install would have failed).
    assert out.returncode == 0 and out.stderr == "", out.stderr
    plan = load_setup_plan()
    assert plan.choose_device(None, 0, "nvidia-smi sees no GPU: No devices were found", "gpu")[0] == "gpu"
    assert plan.driver_check(None) == ("no NVIDIA driver visible on this host: the GPU nodes need driver R580 or "
                                       "newer (vllm 0.32.0 brings torch 2.13.0 built for CUDA 13.0)")


@pytest.mark.parametrize("requested", ["cpu", None])
def test_a_cpu_venv_set_up_again_returns_at_once(repo_copy, tmp_path, requested):
    venv = make_venv(tmp_path / "venv", torch_metadata=CPU_TORCH)
    record_kind(venv, "cpu")
    stamp_as_set_up(repo_copy, venv, "cpu")
    out = run_setup(repo_copy, venv, drivers=None, device=requested)
    assert out.returncode == 0 and out.stderr == "", out.stderr


def test_the_decisions_without_the_script():
    plan = load_setup_plan()
    assert plan.choose_device(None, 4, "no nvidia-smi on this host", None)[0] == "gpu"
    assert plan.choose_device(None, 0, "no nvidia-smi on this host", None)[0] == "cpu"
    assert plan.choose_device(None, 0, "no nvidia-smi on this host", "gpu")[0] == "gpu"
    assert plan.choose_device("cpu", 4, "", "gpu") == ("cpu", "device: cpu (set by RHYMERL_DEVICE)")
    assert plan.venv_refusal("gpu", ".venv", "gpu", "2.13.0", "cuda") is None
    assert plan.venv_refusal("cpu", ".venv", None, "2.13.0+cpu", "cpu") is None
    assert plan.driver_check("580.65.06").startswith("NVIDIA driver 580.65.06")
    assert plan.torch_build(CPU_TORCH) == ("2.13.0+cpu", "cpu")
    assert plan.torch_build(CUDA_TORCH.replace("Version: 2.13.0", "Version: 2.13.0+cu130")) == ("2.13.0+cu130", "cuda")
    assert plan.parse_driver_versions("580.65.06\n580.65.06\n") == ["580.65.06", "580.65.06"]
    assert plan.parse_driver_versions("No devices were found\n") == []
