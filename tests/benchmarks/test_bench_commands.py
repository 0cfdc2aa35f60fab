"""Every `python -m benchmarks NAME` is a runnable entry point."""

from __future__ import annotations

import importlib

import pytest

from benchmarks.__main__ import COMMANDS

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_has_a_main(name):
    module = importlib.import_module(COMMANDS[name][0])
    assert callable(getattr(module, "main", None)), f"python -m benchmarks {name}: {COMMANDS[name][0]} has no main()"
