"""Per-term timers for ``localgen bench offload``: ctog / gtoc / dtoc / ctod / compute (FlexGen's
cost-model terms), split by phase (prefill / decode).

Disabled (the default) they cost nothing. Enabled with ``sync=True`` each timed section
synchronizes the device before and after, so the terms are measured one at a time (no overlap) and
can be compared with the cost model's per-term predictions.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict

import torch


class Timers:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.enabled = False
        self.phase = "decode"
        self.totals: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()
        self._local = threading.local()

    def reset(self) -> None:
        self.totals.clear()

    def _sync(self, stream=None) -> None:
        if self.device.type == "cuda":
            (stream.synchronize() if stream is not None else torch.cuda.synchronize(self.device))

    @contextlib.contextmanager
    def section(self, term: str, sync: bool = True, stream=None):
        """Time a section exclusively: an inner section's time is not also counted in the outer
        one (a compute section that contains a copy books the copy as ctog only)."""
        if not self.enabled:
            yield
            return
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        if sync:
            self._sync(stream)
        now = time.perf_counter()
        if stack:
            outer = stack[-1]
            self._add(outer[0], now - outer[1])
        me = [term, now]
        stack.append(me)
        try:
            yield
        finally:
            if sync:
                self._sync(stream)
            now = time.perf_counter()
            self._add(term, now - me[1])
            stack.pop()
            if stack:
                stack[-1][1] = now

    def _add(self, term: str, dt: float) -> None:
        with self._lock:
            self.totals[f"{self.phase}.{term}"] += dt

    def terms(self, phase: str) -> dict[str, float]:
        return {t: self.totals.get(f"{phase}.{t}", 0.0) for t in ("ctog", "gtoc", "dtoc", "ctod", "compute")}
