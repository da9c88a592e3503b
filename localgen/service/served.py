"""ServedLLM: the surface of a loaded model that the service, the server and the batch job drive.

``localgen.api.LLM`` is the implementation; the Protocol names what the layers above it use, so
they read typed properties instead of probing the engine. Not thread-safe: only the service's
thread steps it; other threads read the constant properties (tokenizer, limits, sizes).
"""

from __future__ import annotations

from typing import Protocol

import torch

from localgen.runtime.metrics import Metrics
from localgen.runtime.request import Request, RequestOutput

__all__ = ["ServedLLM"]


class ServedLLM(Protocol):
    """A loaded model and its engine (``localgen.api.LLM``). Sizes in bytes, lengths in tokens."""

    model_name: str

    @property
    def tokenizer(self): ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def token_limit(self) -> int: ...

    @property
    def max_prompt_bytes(self) -> int: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def block_size(self) -> int: ...

    @property
    def weight_bytes(self) -> int: ...

    @property
    def kv_cache_bytes(self) -> int: ...

    @property
    def kv_bytes_per_token(self) -> int: ...

    def memory_by_tier(self) -> dict[str, int]: ...

    def add_request(self, req: Request) -> str: ...

    def abort(self, request_id: str) -> RequestOutput | None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...
