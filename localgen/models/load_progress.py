"""What a model load is doing, as short status lines for a callback (the CLI prints them on
stderr): the stage, and while weights load, the bytes read so far of the total.

`LoadProgress.watch` counts a weight store's reads by wrapping ``get`` and ``get_packed`` on that
store object (each read's size is the store's ``nbytes`` of the tensor: the bytes on disk).
"""

from __future__ import annotations

import time
from typing import Any, Callable

Report = Callable[[str], None]


class LoadProgress:
    """Reports ``stage`` lines at once and weight bytes at most every ``interval`` seconds.

    ``report(line)`` gets lines such as ``"loading weights: 41.3 / 98.4 MiB"``; ``None`` drops
    them."""

    def __init__(self, report: Report | None, interval: float = 0.25):
        self.report, self.interval = report, interval
        self.bytes_read, self.total_bytes = 0, 0
        self._last = 0.0
        self._t0 = time.perf_counter()

    def stage(self, text: str) -> None:
        if self.report is not None:
            self.report(text)

    def watch(self, store: Any) -> Any:
        """Count ``store``'s reads from now on (the same object is returned); the total is the
        stored size of every tensor it names."""
        if self.report is None:
            return store
        try:
            self.total_bytes = sum(int(store.nbytes(n)) for n in store.names())
        except Exception:  # a store without sizes: bytes read are still counted
            self.total_bytes = 0
        for method in ("get", "get_packed"):
            inner = getattr(store, method, None)
            if callable(inner):
                setattr(store, method, self._counting(store, inner))
        return store

    def _counting(self, store: Any, inner: Callable) -> Callable:
        def read(name: str, *args: Any, **kwargs: Any) -> Any:
            out = inner(name, *args, **kwargs)
            if out is not None:
                try:
                    self._add(int(store.nbytes(name)))
                except Exception:
                    pass
            return out

        return read

    def _add(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        now = time.perf_counter()
        if now - self._last >= self.interval:
            self._last = now
            done = min(self.bytes_read, self.total_bytes or self.bytes_read) / 2**20
            of = f" / {self.total_bytes / 2**20:.1f}" if self.total_bytes else ""
            self.report(f"loading weights: {done:.1f}{of} MiB")

    def done(self, text: str = "ready") -> None:
        self.stage(f"{text} ({time.perf_counter() - self._t0:.1f} s)")
