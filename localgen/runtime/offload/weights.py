"""Layer weights placed on GPU / pinned CPU / disk at layer granularity, streamed to the compute
device in the order of the zig-zag block schedule (FlexGen §4.1-4.2).

Each layer's tensors (4-bit packed when the policy compresses weights, FlexGen §5) sit in one
flat byte buffer, so one copy moves a layer: a resident buffer on the compute device ("gpu"), a
pinned host buffer ("cpu"), or a file ``<offload_dir>/layer_<layer:03d>.bin`` read through a read-only
memory map ("disk"). On CUDA, ``prefetch(j)`` starts layer j's load while the caller computes
layer j-1: disk reads run on a CPU thread into one of two pinned staging buffers, then an async
host->device copy on a side stream lands in one of two device staging buffers (double buffering);
``get(j)`` makes the compute stream wait for it and hands packed weights to the int4 GEMM
dispatcher (``localgen.quant.int4.as_linear``: flat Triton GEMM at small M, dequantize + cuBLAS at
large M). On the CPU the same calls run synchronously and packed weights are dequantized before
use (a "cpu" layer is used in place; a "disk" layer is read from its file into a staging buffer
every time it is used).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from localgen.quant.gguf_blocks import PackedGGUFWeight
from localgen.quant.int4 import GROUP_SIZE, Int4Tensor, as_linear, dequantize, keeps_packed, quantize
from localgen.runtime.offload.memory import Layout, host_empty
from localgen.runtime.offload.timers import Timers

QSUFFIX = ("#packed", "#scale", "#min")
GGUF_SUFFIX = "#gguf"  # a GGUF matrix's raw block rows (``PackedGGUFWeight.raw``)


def is_matrix(short: str, t: torch.Tensor) -> bool:
    """Linear weights get compressed; norms, biases (1-D) stay in the compute dtype."""
    return t.dim() == 2


def pack_layer(w: dict[str, torch.Tensor | Int4Tensor | PackedGGUFWeight], dtype: torch.dtype
               ) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """Flatten a layer's weights into plain tensors (Int4Tensor -> packed/scale/min; a GGUF
    matrix -> its raw block rows, the file's bytes) plus the quantization metadata needed to
    rebuild them: ``key -> (group_size, dim, shape)`` or ``key -> ("gguf", qtype, shape)``."""
    flat, qmeta = {}, {}
    for k, t in w.items():
        if isinstance(t, PackedGGUFWeight):
            flat[k + GGUF_SUFFIX] = t.file_raw()  # the file's blocks, also where repacked for the CPU
            qmeta[k] = ("gguf", int(t.qtype), t.shape)
        elif isinstance(t, Int4Tensor):
            flat[k + QSUFFIX[0]], flat[k + QSUFFIX[1]], flat[k + QSUFFIX[2]] = t.packed, t.scale, t.min
            qmeta[k] = (t.group_size, t.dim, t.shape)
        else:
            flat[k] = t.to(dtype)
    return flat, qmeta


def unpack_layer(views: dict[str, torch.Tensor], qmeta: dict[str, tuple], dtype: torch.dtype
                 ) -> dict[str, torch.Tensor]:
    """Views of a layer's buffer -> the weights dict the layer function reads: on CUDA (with
    triton) each 4-bit matrix becomes a callable dispatching by M to the int4 flat GEMM or
    dequantize + cuBLAS (``int4.as_linear``, FlashDecoding++ §5); elsewhere it is dequantized.
    A GGUF matrix becomes a ``PackedGGUFWeight`` over its rows in the buffer (no copy): it
    multiplies from its blocks on either device."""
    out = {k: v for k, v in views.items() if "#" not in k}
    gguf = {k: m for k, m in qmeta.items() if m[0] == "gguf"}
    for k, (_, qtype, shape) in gguf.items():
        out[k] = PackedGGUFWeight(views[k + GGUF_SUFFIX], qtype, shape)
    int4 = {k: m for k, m in qmeta.items() if k not in gguf}
    packed = bool(int4) and keeps_packed(views[next(iter(int4)) + QSUFFIX[0]].device.type)
    for k, (g, dim, shape) in int4.items():
        q = Int4Tensor(views[k + QSUFFIX[0]], views[k + QSUFFIX[1]], views[k + QSUFFIX[2]], g, dim, shape)
        out[k] = as_linear(q, dtype) if packed and len(shape) == 2 else dequantize(q, dtype)
    return out


class LayerWeights:
    """All decoder layers' weights on their tiers, and the streaming machinery."""

    def __init__(self, layers: list[dict[str, torch.Tensor | Int4Tensor]] | None, tiers: list[str],
                 dtype: torch.dtype, device: torch.device, offload_dir: str | os.PathLike | None,
                 timers: Timers, *, layer_source=None, num_layers: int | None = None):
        """``layers[i]``: layer i's weights (plain tensors, or Int4Tensor for compressed ones); or
        ``layer_source(i)`` returning them one at a time (so a large model never sits in memory
        whole). Raises ValueError when a layer goes to disk and no ``offload_dir`` is given."""
        self.dtype, self.device, self.timers = dtype, torch.device(device), timers
        self.cuda = self.device.type == "cuda"
        self.tiers = list(tiers)
        n = num_layers if num_layers is not None else len(layers)
        if "disk" in self.tiers:
            if offload_dir is None:
                raise ValueError("the policy puts weights on disk (wd > 0): give an offload dir")
            self.dir = Path(offload_dir)
            self.dir.mkdir(parents=True, exist_ok=True)
        self.layouts: list[Layout] = []
        self.qmeta: list[dict] = []
        self.bufs: list[torch.Tensor | None] = []  # gpu: device buffer, cpu: host buffer, disk: None
        self.paths: list[Path | None] = []
        self.maps: list[np.memmap | None] = []
        self.disk_bytes_read = 0
        self.disk_reads = 0
        for i in range(n):
            w = layers[i] if layers is not None else layer_source(i)
            flat, qm = pack_layer(w, dtype)
            lay = Layout.of(flat)
            self.layouts.append(lay)
            self.qmeta.append(qm)
            tier = self.tiers[i]
            if tier == "gpu":
                buf = torch.empty(lay.nbytes, dtype=torch.uint8, device=self.device)
                lay.fill(buf, {k: v.to(self.device) for k, v in flat.items()})
            elif tier == "cpu":
                buf = host_empty(lay.nbytes, pin=self.cuda)
                lay.fill(buf, {k: v.cpu() for k, v in flat.items()})
            else:
                buf = None
                tmp = torch.zeros(lay.nbytes, dtype=torch.uint8)
                lay.fill(tmp, {k: v.cpu() for k, v in flat.items()})
                path = self.dir / f"layer_{i:03d}.bin"
                tmp.numpy().tofile(path)
                del tmp
            self.bufs.append(buf)
            self.paths.append(None if buf is not None else path)
            self.maps.append(None if buf is not None else np.memmap(path, dtype=np.uint8, mode="r"))
            del w, flat
        streamed = [lay.nbytes for lay, t in zip(self.layouts, self.tiers) if t != "gpu"]
        self.stage_bytes = max(streamed, default=0)
        disk = [lay.nbytes for lay, t in zip(self.layouts, self.tiers) if t == "disk"]
        # two host staging buffers for disk reads, two device buffers for streamed layers
        self.host_stage = [host_empty(max(disk), pin=self.cuda) for _ in range(2)] if disk else []
        self.dev_stage = ([torch.empty(self.stage_bytes, dtype=torch.uint8, device=self.device)
                           for _ in range(2)] if (self.cuda and streamed) else [])
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="localgen-disk") if disk else None
        self._lock = threading.Lock()
        self.pending: dict[int, tuple[Future | None, object]] = {}
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self.slot_free = [torch.cuda.Event() for _ in range(2)]
            self.h2d_done = [torch.cuda.Event() for _ in range(2)]

    # -- sizes ------------------------------------------------------------------------------
    def bytes_on(self, tier: str) -> int:
        return sum(l.nbytes for l, t in zip(self.layouts, self.tiers) if t == tier)

    def all_on(self, tier: str) -> bool:
        return all(t == tier for t in self.tiers)

    def staging_bytes(self) -> dict[str, int]:
        return {"gpu": sum(b.numel() for b in self.dev_stage), "cpu": sum(b.numel() for b in self.host_stage)}

    # -- disk -------------------------------------------------------------------------------
    def _read_disk(self, j: int, slot: int) -> torch.Tensor:
        """Read layer j's file (through its memory map) into host staging buffer ``slot``."""
        n = self.layouts[j].nbytes
        stage = self.host_stage[slot]
        if self.cuda:
            self.h2d_done[slot].synchronize()  # the previous copy out of this buffer has finished
        with self.timers.section("dtoc", sync=False):
            np.copyto(stage[:n].numpy(), self.maps[j][:n])
        with self._lock:
            self.disk_bytes_read += n
            self.disk_reads += 1
        return stage[:n]

    # -- the schedule's calls ----------------------------------------------------------------
    def prefetch(self, j: int) -> None:
        """Start loading layer j toward the compute device (no-op for resident layers)."""
        if j >= len(self.tiers) or self.tiers[j] == "gpu" or j in self.pending:
            return
        slot = j % 2
        if not self.cuda:
            self.pending[j] = (None, None)
            return
        ready = torch.cuda.Event()
        n = self.layouts[j].nbytes

        def h2d(src: torch.Tensor) -> None:
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.slot_free[slot])  # layer j-2 is done with the slot
                with self.timers.section("ctog", stream=self.copy_stream):
                    self.dev_stage[slot][:n].copy_(src, non_blocking=True)
                if self.tiers[j] == "disk":
                    self.h2d_done[slot].record(self.copy_stream)
                ready.record(self.copy_stream)

        if self.tiers[j] == "cpu":
            h2d(self.bufs[j])
            self.pending[j] = (None, ready)
        else:
            self.pending[j] = (self.pool.submit(lambda: h2d(self._read_disk(j, slot))), ready)

    def get(self, j: int) -> dict[str, torch.Tensor]:
        """Layer j's weights on the compute device in the compute dtype (waits for its load)."""
        tier, lay = self.tiers[j], self.layouts[j]
        if tier == "gpu":
            buf = self.bufs[j]
        elif not self.cuda:
            self.pending.pop(j, None)
            buf = self.bufs[j] if tier == "cpu" else self._read_disk(j, j % 2)
        else:
            if j not in self.pending:
                self.prefetch(j)
            fut, ready = self.pending.pop(j)
            if fut is not None:
                fut.result()
            torch.cuda.current_stream(self.device).wait_event(ready)
            buf = self.dev_stage[j % 2]
        views = lay.views(buf)
        if not self.qmeta[j]:
            return views
        with self.timers.section("compute"):
            return unpack_layer(views, self.qmeta[j], self.dtype)

    def release(self, j: int) -> None:
        """The compute that reads layer j's staging buffer has been queued: the buffer may be
        refilled once it finishes (recorded as an event on the compute stream)."""
        if self.cuda and self.tiers[j] != "gpu":
            self.slot_free[j % 2].record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.maps = [None] * len(self.maps)


