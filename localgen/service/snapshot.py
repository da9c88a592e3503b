"""The engine's state as frozen values: what the TUI's panels, ``GET /metrics`` and tools read.

A :class:`MetricsSnapshot` is built on the engine thread (``localgen.service.rates``) and handed
to readers on any thread; being frozen, a reader never sees it change. Units: bytes, seconds,
tokens/s, bytes/s.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GpuMemory", "KVTier", "MemorySnapshot", "MetricsSnapshot", "ModelInfo"]


@dataclass(frozen=True)
class GpuMemory:
    """One GPU: device-wide figures from NVML (None without nvidia-ml-py) and this process's
    from torch.cuda."""

    name: str
    used_bytes: int | None
    total_bytes: int | None
    torch_allocated_bytes: int
    torch_reserved_bytes: int


@dataclass(frozen=True)
class MemorySnapshot:
    """Memory of the machine and of this process, in bytes. ``gpus`` is empty and ``gpu_note``
    says why (e.g. "no GPU") on a machine without one."""

    process_rss_bytes: int
    system_used_bytes: int
    system_total_bytes: int
    gpus: tuple[GpuMemory, ...] = ()
    gpu_note: str = ""
    offload_disk_bytes: int = 0  # tensors offloaded to disk (no disk tier yet: 0)


@dataclass(frozen=True)
class ModelInfo:
    """What the loaded model occupies and where. Shares are fractions of ``weight_bytes``."""

    name: str
    device: str  # "cpu", "cuda:0", ...
    dtype: str
    weight_bytes: int
    weights_gpu_share: float
    weights_cpu_share: float
    weights_disk_share: float
    kv_cache_bytes: int
    kv_bytes_per_token: int
    block_size: int
    # the cost model's peak bytes per tier ("gpu", "cpu", "disk") for the offloading policy the
    # model runs under, shown beside the measured memory; None without a policy
    predicted_peak: dict[str, float] | None = None

    @property
    def kv_tier(self) -> str:
        return "GPU" if self.device.startswith("cuda") else "CPU"


@dataclass(frozen=True)
class KVTier:
    """KV blocks (the paged cache's 16-token blocks) of one tier, used and in all."""

    name: str  # "GPU" / "CPU" / "disk"
    blocks_used: int
    blocks_total: int

    @property
    def blocks_free(self) -> int:
        return self.blocks_total - self.blocks_used


@dataclass(frozen=True)
class MetricsSnapshot:
    """What the memory and throughput panels show, at ``time`` (perf_counter seconds).

    Rates are over the recent window (``window_s`` of wall time, decode steps only for the
    decode figures). ``decode_history`` is tokens/s of each recent decode step (oldest first),
    for a sparkline. ``decode_bandwidth`` = bytes of weights + KV read per second of decode
    (Efficiently Scaling Transformer Inference: decode is memory bound); ``bandwidth_limit`` is
    the machine's measured memory bandwidth from a HardwareProfile (None when none is known).
    ``token_latency_*`` is the inter-token latency: seconds of one decode step. The counters
    (``generation_tokens`` ... ``requests_finished``) are the engine's totals since load
    (``localgen.runtime.metrics.Metrics``); ``num_running`` / ``num_waiting`` and the KV blocks
    are as the engine left them after its last step or abort.
    """

    time: float
    state: str  # "loading" | "ready" | "failed" | "closed"
    model: ModelInfo | None
    memory: MemorySnapshot | None
    decode_tokens_per_s: float = 0.0
    decode_history: tuple[float, ...] = ()
    prefill_tokens_per_s: float = 0.0
    ttft_last_s: float | None = None
    ttft_p50_s: float | None = None
    token_latency_p50_s: float | None = None
    token_latency_p90_s: float | None = None
    num_running: int = 0
    num_waiting: int = 0
    kv_tiers: tuple[KVTier, ...] = ()
    decode_bandwidth: float = 0.0  # bytes/s
    bandwidth_limit: float | None = None  # bytes/s
    bandwidth_limit_source: str = ""
    generation_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    requests_finished: int = 0
    window_s: float = 0.0

    @property
    def kv_blocks_used(self) -> int:
        return sum(t.blocks_used for t in self.kv_tiers)

    @property
    def kv_blocks_total(self) -> int:
        return sum(t.blocks_total for t in self.kv_tiers)

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used
