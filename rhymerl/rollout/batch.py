"""What the trainer asks a rollout for, and what it gets back."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field


@dataclass
class Sample:
    """One response of one prompt group in a step."""

    group: int               # index into the batch's prompts
    sample_idx: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str = ""
    reward: float = 0.0
    correct: bool = False
    reward_error: bool = False
    reward_timeout: bool = False


@dataclass(frozen=True)
class RolloutBatch:
    """``n`` responses to each of ``prompts``; ``round``: DAPO's refill batch (own seeds, must not replay 0)."""

    step: int
    epoch: int
    prompts: list[list[int]]
    keys: list[int]
    n: int
    round: int = 0

    @property
    def tag(self) -> str:
        """The batch's name in seeds and group ids."""
        return f"{self.step}" if self.round == 0 else f"{self.step}.{self.round}"


@dataclass
class InstanceReport:
    """What one rollout instance did for a batch: engine steps that emitted tokens and steps that emitted
    none, busy seconds, engine figures."""

    engine_steps: int = 0
    idle_steps: int = 0
    busy_s: float = 0.0
    engine: dict = field(default_factory=dict)


@dataclass
class RolloutOutput:
    samples: list[Sample]
    metrics: dict


def request_seed(run_seed: int, step: int | str, instance: int, offset: int) -> int:
    """A sampling seed that depends only on (run seed, step, instance): resume replays a step."""
    return zlib.crc32(f"{run_seed}:{step}:{instance}:{offset}".encode()) & 0x3FFFFFFF