QUANT_CHUNK = 1 << 25  # float32 elements one quantization step holds on its device (128 MiB)


def compress_layer(w: dict[str, torch.Tensor], pre: dict[str, Int4Tensor] | None = None,
                   group_size: int = GROUP_SIZE, device: torch.device | None = None
                   ) -> dict[str, torch.Tensor | Int4Tensor]:
    """FlexGen §5: 2-D weights -> 4-bit groups of ``group_size`` along the output channels
    (dim 0), quantized on ``device`` (default: where each weight is; the codes stay there);
    ``pre`` supplies tensors already in the int4 format (GGUF Q4_1 imports)."""
    out = {}
    for k, t in w.items():
        if pre and k in pre:
            out[k] = pre[k]
        elif is_matrix(k, t):
            out[k] = quantize_columns(t, group_size, device or t.device)
        else:
            out[k] = t
    return out


def quantize_columns(t: torch.Tensor, group_size: int, device: torch.device) -> Int4Tensor:
    """``quantize(t.float(), group_size, dim=0)`` computed on ``device`` a chunk of at most
    ``QUANT_CHUNK`` elements at a time: the groups run down the columns, so columns quantize
    independently and the chunks' codes concatenate. Building a GPU-heavy 4-bit policy under a
    GPU cap then never holds a layer, or even a matrix, there in float32 (OPT-30B's fc1: 0.8 GB,
    its quantization temporaries several times that)."""
    step = max(1, QUANT_CHUNK // max(1, t.shape[0]))
    parts = [quantize(t[:, c:c + step].to(device).float(), group_size, dim=0)
             for c in range(0, t.shape[1], step)]
    if len(parts) == 1:
        return parts[0]
    return Int4Tensor(*(torch.cat([getattr(p, f) for p in parts], dim=1) for f in ("packed", "scale", "min")),
                      group_size, 0, tuple(t.shape))
