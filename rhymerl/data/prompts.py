"""Render prompt records into token ids for the policy (chat template, few-shot, system)."""

from __future__ import annotations

import numpy as np

from rhymerl.config import DataConfig
from rhymerl.data.records import DatasetError, PromptRecord

# Appended to a plain-text question per ``data.answer_format``; step_by_step names the line the scorer reads.
ANSWER_INSTRUCTIONS = {
    "final_only": "Give only the final answer.",
    "step_by_step": "Solve it step by step, explaining each step. End with a line: Answer: <answer>", "none": ""}


def _ask(question: str, cfg: DataConfig) -> str:
    instruction = ANSWER_INSTRUCTIONS[cfg.answer_format]
    return f"{question} {instruction}" if instruction else question


def messages_for(record: PromptRecord, shots: list[PromptRecord], cfg: DataConfig) -> list[dict]:
    msgs: list[dict] = []
    if cfg.system_prompt:
        msgs.append({"role": "system", "content": cfg.system_prompt})
    for s in shots:
        q = s.prompt if isinstance(s.prompt, str) else s.prompt[-1]["content"]
        msgs.append({"role": "user", "content": _ask(q, cfg)})
        # A shot shows the format it asks for; its worked steps are not in the data, only the answer.
        shot = f"Answer: {s.answer}" if cfg.answer_format == "step_by_step" else s.answer
        msgs.append({"role": "assistant", "content": shot})
    if isinstance(record.prompt, list):
        msgs.extend(record.prompt)
    else:
        msgs.append({"role": "user", "content": _ask(record.prompt, cfg)})
    return msgs


def render_prompt(record: PromptRecord, shots: list[PromptRecord], tokenizer, cfg: DataConfig) -> list[int]:
    msgs = messages_for(record, shots, cfg)
    if cfg.chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = list(ids)
    else:
        text = "\n".join(f"{m['role']}: {m['content']}" for m in msgs) + "\nassistant:"
        ids = tokenizer.encode(text, add_special_tokens=True)
    if len(ids) > cfg.max_prompt_tokens:
        raise DatasetError(f"prompt {record.id!r} has {len(ids)} tokens > data.max_prompt_tokens={cfg.max_prompt_tokens}")
    return ids


def few_shot_pool(records: list[PromptRecord], k: int, seed: int) -> dict[str, list[PromptRecord]]:
    """Fixed shots per prompt (other prompts of the set), so a prompt's tokens never change across epochs."""
    if k <= 0 or len(records) < 2:
        return {r.id: [] for r in records}
    rng = np.random.default_rng(seed)
    out = {}
    for i, r in enumerate(records):
        others = [j for j in range(len(records)) if j != i]
        pick = rng.choice(others, size=min(k, len(others)), replace=False)
        out[r.id] = [records[j] for j in pick]
    return out
