"""Engine metrics for the panels and `localgen bench`: token counts, rates, latencies, KV use."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Metrics:
    """Counters since load; ``*_per_s`` are over the engine's busy time (time spent in steps)."""

    prompt_tokens: int = 0  # prompt tokens computed by prefill
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    generation_tokens: int = 0  # all sampled tokens (a prefill samples each sequence's first)
    decode_tokens: int = 0  # tokens sampled by decode steps
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    num_preemptions: int = 0
    requests_finished: int = 0
    ttft_seconds: deque = field(default_factory=lambda: deque(maxlen=1000))
    decode_step_seconds: deque = field(default_factory=lambda: deque(maxlen=1000))
    started: float = field(default_factory=time.perf_counter)
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0

    @property
    def busy_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def generation_tokens_per_s(self) -> float:
        return self.generation_tokens / self.busy_seconds if self.busy_seconds else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced by decode steps per second of decode time."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0
