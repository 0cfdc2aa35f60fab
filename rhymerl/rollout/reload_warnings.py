"""vLLM's in-place reload warns "<layer class>: Failed to load weights" for each layer an update sent no
tensor for, and restores that layer's old tensors. Two kinds of layer get no tensor on every training step
and are right as restored: rotary embeddings (their cos/sin cache is computed, never in a checkpoint) and a
tied output head (no checkpoint name maps to it; the engine re-ties it after each reload). Their warnings,
a pair per step, would read as a failed update; any other layer's still reaches the user."""

from __future__ import annotations

import logging
from typing import Iterable

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_MESSAGE = "%s: Failed to load weights"


class ExpectedReloadWarnings(logging.Filter):
    """Drops the reload warning for the named layer classes only."""

    def __init__(self, layer_classes: Iterable[str]):
        super().__init__()
        self.layer_classes = frozenset(layer_classes)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != RELOAD_MESSAGE or not isinstance(record.args, tuple) or len(record.args) != 1:
            return True
        return record.args[0] not in self.layer_classes


def install(layer_classes: Iterable[str], logger_name: str = RELOAD_LOGGER) -> ExpectedReloadWarnings:
    """Put the filter on vLLM's reload logger. The logger is per process, and so is the filter: engines
    built in the same process add their classes to it."""
    log = logging.getLogger(logger_name)
    old = [f for f in log.filters if isinstance(f, ExpectedReloadWarnings)]
    for f in old:
        log.removeFilter(f)
    new = ExpectedReloadWarnings([*layer_classes, *(c for f in old for c in f.layer_classes)])
    log.addFilter(new)
    return new
