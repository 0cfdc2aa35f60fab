"""Prompt records and their loaders: seeded reasoning-gym tasks, or JSONL / Parquet prompt files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from rhymerl.config import DataConfig
from rhymerl.outputs.jsonl import iter_jsonl


class DatasetError(ValueError):
    pass


@dataclass
class PromptRecord:
    id: str
    prompt: Union[str, list]
    answer: str
    metadata: dict = field(default_factory=dict)
    reward: Optional[str] = None  # "reasoning_gym", "math_verify" or "exact"; None: the reward config decides


def _check_row(row: Any, where: str, default_id: str) -> PromptRecord:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: each row must be an object with 'prompt' and 'answer'")
    if "prompt" not in row:
        raise DatasetError(f"{where}: missing 'prompt'")
    if "answer" not in row:
        raise DatasetError(f"{where}: missing 'answer'")
    prompt = row["prompt"]
    if isinstance(prompt, list):
        for m in prompt:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DatasetError(f"{where}: 'prompt' as a list must hold {{'role': str, 'content': str}} messages")
    elif not isinstance(prompt, str) or not prompt.strip():
        raise DatasetError(f"{where}: 'prompt' must be a non-empty string or a list of chat messages")
    answer = row["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DatasetError(f"{where}: 'answer' must be a string or a number")
    meta = row.get("metadata") or {}
    if not isinstance(meta, dict):
        raise DatasetError(f"{where}: 'metadata' must be an object")
    reward = row.get("reward")
    if reward not in (None, "math_verify", "exact"):
        raise DatasetError(f"{where}: 'reward' must be 'math_verify' or 'exact', got {reward!r}")
    unknown = set(row) - {"prompt", "answer", "id", "metadata", "reward"}
    if unknown:
        raise DatasetError(f"{where}: unknown columns {sorted(unknown)}; allowed: prompt, answer, id, metadata, reward")
    return PromptRecord(id=str(row.get("id", default_id)), prompt=prompt, answer=str(answer), metadata=meta, reward=reward)


def load_jsonl(path: Path) -> list[PromptRecord]:
    return [_check_row(row, f"{path}:{i}", f"{path.stem}:{i}") for i, row in iter_jsonl(path, DatasetError)]


def load_parquet(path: Path) -> list[PromptRecord]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise DatasetError(f"{path}: cannot read Parquet file ({e})") from None
    out = []
    for i, row in enumerate(table.to_pylist(), 1):
        row = {k: v for k, v in row.items() if v is not None}
        out.append(_check_row(row, f"{path}:row {i}", f"{path.stem}:{i}"))
    return out


def load_reasoning_gym(cfg: DataConfig) -> list[PromptRecord]:
    import reasoning_gym

    out = []
    per_task = max(1, cfg.size // len(cfg.tasks))
    for t_i, task in enumerate(cfg.tasks):
        kwargs = cfg.task_args.get(task, {})
        if not isinstance(kwargs, dict):
            raise DatasetError(f"data.task_args.{task}: must be a mapping of generator arguments")
        try:
            ds = reasoning_gym.create_dataset(task, size=per_task, seed=cfg.seed + t_i, **kwargs)
        except Exception as e:
            raise DatasetError(f"data.tasks: reasoning-gym cannot build {task!r} with {kwargs}: {e}") from None
        for j, entry in enumerate(ds):
            entry = dict(entry)
            meta = {"task": task, "task_args": kwargs, "seed": cfg.seed + t_i, "size": per_task, "index": j,
                    "entry": {k: v for k, v in entry.items() if k in ("question", "answer", "metadata")}}
            out.append(PromptRecord(id=f"{task}:{cfg.seed + t_i}:{j}", prompt=entry["question"],
                                    answer=str(entry["answer"]), metadata=meta, reward="reasoning_gym"))
    return out


def load_records(cfg: DataConfig) -> list[PromptRecord]:
    if cfg.source == "reasoning_gym":
        recs = load_reasoning_gym(cfg)
    else:
        path = Path(cfg.path).expanduser()
        if not path.is_file():
            raise DatasetError(f"data.path: {path} does not exist")
        recs = load_jsonl(path) if cfg.source == "jsonl" else load_parquet(path)
    if not recs:
        raise DatasetError(f"data: the dataset ({cfg.source} {cfg.path or cfg.tasks}) is empty")
    ids = [r.id for r in recs]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DatasetError(f"data: duplicate prompt id {dup!r}; ids must be unique")
    return recs
