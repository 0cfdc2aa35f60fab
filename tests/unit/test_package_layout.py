"""The package's shape: the product (rhymerl/) and the lab (benchmarks/) apart, no import
circles, names that mean one thing, and a wheel that ships the product only."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("rhymerl", "benchmarks")


def _modules() -> dict[str, Path]:
    mods = {}
    for base in PACKAGES:
        for p in (REPO / base).rglob("*.py"):
            name = ".".join(p.relative_to(REPO).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = p
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports, at module level or inside functions."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in mods:
                        graph[name].add(target)
                    elif base in mods:
                        graph[name].add(base)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in mods)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v] - {v}:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert _cycles(_imports(_modules())) == []


def test_the_product_never_imports_the_lab():
    graph = _imports(_modules())
    bad = {m: sorted(d for d in deps if d.startswith("benchmarks")) for m, deps in graph.items()
           if m.startswith("rhymerl")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_no_two_product_files_share_a_name():
    names = Counter(p.name for p in (REPO / "rhymerl").rglob("*.py") if p.name != "__init__.py")
    assert [n for n, c in names.items() if c > 1] == []


def test_the_wheel_ships_the_product_and_no_lab(tmp_path):
    # Built from a copy: setuptools leaves build/ in the source tree it builds.
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv*", "runs", "build", "__pycache__", "*.egg-info"))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = tmp_path.glob("rhymerl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "rhymerl/trainer.py" in names and "rhymerl/histospec/proposer.py" in names
    assert [n for n in names if n.startswith("benchmarks/") or n.endswith(".jsonl") or "/bench" in n] == []
