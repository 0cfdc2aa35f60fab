"""requirements.txt, what a cluster admin installs from, says what pyproject.toml says."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[2]


def _normalised(specs: list[str]) -> set[str]:
    return {s.replace(" ", "").lower() for s in specs}


def test_requirements_txt_is_pyprojects_dependencies_and_gpu_extra():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    want = project["dependencies"] + project["optional-dependencies"]["gpu"]
    lines = [line.split("#")[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    assert _normalised([line for line in lines if line]) == _normalised(want)
