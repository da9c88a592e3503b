"""A sequence's state inside the engine: its tokens, block table and progress."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from localgen.runtime.request import Priority, SamplingParams

_arrival = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """``token_ids`` holds prompt then output tokens; ``num_computed`` of them have K/V cached."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    priority: Priority
    generator: torch.Generator | None
    status: SequenceStatus = SequenceStatus.WAITING
    grammar: Any = None  # structured.SequenceGrammar of a request with a response_format
    block_table: list[int] = field(default_factory=list)  # KV group 0's (most models have one)
    group_tables: list[list[int]] = field(default_factory=list)  # KV groups 1.. (kv/groups.py)
    num_computed: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    arrival: int = field(default_factory=lambda: next(_arrival))
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    logprobs: list = field(default_factory=list)  # TokenLogprob per output token, when asked

    @property
    def block_tables(self) -> list[list[int]]:
        """Every KV group's block table, group 0 first (the lists themselves, not copies)."""
        return [self.block_table, *self.group_tables]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def sort_key(self) -> tuple[int, int]:
        return (int(self.priority), self.arrival)
