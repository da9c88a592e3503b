"""Memory of the machine, this process and every visible GPU, for the memory panel.

psutil for RAM; NVML (nvidia-ml-py) for device-wide GPU figures, torch.cuda for this process's
allocations and as the fallback for device totals.
"""

from __future__ import annotations

from typing import Any

from localgen.service.snapshot import GpuMemory, MemorySnapshot

__all__ = ["probe_memory"]


_nvml_state: dict[str, Any] = {}


def _nvml():
    """The pynvml module, initialised once; None when nvidia-ml-py or a driver is missing."""
    if "mod" not in _nvml_state:
        try:
            import pynvml

            pynvml.nvmlInit()
            _nvml_state["mod"] = pynvml
        except Exception as e:  # no library, no driver, no GPU
            _nvml_state["mod"], _nvml_state["why"] = None, str(e) or type(e).__name__
    return _nvml_state["mod"]


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # a broken CUDA install reads as no GPU: the panel still shows RAM
        return False


def _gpu_memory(index: int, nv) -> GpuMemory:
    """One GPU's figures: device-wide from NVML when it answers, else from torch.cuda."""
    import torch

    used = total = None
    if nv is not None:
        try:
            info = nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(index))
            used, total = int(info.used), int(info.total)
        except Exception:  # a GPU NVML cannot see (e.g. MIG): torch's figures below
            pass
    if total is None:
        free_b, total_b = torch.cuda.mem_get_info(index)
        used, total = int(total_b - free_b), int(total_b)
    return GpuMemory(torch.cuda.get_device_name(index), used, total,
                     int(torch.cuda.memory_allocated(index)), int(torch.cuda.memory_reserved(index)))


def probe_memory(process=None) -> MemorySnapshot:
    """Process RSS and system RAM (psutil); every visible GPU (NVML + torch.cuda) if any.
    ``process``: a ``psutil.Process`` to reuse (default: this process)."""
    import psutil

    proc = process or psutil.Process()
    vm = psutil.virtual_memory()
    gpus: tuple[GpuMemory, ...] = ()
    note = "no GPU"
    if _cuda_available():
        import torch

        nv = _nvml()
        gpus = tuple(_gpu_memory(i, nv) for i in range(torch.cuda.device_count()))
        note = "" if nv is not None else "NVML unavailable: device totals from torch.cuda"
    return MemorySnapshot(int(proc.memory_info().rss), int(vm.total - vm.available), int(vm.total),
                          gpus, note)
