"""Every `python -m benchmarks NAME` is a runnable entry point."""

from __future__ import annotations

import importlib

import pytest

from benchmarks.__main__ import COMMANDS, main

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_has_a_main(name):
    module = importlib.import_module(COMMANDS[name][0])
    assert callable(getattr(module, "main", None)), f"python -m benchmarks {name}: {COMMANDS[name][0]} has no main()"



def test_a_bad_config_or_trace_file_is_named_without_a_traceback(capsys, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a trace\n")
    missing = tmp_path / "missing.jsonl"
    cases = [(["histospec", "--trace", str(missing), "--ablations", "none"], "does not exist"),
             (["histospec", "--trace", str(notes), "--ablations", "none"], "not valid JSON"),
             (["train-phase", "--trace", str(notes)], "not valid JSON"),
             (["memory", "--config", str(tmp_path / "missing.yaml")], "does not exist")]
    for argv, says in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"python -m benchmarks {argv[0]}: ") and says in err, err
