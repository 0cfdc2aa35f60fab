"""Rollout trace files (JSONL, one response per line), shared by the HistoSpec benchmark and the simulator."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from rhymerl.outputs.atomic import atomic_write_text
from rhymerl.outputs.jsonl import iter_jsonl


class TraceError(ValueError):
    pass


@dataclass
class TraceRecord:
    prompt_id: str
    epoch: int
    sample_idx: int
    token_ids: list[int]
    logprobs: Optional[list[float]] = None
    reward: Optional[float] = None
    prompt_token_ids: Optional[list[int]] = None
    step: Optional[int] = None  # the training step that wrote it (runs' traces.jsonl carry it)

    def to_json(self) -> str:
        d = {"prompt_id": self.prompt_id, "epoch": self.epoch, "sample_idx": self.sample_idx, "token_ids": self.token_ids}
        if self.logprobs is not None:
            d["logprobs"] = self.logprobs
        if self.reward is not None:
            d["reward"] = self.reward
        if self.prompt_token_ids is not None:
            d["prompt_token_ids"] = self.prompt_token_ids
        if self.step is not None:
            d["step"] = self.step
        return json.dumps(d)


def _int_list(v, path: str, line: int, key: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise TraceError(f"{path}:{line}: {key} must be a list of integers")
    return v


def read_trace(path: str | Path) -> list[TraceRecord]:
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file {path} does not exist")
    out = []
    for i, d in iter_jsonl(path, TraceError):
        if not isinstance(d, dict):
            raise TraceError(f"{path}:{i}: each line must be a JSON object")
        for key in ("prompt_id", "epoch", "sample_idx", "token_ids"):
            if key not in d:
                raise TraceError(f"{path}:{i}: missing {key!r}")
        if not isinstance(d["epoch"], int) or not isinstance(d["sample_idx"], int):
            raise TraceError(f"{path}:{i}: epoch and sample_idx must be integers")
        if not isinstance(d.get("step", 0), int):
            raise TraceError(f"{path}:{i}: step must be an integer")
        rec = TraceRecord(
            prompt_id=str(d["prompt_id"]), epoch=d["epoch"], sample_idx=d["sample_idx"],
            token_ids=_int_list(d["token_ids"], str(path), i, "token_ids"), logprobs=d.get("logprobs"),
            reward=d.get("reward"), prompt_token_ids=_int_list(d["prompt_token_ids"], str(path), i, "prompt_token_ids")
            if d.get("prompt_token_ids") is not None else None, step=d.get("step"))
        if rec.logprobs is not None and len(rec.logprobs) != len(rec.token_ids):
            raise TraceError(f"{path}:{i}: logprobs has {len(rec.logprobs)} entries for {len(rec.token_ids)} tokens")
        out.append(rec)
    if not out:
        raise TraceError(f"trace file {path} is empty")
    return out


def write_trace(path: str | Path, records: Iterable[TraceRecord]) -> None:
    atomic_write_text(Path(path), "".join(r.to_json() + "\n" for r in records))


def by_epoch(records: Iterable[TraceRecord]) -> dict[int, dict[str, list[TraceRecord]]]:
    """epoch -> prompt_id -> records sorted by sample_idx."""
    out: dict[int, dict[str, list[TraceRecord]]] = {}
    for r in records:
        out.setdefault(r.epoch, {}).setdefault(r.prompt_id, []).append(r)
    for ep in out.values():
        for recs in ep.values():
            recs.sort(key=lambda r: r.sample_idx)
    return out
