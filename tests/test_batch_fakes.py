"""A deterministic fake of the `localgen.api.LLM` surface for batch and generate tests.

Tokens are whitespace-separated words. A request "generates" its prompt's words back, one per
step, and finishes with "stop" after echoing them all (or "length" at max_tokens; a stop string
ends it early), so prompts of different lengths finish in a different order than submitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from localgen.runtime.request import PromptTooLongError, Request, RequestOutput


@dataclass
class _Seq:
    req: Request
    words: list[str]
    prompt_tokens: int
    out: list[str] = field(default_factory=list)


class FakeLLM:
    model_name = "fake-model"
    max_prompt_bytes: int | None = None  # no bound known without tokenizing: the default line cap

    def __init__(self, *, max_model_len: int = 64, max_num_seqs: int = 4, interrupt_after: int | None = None):
        self.max_model_len = self.token_limit = max_model_len
        self.max_num_seqs = max_num_seqs
        self.interrupt_after = interrupt_after
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []
        self.requests: dict[str, Request] = {}  # every request ever added
        self.completed: list[str] = []  # request ids in finishing order
        self.aborted: list[str] = []
        self.max_queued = 0  # most requests waiting + running at once
        self.metrics = SimpleNamespace(generation_tokens_per_s=0.0)

    @staticmethod
    def render(req: Request) -> list[str]:
        if req.messages is not None:
            words = []
            for m in req.messages:
                words += [f"<{m['role']}>"] + m["content"].split()
            return words
        if req.prompt_token_ids is not None:
            return [f"t{t}" for t in req.prompt_token_ids]
        return req.prompt.split()

    def add_request(self, req: Request) -> str:
        req.sampling.validate()
        words = self.render(req)
        if len(words) + 1 > self.max_model_len:
            raise PromptTooLongError(f"prompt has {len(words)} tokens; the context holds {self.max_model_len}")
        content = [w for w in words if not w.startswith("<")] or ["x"]
        self.requests[req.request_id] = req
        self.waiting.append(_Seq(req, content, len(words)))
        self.max_queued = max(self.max_queued, len(self.waiting) + len(self.running))
        return req.request_id

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.waiting = [s for s in self.waiting if s.req.request_id != request_id]
        self.running = [s for s in self.running if s.req.request_id != request_id]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        if self.interrupt_after is not None and len(self.completed) >= self.interrupt_after:
            raise KeyboardInterrupt
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        outputs = []
        for seq in list(self.running):
            sp = seq.req.sampling
            prev = " ".join(seq.out)
            seq.out.append(seq.words[len(seq.out) % len(seq.words)])
            text = " ".join(seq.out)
            finish = None
            for s in sp.stop:
                if s in text:
                    text, finish = text[: text.index(s)], "stop"
                    break
            if finish is None and len(seq.out) >= len(seq.words):
                finish = "stop"
            if finish is None and len(seq.out) >= sp.max_tokens:
                finish = "length"
            if finish:
                self.running.remove(seq)
                self.completed.append(seq.req.request_id)
            outputs.append(
                RequestOutput(
                    request_id=seq.req.request_id,
                    text_delta=text[len(prev):] if text.startswith(prev) else "",
                    text=text,
                    token_ids=list(range(len(seq.out))),
                    finished=finish is not None,
                    finish_reason=finish,
                    prompt_tokens=seq.prompt_tokens,
                    completion_tokens=len(seq.out),
                )
            )
        self.metrics.generation_tokens_per_s = 100.0
        return outputs


def expected_text(words: list[str], max_tokens: int = 256) -> str:
    return " ".join(words[:max_tokens])


def test_fake_finishes_out_of_order():
    llm = FakeLLM()
    llm.add_request(Request(prompt="a b c d e", request_id="long"))
    llm.add_request(Request(prompt="a", request_id="short"))
    while llm.has_unfinished():
        llm.step()
    assert llm.completed == ["short", "long"]
