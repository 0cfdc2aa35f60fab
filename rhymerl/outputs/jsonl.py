"""Reading JSONL files whose errors name the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator


def iter_jsonl(path: Path, error: type[Exception]) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for every non-blank line; a bad line raises ``error``."""
    with Path(path).open() as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{i}: not valid JSON ({e.msg})") from None
