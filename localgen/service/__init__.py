"""The engine as a service: one engine on its own thread, fed from any thread.

- :mod:`~localgen.service.engine_service`: :class:`EngineService`, the thread and its queue.
- :mod:`~localgen.service.stream`: :class:`RequestStream`, one request's outputs for a reader.
- :mod:`~localgen.service.batch_job`: :class:`BatchJob`, a JSONL batch beside chat.
- :mod:`~localgen.service.snapshot`: :class:`MetricsSnapshot` and its parts, frozen values the
  TUI, the server's ``/metrics`` and tools read; :mod:`~localgen.service.rates` builds them.
- :mod:`~localgen.service.memory`: :func:`probe_memory`.
- :mod:`~localgen.service.served`: :class:`ServedLLM`, the model surface the service drives.
"""

from localgen.service.batch_job import BatchJob
from localgen.service.engine_service import EngineService
from localgen.service.memory import probe_memory
from localgen.service.served import ServedLLM
from localgen.service.snapshot import GpuMemory, KVTier, MemorySnapshot, MetricsSnapshot, ModelInfo
from localgen.service.stream import RequestStream, ServiceClosed

__all__ = [
    "BatchJob", "EngineService", "GpuMemory", "KVTier", "MemorySnapshot", "MetricsSnapshot",
    "ModelInfo", "RequestStream", "ServedLLM", "ServiceClosed", "probe_memory",
]
