"""`localgen bench perplexity`: WikiText-2 perplexity of one GGUF file, by localgen and by
llama.cpp's ``llama-perplexity`` on the same file, scored the same way.

The method is llama-perplexity's (tools/perplexity/perplexity.cpp, ``perplexity``): the whole
``wikitext2_test.raw`` tokenized once (a BOS first when the GGUF's
``tokenizer.ggml.add_bos_token`` says so), cut into ``chunks`` consecutive windows of ``ctx``
tokens, the first token of each window replaced by BOS in that case, each window evaluated from
an empty cache, and only its second half scored (the logits at positions ``ctx/2 .. ctx-2``
against the next tokens), so every scored token has at least ``ctx/2`` tokens of context.
llama-perplexity prints ``Final estimate: PPL = …``, which ``parse_llama_perplexity`` reads.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import torch

from localgen.bench.accuracy import full_logits
from localgen.bench.data import data_dir
from localgen.bench.llama_cpp_peer import PeerError, find_tool, run_tool

WIKITEXT = "wikitext2_test.raw"


def half_window_perplexity(llm, tokens: list[int], ctx: int, chunks: int,
                           bos: int | None = None) -> tuple[float, int]:
    """(perplexity, scored tokens) over the first ``chunks`` windows of ``ctx`` tokens, each
    window's second half scored (the module docstring's method). ``bos``: the id put first in
    every window, or None. Raises ValueError when the text holds no whole window."""
    n_chunks = min(chunks, len(tokens) // ctx)
    if n_chunks < 1:
        raise ValueError(f"{len(tokens)} tokens hold no window of {ctx}")
    first, nll, count = ctx // 2, 0.0, 0
    for i in range(n_chunks):
        window = list(tokens[i * ctx:(i + 1) * ctx])
        if bos is not None:
            window[0] = bos
        logp = torch.log_softmax(full_logits(llm, window)[first:ctx - 1].double(), -1)
        target = torch.tensor(window[first + 1:], device=logp.device)
        nll -= float(logp.gather(1, target[:, None]).sum())
        count += ctx - 1 - first
    return math.exp(nll / count), count


def parse_llama_perplexity(text: str) -> float:
    """The ``Final estimate: PPL = x`` of llama-perplexity's output. Raises PeerError."""
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", text)
    if m is None:
        raise PeerError("llama-perplexity printed no final estimate")
    return float(m.group(1))


def _bos(src) -> int | None:
    """The BOS id when the GGUF asks for one before the text (``tokenizer.ggml.add_bos_token``)."""
    reader = getattr(src.weights, "reader", None)
    if reader is None:
        return None
    add = reader.fields.get("tokenizer.ggml.add_bos_token")
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    if add is None or bos is None or not bool(add.parts[add.data[0]][0]):
        return None
    return int(bos.parts[bos.data[0]][0])


def run(model: str | None, *, ctx: int = 512, chunks: int = 40, threads: int | None = None,
        llama_cpp_bin: str | None = None, data: Path | None = None, log=print) -> dict:
    """localgen's and (when its binary is found) llama-perplexity's perplexity of ``model``
    (a GGUF path; None: the embedded default) on the same windows. Returns a dict with both,
    their ratio and the seconds each took."""
    from localgen.api import LLM
    from localgen.models.sources import resolve_model

    src = resolve_model(model)
    path = Path(data or data_dir()) / WIKITEXT
    text = path.read_text(encoding="utf-8")
    bos = _bos(src)
    tokens = src.tokenizer(text, add_special_tokens=False)["input_ids"]
    if bos is not None:
        tokens = [bos] + tokens
    llm = LLM.load(model, device="cpu", dtype="float32", kv_cache_memory=src.config.kv_bytes_per_token(4) * (ctx + 32),
                   max_num_seqs=1, enable_prefix_caching=False)
    t0 = time.perf_counter()
    ppl, scored = half_window_perplexity(llm, tokens, ctx, chunks, bos)
    out = {"model": str(src.path), "ctx": ctx, "chunks": min(chunks, len(tokens) // ctx),
           "scored_tokens": scored, "localgen": ppl, "localgen_s": time.perf_counter() - t0}
    log(f"localgen: PPL {ppl:.4f} over {scored} tokens ({out['localgen_s']:.0f} s)")
    tool = find_tool("llama-perplexity", llama_cpp_bin)
    if tool is None or src.kind not in ("gguf", "embedded"):
        log("llama-perplexity not run (no binary found, or the model is not a GGUF file)")
        return out
    cmd = [str(tool), "-m", str(src.path), "-f", str(path), "-c", str(ctx), "--chunks", str(chunks),
           "-b", str(ctx)] + (["-t", str(threads)] if threads else [])
    t0 = time.perf_counter()
    peer = parse_llama_perplexity(run_tool(cmd, 7200, stderr=True))
    out.update(llama_cpp=peer, llama_cpp_s=time.perf_counter() - t0, ratio=ppl / peer)
    log(f"llama.cpp: PPL {peer:.4f} ({out['llama_cpp_s']:.0f} s); localgen / llama.cpp {ppl / peer:.4f}")
    return out
