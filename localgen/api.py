"""The public façade: load a model, submit requests, stream tokens, read metrics.

    from localgen.api import LLM, Request, SamplingParams
    llm = LLM.load()                      # the embedded SmolLM2-135M-Instruct
    out = llm.generate([Request(messages=[{"role": "user", "content": "Hi"}],
                                sampling=SamplingParams(temperature=0, max_tokens=32))])
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch

from localgen.models.model import CausalLM
from localgen.runtime.engine import Engine, EngineConfig
from localgen.runtime.metrics import Metrics
from localgen.runtime.request import (KVBudgetError, Priority, PromptTooLongError, Request,
                                      RequestOutput, SamplingParams)

__all__ = ["LLM", "Request", "RequestOutput", "SamplingParams", "Priority", "PromptTooLongError",
           "KVBudgetError",
           "EngineConfig", "default_device", "default_dtype"]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    # float32 on the CPU is the correctness oracle's dtype; bf16 where tensor cores make it fast
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if name is None:
        return default_dtype(device)
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(table)}")
    return table[name]


@contextmanager
def _threads_beside_one_busy_core() -> Iterator[None]:
    """Run the body with one intra-op thread fewer (at least one), then restore the count.

    While the weights load, the tokenizer thread keeps a core busy; an OpenMP parallel region
    waits for all of its threads, so one that counts that core stalls a scheduler time slice at
    every op of the weight preparation instead of sharing the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads - 1))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class LLM:
    """A loaded model and its engine. Not thread-safe: drive it from one thread."""

    def __init__(self, engine: Engine, model_name: str, source=None, policy=None):
        """``policy``: the offloading ``Policy`` the engine's runner was built for (None: the
        plain resident path, whose runner holds everything on the model's device)."""
        self.engine, self.model_name, self.source = engine, model_name, source
        self.policy = policy

    @classmethod
    def load(cls, model: str | None = None, *, revision: str | None = None,
             device: str | None = None, dtype: str | torch.dtype | None = None,
             kv_cache_memory: int | None = None, max_num_seqs: int | None = None,
             max_num_batched_tokens: int = 8192, block_size: int = 16,
             enable_prefix_caching: bool = True, max_model_len: int | None = None,
             policy=None, offload_dir: str | None = None, gpu_memory: int | None = None,
             cpu_memory: int | None = None, gguf_native: bool = True,
             cpu_int4: bool = True, prefill_copies: bool = False, prefill_graphs: bool = True,
             progress: Callable[[str], None] | None = None) -> "LLM":
        """Load ``model`` (None: the embedded default; a GGUF path; a Hugging Face directory; a
        hub id from the local cache; a ``ModelSource`` already resolved). Raises FileNotFoundError / UnsupportedModelError with the
        reason, ValueError for bad settings. ``progress(line)``, when given, receives short
        status lines while it loads (the stage; weight bytes read of the total).

        ``dtype`` None: bf16 on CUDA; on the CPU float32, except for a Q4_1 GGUF (the embedded
        default) on a CPU with native bf16, which runs bf16 activations and its 4-bit matrices
        through torch's int4 kernel (``localgen.quant.cpu_int4``) unless ``cpu_int4`` is False.
        That path prefills about twice as fast from bf16 copies of the matrices, which cost
        memory and load time that a server or a batch repays and a single prompt does not; with
        float32 the file's blocks are all the weights.

        ``prefill_copies``: on the CPU in float32 (``dtype`` float32, or None on a CPU with native
        bf16, where it takes precedence over ``cpu_int4``), a GGUF's layer matrices keep their
        blocks for decode steps (the float32 block path's fused C layer) and gain bf16 copies
        for products of more rows (prefill), made at the first such product
        (``cpu_int4.BlocksWithCopy``): two bytes a weight more than the blocks. Ignored
        elsewhere.

        ``policy`` (a ``localgen.policy.Policy``) runs the offloading runtime: layers on
        GPU / pinned CPU / disk files under ``offload_dir``, KV and activations split by the
        policy, the zig-zag block schedule, 4-bit compression. ``max_num_seqs`` defaults to 64, or
        to the policy's block size ``gbs * num_gpu_batches``. ``gpu_memory`` (bytes) caps CUDA
        allocations to emulate a smaller GPU; ``cpu_memory`` (bytes) is checked against the host
        bytes the placement needs (ValueError when exceeded). ``gguf_native``: with 4-bit weights,
        keep a GGUF's Q4_1 tensors bit-exact in their 32-groups instead of re-quantizing.

        ``prefill_graphs``: on CUDA, replay one prompt's whole prefill as a CUDA graph
        (``EngineConfig.prefill_graphs``, ``localgen.runtime.cuda_graphs``)."""
        from localgen.models.load_progress import LoadProgress
        from localgen.models.sources import resolve_model

        if max_num_seqs is None:
            max_num_seqs = policy.bls if policy is not None else 64
        status = LoadProgress(progress)
        status.stage(f"opening {getattr(model, 'name', None) or model or 'the embedded model'}")
        src = resolve_model(model, revision=revision)
        dev = torch.device(device) if device else default_device()
        copies = False
        if dev.type == "cpu" and policy is None:
            from localgen.quant import cpu_int4 as int4_path

            if dtype is None:
                # bf16 copies pay only where bf16 GEMMs are native; else a 4-bit GGUF on a
                # bf16-capable CPU takes torch's int4 kernel with bf16 activations (the weights
                # are 4-bit already, so float32 buys no exactness); float32 stays the default
                # elsewhere (the correctness oracle)
                copies = prefill_copies and int4_path.native_bf16()
                fast = not copies and cpu_int4 and int4_path.fast_cpu_default(src.weights)
                dtype = torch.bfloat16 if fast else None
            else:
                copies = prefill_copies and _dtype(dtype, dev) == torch.float32
        cfg = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens,
                           enable_prefix_caching=enable_prefix_caching,
                           kv_cache_memory=kv_cache_memory, max_model_len=max_model_len,
                           prefill_graphs=prefill_graphs)
        # the tokenizer (its import of transformers, mostly) is read on a thread while the
        # weights load: the two overlap on a machine with a second core
        pool = ThreadPoolExecutor(1, thread_name_prefix="localgen-tokenizer")
        tokenizer = pool.submit(lambda: src.tokenizer)
        pool.shutdown(wait=False)
        weights = status.watch(src.weights)
        status.stage("loading weights and the tokenizer")
        with _threads_beside_one_busy_core():
            llm = cls.from_parts(src.config, weights, tokenizer, cfg, device=device,
                                 dtype=dtype, name=src.name, source=src, policy=policy,
                                 offload_dir=offload_dir, gpu_memory=gpu_memory,
                                 cpu_memory=cpu_memory, gguf_native=gguf_native,
                                 prefill_copies=copies)
        status.done(f"{src.name} loaded")
        return llm

    @classmethod
    def from_parts(cls, config, weights, tokenizer, engine_config: EngineConfig | None = None, *,
                   device: str | None = None, dtype=None, name: str = "model", source=None,
                   policy=None, offload_dir: str | None = None, gpu_memory: int | None = None,
                   cpu_memory: int | None = None, gguf_native: bool = True,
                   prefill_copies: bool = False) -> "LLM":
        """Build from a ModelConfig, a weight store and a tokenizer (tests, custom sources; a
        ``concurrent.futures.Future`` of one is awaited after the weights load);
        ``policy`` etc. as in ``load``."""
        dev = torch.device(device) if device else default_device()
        factory = None
        if policy is None:
            model = CausalLM(config, weights, _dtype(dtype, dev), dev, prefill_copies=prefill_copies)
        else:
            from localgen.runtime.offload import build_offload

            model, factory = build_offload(config, weights, _dtype(dtype, dev), dev, policy,
                                           offload_dir=offload_dir, gpu_memory=gpu_memory,
                                           gguf_native=gguf_native)
        if isinstance(tokenizer, Future):
            tokenizer = tokenizer.result()
        eos = set(config.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        engine = Engine(model, tokenizer, engine_config, tuple(sorted(eos)), runner_factory=factory)
        if policy is not None and cpu_memory is not None:
            host = engine.runner.memory_by_tier()["cpu"]
            if dev.type == "cuda" and host > cpu_memory:
                raise ValueError(f"the policy needs {host / 2**30:.2f} GiB of host memory for "
                                 f"weights and KV, over the --cpu-memory cap of {cpu_memory / 2**30:.2f} GiB")
        return cls(engine, name, source, policy)

    def warm_graphs(self) -> int:
        """The engine's decode graphs of every batch bucket and prefill graphs of every
        prompt-length bucket, captured now (a server's load); how many
        (``Engine.warm_graphs``)."""
        return self.engine.warm_graphs()

    def memory_by_tier(self) -> dict[str, int]:
        """Actual bytes held per tier (gpu = the compute device, cpu, disk): weights, staging
        buffers, KV cache. The plain path holds everything on its device."""
        if self.policy is not None:  # the offload runtime's runner places each tensor
            return self.engine.runner.memory_by_tier()
        tier = "gpu" if self.device.type == "cuda" else "cpu"
        out = {"gpu": 0, "cpu": 0, "disk": 0}
        out[tier] = self.weight_bytes + self.kv_cache_bytes
        return out

    # -- the engine's surface -------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.model.cfg

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def token_limit(self) -> int:
        """Most tokens one sequence may hold: the context or the KV cache, whichever is smaller."""
        return self.engine.token_limit

    @property
    def max_prompt_bytes(self) -> int:
        """UTF-8 bytes of prompt text past which a prompt cannot fit, known without tokenizing."""
        return self.engine.max_prompt_bytes

    @property
    def metrics(self) -> Metrics:
        return self.engine.metrics

    # -- what the memory and throughput panels read (all additive, read-only) --------------
    @property
    def device(self) -> torch.device:
        """The device the weights and the KV cache live on (one device for now)."""
        return self.engine.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.model.dtype

    @property
    def block_size(self) -> int:
        return self.engine.config.block_size

    @property
    def max_num_seqs(self) -> int:
        return self.engine.config.max_num_seqs

    @property
    def weight_bytes(self) -> int:
        """Bytes of all resident weights (what one decode step reads once)."""
        return self.engine.model.weight_bytes()

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes allocated for the paged KV cache (all blocks, K and V, all layers)."""
        return self.engine.kv_cache.nbytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V, all layers, for one token of context."""
        return self.config.kv_bytes_per_token(torch.tensor([], dtype=self.dtype).element_size())

    def add_request(self, req: Request) -> str:
        return self.engine.add_request(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.engine.abort(request_id)

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    # -- conveniences ---------------------------------------------------------------------
    def generate(self, requests: Iterable[Request | str],
                 sampling: SamplingParams | None = None) -> list[RequestOutput]:
        """Run requests (strings become chat messages) to completion; final outputs in order."""
        reqs = [_as_request(r, sampling) for r in requests]
        ids = [self.add_request(r) for r in reqs]
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def stream(self, request: Request | str,
               sampling: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield each update of one request (other queued requests advance too)."""
        rid = self.add_request(_as_request(request, sampling))
        finished = False
        while not finished and self.has_unfinished():
            for out in self.step():
                if out.request_id == rid:
                    finished = out.finished
                    yield out


def _as_request(r: Request | str, sampling: SamplingParams | None) -> Request:
    if isinstance(r, Request):
        return r
    return Request(messages=[{"role": "user", "content": r}], sampling=sampling or SamplingParams())
