"""The metric keys docs/operations.md documents under "What a step logs", as patterns: a run
that logs a key the table lacks leaves its users guessing."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
PLACEHOLDERS = {"<i>": r"\d+", "<src>": r"[a-z]+", "<b>": r"0\.\d", "<phase>": r"[a-z_]+"}


def documented_patterns() -> list[re.Pattern]:
    """One pattern per key in the first column; ``.../x`` is the key before it with its last part x."""
    section = DOC.read_text().split("\n## What a step logs\n", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        prev = ""
        for key in re.findall(r"`([^`]+)`", line.split("|")[1]):
            key = prev.rsplit("/", 1)[0] + key[3:] if key.startswith(".../") else key
            prev = key
            rx = re.escape(key)
            for name, sub in PLACEHOLDERS.items():
                rx = rx.replace(re.escape(name), sub)
            out.append(re.compile(rx))
    return out


def undocumented(keys) -> list[str]:
    pats = documented_patterns()
    return sorted(k for k in keys if not any(p.fullmatch(k) for p in pats))
