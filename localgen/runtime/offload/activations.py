"""Hidden states between layers on the activation tiers ``hg``/``hc`` (FlexGen §4.2, App. A.3).

A GPU batch's hidden states ``[tokens, hidden]`` leave the compute device after each layer when
``hc > 0``: their last ``hc`` share of rows go to a pinned host buffer of that batch, the first
``hg`` share stay on the device. On CUDA the copies overlap compute as in FlexGen's schedule
(Fig. 4: "store activation of batch k-1, load activation of batch k+1, compute batch k"):

- ``store`` queues batch k's device-to-host copy on a side stream once its layer is computed
  (batches of at least ``OVERLAP_MIN_BYTES``: a prefill's, not a decode step's);
- ``prefetch`` queues batch k+1's host-to-device copy on another side stream before batch k's
  compute is queued, so it runs under that compute;
- ``load`` makes the compute stream wait only for that copy.

On the compute stream these copies would leave the GPU idle for a large share of each prefill
layer of a big-batch policy. With the timers on (each term measured alone), for small batches,
or off CUDA, the copies run on the compute stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localgen.runtime.offload.memory import host_empty
from localgen.runtime.offload.timers import Timers

# below this many bytes per GPU batch a pinned copy takes less time than the side streams' events
# cost the host: decode batches copy on the compute stream
OVERLAP_MIN_BYTES = 4 << 20


@dataclass
class Held:
    """One GPU batch's hidden states while they sit on the activation tiers: ``gpu`` the rows
    kept on the device, ``host`` a view of the batch's pinned buffer (the other rows). With
    overlap: ``stored`` the event after the device-to-host copy and ``src`` the device rows it
    reads (kept alive until a wait on ``stored`` is queued on the compute stream); ``dev`` and
    ``loaded`` the host rows back on the device and the event after that copy, once
    ``prefetch`` has queued it."""

    gpu: torch.Tensor
    host: torch.Tensor
    stored: object = None
    src: torch.Tensor | None = None
    dev: torch.Tensor | None = None
    loaded: object = None


class ActivationTier:
    """Pinned buffers (one per GPU batch, grown on demand) and the two copy streams.

    Every device tensor is allocated on the compute stream and each side stream waits for the
    compute stream before using one, so the caching allocator never sees a memory block shared
    across streams: no ``record_stream``, whose deferred frees can drive the allocator into a
    memory cap, where it synchronizes all streams and leaves the GPU idle."""

    def __init__(self, hg: float, hc: float, device: torch.device, timers: Timers):
        self.hg, self.hc, self.device, self.timers = hg, hc, torch.device(device), timers
        self.cuda = self.device.type == "cuda"
        self.overlap_enabled = True  # False: the copies run on the compute stream (an A/B switch)
        self.host: dict[int, torch.Tensor] = {}  # GPU batch -> pinned buffer (uint8)
        self._streams = None  # (device-to-host, host-to-device), made on first use
        self._last: Held | None = None  # the latest stored batch whose src is still held

    @property
    def active(self) -> bool:
        """Whether hidden states leave the device between layers (``hc > 0`` on CUDA)."""
        return self.hc > 0 and self.cuda

    def overlap(self) -> bool:
        """Copies on side streams: on CUDA, timers off, not inside a CUDA-graph capture."""
        return (self.overlap_enabled and not self.timers.enabled
                and not torch.cuda.is_current_stream_capturing())

    def streams(self):
        if self._streams is None:
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return self._streams

    def host_bytes(self) -> int:
        return sum(b.numel() for b in self.host.values())

    # -- the three schedule calls -----------------------------------------------------------
    def store(self, h: torch.Tensor, k: int):
        """GPU batch ``k``'s hidden states ``[tokens, hidden]`` after a layer -> what ``load``
        takes back: ``h`` itself, or a ``Held`` whose host rows are being copied out."""
        if not self.active:
            return h
        ng = int(round(self.hg * h.shape[0]))
        src = h[ng:]
        # a view would keep all of h's device memory alive until the next layer
        keep = h[:ng].clone() if ng else h.new_empty((0,) + tuple(h.shape[1:]))
        host = self._buffer(k, src)
        if not self.overlap() or src.numel() * src.element_size() < OVERLAP_MIN_BYTES:
            with self.timers.section("gtoc"):
                host.copy_(src, non_blocking=True)  # stream order: read before it is rewritten
            return Held(keep, host)
        self._release(self._last)  # one batch of compute later: that copy has long finished
        d2h = self.streams()[0]
        d2h.wait_stream(torch.cuda.current_stream(self.device))  # h is computed
        with torch.cuda.stream(d2h):
            host.copy_(src, non_blocking=True)
            stored = torch.cuda.Event()
            stored.record(d2h)
        self._last = Held(keep, host, stored, src)
        return self._last

    def prefetch(self, a):
        """Queue the host-to-device copy of a batch ``store`` copied out on its side stream
        (no-op for anything else, or one already queued); returns ``a``. Call it before
        queuing the compute it should run under."""
        if not isinstance(a, Held) or a.stored is None or a.dev is not None:
            return a
        h2d = self.streams()[1]
        dev = torch.empty(a.host.shape, dtype=a.host.dtype, device=self.device)  # compute stream's
        h2d.wait_stream(torch.cuda.current_stream(self.device))  # the memory's last users are done
        h2d.wait_event(a.stored)  # the pinned buffer holds the whole batch
        with torch.cuda.stream(h2d):
            dev.copy_(a.host, non_blocking=True)
            a.loaded = torch.cuda.Event()
            a.loaded.record(h2d)
        a.dev = dev
        return a

    def load(self, a) -> torch.Tensor:
        """Hidden states ``[tokens, hidden]`` on the compute device for the next layer."""
        if isinstance(a, torch.Tensor):
            return a
        self._release(a)
        if a.dev is None:
            with self.timers.section("ctog"):
                dev = a.host.to(self.device, non_blocking=True)
        else:
            torch.cuda.current_stream(self.device).wait_event(a.loaded)
            dev, a.dev = a.dev, None
        return dev if a.gpu.shape[0] == 0 else torch.cat([a.gpu, dev])

    def _release(self, a: Held | None) -> None:
        """Queue the compute stream's wait for ``a``'s device-to-host copy, then drop its source
        rows: their memory returns to the compute stream's pool only after that copy."""
        if a is None or a.stored is None or a.src is None:
            return
        torch.cuda.current_stream(self.device).wait_event(a.stored)
        a.src = None
        if self._last is a:
            self._last = None

    def _buffer(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """GPU batch ``k``'s pinned host buffer viewed as ``x``'s shape and dtype; grown when a
        step needs more (a pageable copy would be synchronous and several times slower than the
        pinned bandwidth the cost model prices)."""
        nbytes = x.numel() * x.element_size()
        buf = self.host.get(k)
        if buf is None or buf.numel() < nbytes:
            if buf is not None:  # queued copies on any stream may still use the old buffer (rare)
                torch.cuda.synchronize(self.device)
            buf = self.host[k] = host_empty(nbytes, pin=True)
        return buf[:nbytes].view(x.dtype).view(x.shape)
