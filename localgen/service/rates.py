"""Building a :class:`MetricsSnapshot` on the engine thread from the engine's counters.

The engine keeps cumulative counters (``localgen.runtime.metrics.Metrics``); the
:class:`MetricsTracker` turns them into recent-window rates after every step, and
:func:`build_snapshot` freezes them with the model's placement and the memory probe.
Decode reads every weight and the context's KV once a step, so decode bandwidth is
(weight bytes + KV bytes per token × context tokens) per second of decode (Pope et al.,
*Efficiently Scaling Transformer Inference*, MLSys 2023, §2: decode is memory bound).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from localgen.runtime.metrics import Metrics
from localgen.runtime.request import RequestOutput
from localgen.service.served import ServedLLM
from localgen.service.snapshot import KVTier, MemorySnapshot, MetricsSnapshot, ModelInfo

if TYPE_CHECKING:
    from localgen.profiler.hardware import HardwareProfile

__all__ = ["MetricsTracker", "bandwidth_limit", "build_snapshot", "model_info", "percentile"]


def percentile(sorted_vals: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0..1) of ascending values; None for none."""
    if not sorted_vals:
        return None
    k = min(len(sorted_vals) - 1, max(0, round(q * (len(sorted_vals) - 1))))
    return sorted_vals[k]


@dataclass
class _StepSample:
    t: float
    tokens: int
    seconds: float
    bytes_read: int = 0


class MetricsTracker:
    """Turns the engine's cumulative counters into recent-window rates (engine thread only).
    ``window_s``: seconds of wall time the decode rates average over."""

    def __init__(self, window_s: float = 3.0):
        self.window_s = window_s
        self.decode: deque[_StepSample] = deque(maxlen=512)
        self.prefill: deque[_StepSample] = deque(maxlen=64)
        self.history: deque[float] = deque(maxlen=120)
        self.prev = (0, 0.0, 0, 0.0)

    def after_step(self, m: Metrics, outputs: list[RequestOutput], info: ModelInfo | None,
                   now: float) -> None:
        """Record what the step that returned ``outputs`` added to ``m`` (at ``now``, seconds)."""
        dt, ds, pt, ps = m.decode_tokens, m.decode_seconds, m.prompt_tokens, m.prefill_seconds
        p_dt, p_ds, p_pt, p_ps = self.prev
        self.prev = (dt, ds, pt, ps)
        if dt > p_dt and ds > p_ds:
            s = _StepSample(now, dt - p_dt, ds - p_ds, _decode_bytes(outputs, info))
            self.decode.append(s)
            self.history.append(s.tokens / s.seconds)
        if pt > p_pt and ps > p_ps:
            self.prefill.append(_StepSample(now, pt - p_pt, ps - p_ps))

    def rates(self, now: float) -> dict[str, Any]:
        """The rate fields of a MetricsSnapshot, by name."""
        recent = [s for s in self.decode if now - s.t <= self.window_s]
        secs = sum(s.seconds for s in recent)
        lat = sorted(s.seconds for s in list(self.decode)[-256:])
        pre = list(self.prefill)[-16:]
        pre_s = sum(s.seconds for s in pre)
        return dict(
            decode_tokens_per_s=(sum(s.tokens for s in recent) / secs) if secs else 0.0,
            decode_bandwidth=(sum(s.bytes_read for s in recent) / secs) if secs else 0.0,
            decode_history=tuple(self.history),
            prefill_tokens_per_s=(sum(s.tokens for s in pre) / pre_s) if pre_s else 0.0,
            token_latency_p50_s=percentile(lat, 0.5),
            token_latency_p90_s=percentile(lat, 0.9),
        )


def _decode_bytes(outputs: list[RequestOutput], info: ModelInfo | None) -> int:
    """Bytes one decode step read: every weight once, and each sequence's KV context."""
    if info is None:
        return 0
    ctx = sum(o.prompt_tokens + o.completion_tokens - 1 for o in outputs)
    return info.weight_bytes + info.kv_bytes_per_token * ctx


def model_info(llm: ServedLLM, predicted_peak: dict[str, float] | None = None) -> ModelInfo:
    """Where ``llm`` holds its weights and KV cache: shares per tier from ``memory_by_tier``
    (the offloading policy's placement, or everything on the model's one device)."""
    tiers = llm.memory_by_tier()
    total = sum(tiers.values()) or 1
    return ModelInfo(
        name=llm.model_name, device=str(llm.device), dtype=str(llm.dtype).replace("torch.", ""),
        weight_bytes=llm.weight_bytes, weights_gpu_share=tiers.get("gpu", 0) / total,
        weights_cpu_share=tiers.get("cpu", 0) / total,
        weights_disk_share=tiers.get("disk", 0) / total,
        kv_cache_bytes=llm.kv_cache_bytes, kv_bytes_per_token=llm.kv_bytes_per_token,
        block_size=llm.block_size, predicted_peak=predicted_peak)


def bandwidth_limit(hw: HardwareProfile | None, info: ModelInfo | None) -> tuple[float | None, str]:
    """The memory bandwidth (bytes/s) decode can reach on the model's device, from a
    HardwareProfile, and where it comes from (or why there is none)."""
    if hw is None or info is None:
        return None, "no hardware profile (run `localgen profile`)"
    on_gpu = info.device.startswith("cuda")
    val = hw.gpu_mem_bdw if on_gpu else hw.cpu_mem_bdw
    if not val:
        return None, f"profile {hw.name} has no {'GPU' if on_gpu else 'CPU'} memory bandwidth"
    return float(val), f"profile {hw.name}"


def build_snapshot(now: float, state: str, info: ModelInfo | None, memory: MemorySnapshot | None,
                   m: Metrics | None, tracker: MetricsTracker,
                   hw: HardwareProfile | None) -> MetricsSnapshot:
    """Freeze the engine's counters ``m`` (None while no model is loaded) at ``now``."""
    limit, source = bandwidth_limit(hw, info)
    if m is None or info is None:
        return MetricsSnapshot(now, state, info, memory, bandwidth_limit=limit,
                               bandwidth_limit_source=source)
    ttfts = list(m.ttft_seconds)[-64:]
    return MetricsSnapshot(
        time=now, state=state, model=info, memory=memory,
        ttft_last_s=ttfts[-1] if ttfts else None, ttft_p50_s=percentile(sorted(ttfts), 0.5),
        num_running=m.num_running, num_waiting=m.num_waiting,
        kv_tiers=(KVTier(info.kv_tier, m.kv_blocks_used, m.kv_blocks_total),),
        bandwidth_limit=limit, bandwidth_limit_source=source,
        generation_tokens=m.generation_tokens, prompt_tokens=m.prompt_tokens,
        cached_prompt_tokens=m.cached_prompt_tokens, num_preemptions=m.num_preemptions,
        requests_finished=m.requests_finished, window_s=tracker.window_s, **tracker.rates(now))
