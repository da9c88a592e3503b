"""The engine loop: admit requests, run one scheduled step, sample, detokenize, finish.

``step()`` is one iteration of iteration-level scheduling; callers (the batch runner, the TUI's
worker thread, ``LLM.generate``) drive it and receive RequestOutputs.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable

import torch

from localgen.kv.cache import PagedKVCache, activation_reserve_bytes, plan_group_blocks
from localgen.kv.groups import GroupedBlockManager, kv_groups
from localgen.runtime.cuda_graphs import GraphedModelRunner
from localgen.models.model import CausalLM
from localgen.runtime.detokenizer import IncrementalDetokenizer
from localgen.runtime.model_runner import ModelRunner, layer_windows
from localgen.runtime.metrics import Metrics
from localgen.runtime.request import KVBudgetError, PromptTooLongError, Request, RequestOutput
from localgen.runtime.sampling import sample, sampled_logprobs
from localgen.runtime.scheduler import ScheduledBatch, Scheduler
from localgen.runtime.sequence import Sequence
from localgen.runtime.structured import GrammarCache, mask_logits

# How far a tokenizer's normalizer may shrink text, in UTF-8 bytes (see Engine.max_prompt_bytes).
_NORMALIZER_SLACK = 4


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


@dataclass
class EngineConfig:
    """Engine limits. ``kv_cache_memory`` in bytes (None: sized from free memory)."""

    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None
    max_model_len: int | None = None
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs on CUDA devices
    # with cuda_graphs, also replay one prompt's whole prefill (runtime/cuda_graphs.py) and an
    # all-GPU 4-bit offload policy's whole-prompt prefill blocks
    prefill_graphs: bool = True


class Engine:
    def __init__(self, model: CausalLM, tokenizer, config: EngineConfig | None = None,
                 eos_token_ids: tuple[int, ...] = (), runner_factory=None):
        """``runner_factory(model, config, max_model_len)``, when given, builds the model runner
        and its KV cache (``runner.kv``: num_blocks, block_size, nbytes) instead of the plain
        ModelRunner over a PagedKVCache (the offloading runtime, runtime/offload)."""
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        mcfg = model.cfg
        self.max_model_len = min(mcfg.max_position_embeddings, config.max_model_len or 1 << 62)
        if runner_factory is not None:
            self.runner = runner_factory(model, config, self.max_model_len)
            self.kv_cache = self.runner.kv
            # the offload runtime's cache keeps one block table per sequence: one KV group, which
            # gives back the blocks behind the window when every layer slides
            dense = getattr(mcfg, "dense", None)
            pools = [(self.kv_cache.num_blocks, dense.kv_window(mcfg.num_layers) if dense else None)]
        else:
            reserve = activation_reserve_bytes(mcfg, config.max_num_batched_tokens,
                                               config.max_num_seqs, model.dtype)
            groups = kv_groups(layer_windows(mcfg))
            counts = plan_group_blocks(mcfg, groups, config.block_size, model.dtype, model.device,
                                       config.kv_cache_memory, config.max_num_seqs,
                                       self.max_model_len, reserve_bytes=reserve)
            self.kv_cache = PagedKVCache(mcfg, counts, config.block_size, model.dtype, model.device,
                                         groups)
            pools = [(n, g.window) for n, g in zip(counts, groups)]
            # an MoE layer reads its per-expert token counts on the host: no graph capture
            graphs = config.cuda_graphs and getattr(mcfg, "moe", None) is None
            if model.device.type == "cuda" and graphs:
                self.runner = GraphedModelRunner(model, self.kv_cache, config.max_num_seqs,
                                                 self.max_model_len,
                                                 prefill_graphs=config.prefill_graphs)
            else:
                self.runner = ModelRunner(model, self.kv_cache)
        # one pool per KV group; a sliding group gives back the blocks behind its window
        self.block_manager = GroupedBlockManager.build(pools, config.block_size,
                                                       config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   max(config.max_num_batched_tokens, config.block_size))
        self.eos_token_ids = frozenset(eos_token_ids)
        # response_format grammars, compiled on first use against this tokenizer
        self.grammars = GrammarCache(tokenizer, getattr(mcfg, "vocab_size", None),
                                     tuple(sorted(self.eos_token_ids)))
        self.seqs: dict[str, Sequence] = {}
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self.metrics = Metrics(kv_blocks_total=self.block_manager.num_blocks)
        # Overlapped outputs: a step's outputs (detokenization, RequestOutputs) are built in the
        # next step, once its model work is queued, so on a device that computes asynchronously
        # (CUDA) that host work runs while the device does and not between two steps. Only the
        # token-level bookkeeping (EOS, limits, a grammar's end) stays in the step; a request
        # with stop strings is decoded at once, since its text decides whether it ends.
        self.overlap_outputs = False
        self._pending: dict[str, tuple[Sequence, bool]] = {}  # id -> (seq, ended on EOS)
        # called in each step once the runner has queued the model's work and before sampling
        # waits for its logits, with the outputs built there (the previous step's, when
        # overlapping; they also lead the step's return value)
        self.after_launch: Callable[[list[RequestOutput]], None] | None = None

    # -- limits ---------------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds for one sequence: the longest any one sequence can grow."""
        return self.block_manager.capacity_tokens

    @property
    def token_limit(self) -> int:
        """Most tokens (prompt + output) a sequence may hold: the context or the KV cache,
        whichever is smaller. A sequence that reaches it finishes with reason "length", so a
        running sequence alone always has room to grow and preemption always makes progress."""
        return min(self.max_model_len, self.kv_capacity_tokens)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest vocabulary entry: no token covers more text than this."""
        vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
        return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=0) or 64

    @property
    def max_prompt_bytes(self) -> int:
        """UTF-8 bytes of prompt text past which a prompt cannot fit ``token_limit``, without
        tokenizing it: every token covers at most ``max_token_bytes`` bytes, and a tokenizer's
        normalizer may shrink text (Unicode composition: at most 3 bytes to 1), hence the 4x."""
        return (self.token_limit - 1) * self.max_token_bytes * _NORMALIZER_SLACK

    # -- requests -------------------------------------------------------------------------
    def tokenize(self, req: Request) -> list[int]:
        """Prompt token ids; chat ``messages`` go through the model's own chat template.
        Raises PromptTooLongError without tokenizing when the text exceeds ``max_prompt_bytes``."""
        given = [x is not None for x in (req.prompt, req.messages, req.prompt_token_ids)]
        if sum(given) != 1:
            raise ValueError("a request needs exactly one of prompt, messages, prompt_token_ids")
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if req.messages is not None:
            text = self.tokenizer.apply_chat_template(req.messages, tokenize=False,
                                                      add_generation_prompt=True)
            return list(self.tokenizer(self._bounded(text), add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(self._bounded(req.prompt))["input_ids"])

    def _bounded(self, text: str) -> str:
        nbytes, cap = len(text.encode("utf-8", "surrogatepass")), self.max_prompt_bytes
        if nbytes > cap:
            raise PromptTooLongError(
                f"prompt of {nbytes} bytes cannot fit {self.token_limit} tokens (at most "
                f"{self.max_token_bytes} bytes a token); not tokenized")
        return text

    def add_request(self, req: Request) -> str:
        """Queue a request. Raises ValueError (bad sampling values, empty prompt),
        PromptTooLongError when the prompt leaves no room for one generated token in the context,
        and KVBudgetError when it would not fit the KV cache even alone."""
        req.sampling.validate()
        if req.request_id in self.seqs:
            raise ValueError(f"request id {req.request_id!r} is already running")
        ids = self.tokenize(req)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) + 1 > self.max_model_len:
            raise PromptTooLongError(f"prompt of {len(ids)} tokens does not fit the context of "
                                     f"{self.max_model_len} tokens")
        if len(ids) + 1 > self.kv_capacity_tokens:
            raise self._budget_error(len(ids) + 1)
        gen = None
        if req.sampling.seed is not None:
            gen = torch.Generator().manual_seed(req.sampling.seed)
        grammar = self.grammars.sequence_grammar(req.sampling.response_format)
        seq = Sequence(req.request_id, ids, len(ids), req.sampling, req.priority, gen)
        seq.grammar = grammar
        self.seqs[seq.request_id] = seq
        self.detoks[seq.request_id] = IncrementalDetokenizer(self.tokenizer, req.sampling.stop)
        self.scheduler.add(seq)
        return seq.request_id

    def _budget_error(self, num_tokens: int) -> KVBudgetError:
        bm = self.block_manager
        per_block = self.kv_cache.bytes_per_block
        need = bm.blocks_for(num_tokens) * per_block
        blocks = self.kv_capacity_tokens // bm.block_size  # one sequence's, in every KV group
        have = blocks * per_block
        return KVBudgetError(
            f"the KV cache budget ({_mib(have)}: {blocks} block"
            f"{'s' if blocks != 1 else ''} of {bm.block_size} tokens) "
            f"holds {self.kv_capacity_tokens} tokens; this prompt needs {num_tokens} "
            f"({_mib(need)}): raise the KV cache budget (--kv-cache-memory, kv_cache_memory=) "
            f"to at least {_mib(need)}", need, have)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output, if it was known
        (None too for a request that has already ended, its final output not yet built)."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.finish_reason is not None:
            return None
        # an output still to be built: its text goes out with this final one
        delta = self.detoks[request_id].update(seq.output_ids)[0] \
            if self._pending.pop(request_id, None) else ""
        self.scheduler.finish(seq, "abort")
        self._update_gauges()  # the panels read these: freed blocks show at once
        return self._output(seq, delta)

    def warm_graphs(self) -> int:
        """Capture the decode graphs of every batch bucket and the prefill graphs of every
        prompt-length bucket now rather than at first use (``GraphedModelRunner``'s
        ``capture_batches``, ``capture_prefills``); how many were captured, 0 for a runner
        without graphs."""
        runner = self.runner
        return sum(getattr(runner, name)() for name in ("capture_batches", "capture_prefills")
                   if hasattr(runner, name))

    def has_unfinished(self) -> bool:
        """Requests still running or waiting, or outputs not yet built (``overlap_outputs``)."""
        return self.scheduler.has_unfinished() or bool(self._pending)

    # -- one iteration --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduled model step; the outputs it built, the overlapped outputs of the
        previous step first."""
        batch = self.scheduler.schedule()
        if batch is None:
            if self.scheduler.has_unfinished():  # a bug, never a state to wait out
                raise RuntimeError(f"the scheduler found no work for {len(self.scheduler.waiting)} "
                                   f"waiting and {len(self.scheduler.running)} running requests")
            return self._settle()  # the last step's outputs, with no next step to hide them
        self.metrics.num_preemptions += len(batch.preempted)
        ended = [self._finish(seq, "length") for seq in batch.out_of_memory]
        settled, outputs = self._run(batch) if batch.seqs else (self._settle(), [])
        self._update_gauges()
        return settled + ended + outputs

    def _run(self, batch: ScheduledBatch) -> tuple[list[RequestOutput], list[RequestOutput]]:
        """Run and sample ``batch``: (the previous step's outputs built meanwhile, this step's
        outputs built now)."""
        t0 = time.perf_counter()
        seqs = batch.seqs
        if batch.is_prefill:
            self.metrics.prompt_tokens += sum(s.num_tokens - s.num_computed for s in seqs)
            self.metrics.cached_prompt_tokens += sum(s.num_computed for s in seqs)
        logits = self.runner.run(seqs, batch.is_prefill)
        settled = self._settle()  # the model's work is queued; sampling waits for it
        if self.after_launch is not None:
            self.after_launch(settled)
        params = [s.sampling for s in seqs]
        masked = mask_logits(logits, [s.grammar for s in seqs])  # response_format rows
        tokens = sample(masked, params, [s.token_ids for s in seqs], [s.generator for s in seqs],
                        [s.output_ids for s in seqs])
        for seq, lp in zip(seqs, sampled_logprobs(logits, tokens, params)):
            if lp is not None:
                seq.logprobs.append(lp)
        now = time.perf_counter()
        if batch.is_prefill:
            self.metrics.prefill_seconds += now - t0
        else:
            self.metrics.decode_seconds += now - t0
            self.metrics.decode_tokens += len(seqs)
            self.metrics.decode_step_seconds.append(now - t0)
        self.metrics.generation_tokens += len(seqs)
        advanced = (self._advance(seq, tok, now) for seq, tok in zip(seqs, tokens))
        return settled, [out for out in advanced if out is not None]

    def _advance(self, seq: Sequence, token: int, now: float) -> RequestOutput | None:
        """Append ``token`` and end the sequence if it must; its output, or None when that
        waits for the next step (``overlap_outputs``)."""
        seq.token_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        seq.num_computed = seq.num_tokens - 1
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.metrics.ttft_seconds.append(now - seq.arrival_time)
        sp = seq.sampling
        if token in self.eos_token_ids and not sp.ignore_eos:
            return self._end(seq, "stop", eos=True)
        if seq.grammar is not None and seq.grammar.complete:  # nothing but EOS could follow
            reason = "stop"
        elif seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.token_limit:
            reason = "length"
        else:
            reason = None
        if not sp.stop:
            return self._defer(seq, False) if reason is None else self._end(seq, reason)
        # text decides whether the sequence ends: decoded, and its output built, now
        delta, hit_stop = self.detoks[seq.request_id].update(seq.output_ids)
        if hit_stop:
            return self._finish(seq, "stop", delta)
        if reason is None:
            return self._output(seq, delta)
        return self._finish(seq, reason, delta + self._final_text(seq, False))

    def _end(self, seq: Sequence, reason: str, eos: bool = False) -> RequestOutput | None:
        """Finish ``seq`` (its blocks are free at once); its final output now, or in the next
        step when overlapping. ``eos``: the last token is the end-of-sequence token, whose
        text is not part of the output."""
        self.scheduler.finish(seq, reason)
        self.metrics.requests_finished += 1
        return self._defer(seq, eos)

    def _defer(self, seq: Sequence, eos: bool) -> RequestOutput | None:
        """``seq``'s output now, or None with it left for the next step's ``_settle``."""
        if self.overlap_outputs:
            self._pending[seq.request_id] = (seq, eos)
            return None
        return self._built(seq, eos)

    def _settle(self) -> list[RequestOutput]:
        """Build the outputs the last step left pending (``overlap_outputs``)."""
        if not self._pending:  # every step asks, overlapping or not
            return []
        pending, self._pending = self._pending, {}
        return [self._built(seq, eos) for seq, eos in pending.values()]

    def _built(self, seq: Sequence, eos: bool) -> RequestOutput:
        """``seq``'s output with the text its tokens added (all of it once it has ended)."""
        if seq.finish_reason is None:
            return self._output(seq, self.detoks[seq.request_id].update(seq.output_ids)[0])
        return self._output(seq, self._final_text(seq, eos))

    def _final_text(self, seq: Sequence, eos: bool) -> str:
        ids = seq.output_ids
        return self.detoks[seq.request_id].update(ids[:-1] if eos else ids, final=True)[0]

    def _finish(self, seq: Sequence, reason: str, delta: str | None = None) -> RequestOutput:
        """End ``seq`` now with its final output; an output of it still pending is folded in
        (the final text covers its tokens)."""
        self._pending.pop(seq.request_id, None)
        if delta is None:
            delta = self._final_text(seq, False)
        self.scheduler.finish(seq, reason)
        self.metrics.requests_finished += 1
        return self._output(seq, delta)

    def _output(self, seq: Sequence, delta: str) -> RequestOutput:
        finished = seq.finish_reason is not None
        if finished:
            self.seqs.pop(seq.request_id, None)
            detok = self.detoks.pop(seq.request_id)
        else:
            detok = self.detoks[seq.request_id]
        return RequestOutput(seq.request_id, delta, detok.emitted, list(seq.output_ids), finished,
                             seq.finish_reason, seq.num_prompt_tokens, seq.num_output_tokens,
                             seq.num_cached_prompt_tokens,
                             list(seq.logprobs) if seq.sampling.logprobs is not None else None)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.num_running, m.num_waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        m.kv_blocks_used = self.block_manager.num_blocks - self.block_manager.num_free_blocks
