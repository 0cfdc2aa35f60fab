"""Reward items, results, answer extraction and the built-in scorers (module-level, so they pickle)."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Optional, Union

KINDS = ("auto", "math_verify", "exact")


@dataclass
class RewardItem:
    """One response to score. Plain data, so it pickles to worker processes."""

    response_text: str
    answer: str  # the gold answer
    kind: str = "auto"
    # reasoning-gym entries' metadata ("source_dataset" selects its score_answer); picklable.
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardResult:
    score: float = 0.0
    correct: bool = False
    extracted: Optional[str] = None
    timed_out: bool = False
    error: Optional[str] = None
    elapsed_s: float = 0.0  # inside the scorer


Scorer = Callable[[RewardItem], Union[float, RewardResult]]

_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
# A final-answer line, "Answer: 42" (markdown emphasis allowed): data.answer_format=step_by_step.
_ANSWER_LINE = re.compile(r"^[ \t>#*_]*(?:final )?answer[*_]*[ \t]*[:=][*_]*[ \t]*(.*?)[ \t*_.]*$", re.IGNORECASE | re.MULTILINE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def extract_answer(text: str) -> Optional[str]:
    """The final answer of a response: the last ``<answer>`` tag, else the last ``Answer:`` line, else the last
    ``\\boxed{}``, else the last number on the last line, else that line."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    lines = [m for m in _ANSWER_LINE.findall(text) if m.strip()]
    if lines:
        inner = last_boxed(lines[-1])
        return inner if inner is not None else lines[-1].strip()
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return None
    nums = _NUMBER.findall(lines[-1])
    if nums:
        return nums[-1].replace(",", "")
    return lines[-1]


def _normalise(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\s+", " ", s)
    if s.endswith(".") and not _NUMBER.fullmatch(s):
        s = s[:-1].rstrip()
    n = s.replace(",", "")  # Numeric answers compare as numbers ("12.0" == "12", "1,000" == "1000").
    if _NUMBER.fullmatch(n):
        try:
            f = float(n)
            return repr(int(f)) if f.is_integer() and abs(f) < 2**53 else repr(f)
        except ValueError:
            pass
    return s


@lru_cache(maxsize=64)
def _rg_score_fn(name: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)


def exact_score(item: RewardItem) -> RewardResult:
    """A reasoning-gym entry by its dataset's ``score_answer``; anything else by normalised equality."""
    extracted = extract_answer(item.response_text)
    source = item.metadata.get("source_dataset") if item.metadata else None
    if source:
        fn = _rg_score_fn(source)
        score = float(fn(extracted, {"question": item.metadata.get("question", ""),
                                     "answer": item.answer, "metadata": item.metadata}))
    else:
        score = float(extracted is not None and _normalise(extracted) == _normalise(item.answer))
    return RewardResult(score=score, correct=score >= 1.0, extracted=extracted)


def _mv_timeout() -> Optional[int]:
    # math-verify's signal.alarm raises outside a main thread: run without a timeout there.
    if threading.current_thread() is not threading.main_thread():
        return None
    return _MV_TIMEOUT_S


_MV_TIMEOUT_S = 2  # per parse/compare; the pool's hard timeout is the backstop above it


def math_verify_score(item: RewardItem) -> RewardResult:
    """math-verify: parse gold (as LaTeX-math) and prediction to SymPy and compare them."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    t = _mv_timeout()
    gold_text = item.answer.strip()
    if "$" not in gold_text and "\\boxed" not in gold_text:
        gold_text = f"${gold_text}$"
    cfgs = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = parse(gold_text, extraction_config=cfgs, parsing_timeout=t)
    if not gold:
        raise ValueError(f"math-verify cannot parse the gold answer {item.answer!r}")
    tags = _ANSWER_TAG.findall(item.response_text)
    pred_text = item.response_text
    if tags:
        inner = tags[-1].strip()
        pred_text = inner if ("$" in inner or "\\boxed" in inner) else f"${inner}$"
    pred = parse(pred_text, extraction_config=cfgs, parsing_timeout=t)
    ok = bool(pred) and verify(gold, pred, timeout_seconds=t)
    extracted = None
    if pred:
        extracted = str(pred[-1]) if isinstance(pred[-1], str) else str(pred[0])
    return RewardResult(score=float(ok), correct=ok, extracted=extracted)


BUILTIN_SCORERS: dict[str, Scorer] = {"math_verify": math_verify_score, "exact": exact_score}


def resolve_kind(item: RewardItem, cfg_kind: str) -> str:
    """The config's kind unless "auto", then the item's; else exact for reasoning-gym items, else math-verify."""
    if cfg_kind != "auto":
        return cfg_kind
    if item.kind != "auto":
        return item.kind
    return "exact" if item.metadata and item.metadata.get("source_dataset") else "math_verify"
