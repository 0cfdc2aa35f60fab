"""vLLM's reload warning is dropped for the expected layer classes only."""

from __future__ import annotations

import logging

import pytest

from rhymerl.rollout.reload_warnings import RELOAD_MESSAGE, ExpectedReloadWarnings, install

pytestmark = pytest.mark.cpu


def _record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("vllm.x", logging.WARNING, __file__, 1, msg, args, None)


def test_only_the_named_layers_reload_warning_is_dropped():
    f = ExpectedReloadWarnings(["RotaryEmbedding", "ParallelLMHead"])
    assert not f.filter(_record(RELOAD_MESSAGE, "RotaryEmbedding"))
    assert not f.filter(_record(RELOAD_MESSAGE, "ParallelLMHead"))
    # A layer that should have had weights still warns, and so does any other message.
    assert f.filter(_record(RELOAD_MESSAGE, "QKVParallelLinear"))
    assert f.filter(_record("%s: Delayed processing", "RotaryEmbedding"))
    assert f.filter(_record("RotaryEmbedding: Failed to load weights"))


def test_install_keeps_one_filter_with_every_engines_classes(caplog):
    name = "rhymerl.test.reload"
    log = logging.getLogger(name)
    try:
        install(["RotaryEmbedding"], name)
        install(["ParallelLMHead"], name)
        filters = [f for f in log.filters if isinstance(f, ExpectedReloadWarnings)]
        assert len(filters) == 1 and filters[0].layer_classes == {"RotaryEmbedding", "ParallelLMHead"}
        with caplog.at_level(logging.WARNING, logger=name):
            for cls in ("RotaryEmbedding", "ParallelLMHead", "MergedColumnParallelLinear"):
                log.warning(RELOAD_MESSAGE, cls)
        assert [r.getMessage() for r in caplog.records] == ["MergedColumnParallelLinear: Failed to load weights"]
    finally:
        for f in list(log.filters):
            log.removeFilter(f)
