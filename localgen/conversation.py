"""A multi-turn chat: messages, system prompt, sampling settings, transcripts. No UI code.

Each turn sends the whole conversation through the model's chat template; the engine's prefix
cache (PagedAttention-style hashed blocks) finds the blocks of the turns before, so only the new
user message (and the template's glue) is prefilled: ``cached_prompt_tokens`` of each answer says
how many prompt tokens were reused.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from localgen.fileio import atomic_write_text
from localgen.runtime.request import Priority, Request, RequestOutput, SamplingParams


@dataclass
class Turn:
    """One message. Assistant turns carry the figures of their answer."""

    role: str  # "system" | "user" | "assistant"
    content: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    seconds: float | None = None
    created: float = field(default_factory=time.time)


@dataclass
class Conversation:
    """The state of one chat. ``system`` is sent first when not empty."""

    system: str = ""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.7, top_p=0.95, max_tokens=512))
    turns: list[Turn] = field(default_factory=list)
    model: str = ""

    def messages(self) -> list[dict[str, str]]:
        """Chat messages for the template (system first, then the turns)."""
        msgs = [{"role": "system", "content": self.system}] if self.system.strip() else []
        return msgs + [{"role": t.role, "content": t.content} for t in self.turns if t.role != "system"]

    def ask(self, text: str) -> Request:
        """Record the user's message; the request for the answer (``Priority.INTERACTIVE``).
        Sampling is copied, so later edits do not change a request in flight."""
        self.turns.append(Turn("user", text))
        return Request(messages=self.messages(), sampling=SamplingParams(**asdict(self.sampling)),
                       priority=Priority.INTERACTIVE)

    def record_answer(self, out: RequestOutput | None, text: str | None = None, *,
                      ttft_s: float | None = None, seconds: float | None = None) -> Turn:
        """Add the assistant's answer (a stopped answer keeps the text it had)."""
        turn = Turn("assistant", text if text is not None else (out.text if out else ""))
        if out is not None:
            turn.finish_reason = out.finish_reason
            turn.prompt_tokens, turn.completion_tokens = out.prompt_tokens, out.completion_tokens
            turn.cached_prompt_tokens = out.cached_prompt_tokens
        turn.ttft_s, turn.seconds = ttft_s, seconds
        self.turns.append(turn)
        return turn

    def drop_unanswered(self) -> None:
        """Remove a trailing user message whose answer failed (so the next turn stays valid)."""
        if self.turns and self.turns[-1].role == "user":
            self.turns.pop()

    def clear(self) -> None:
        self.turns.clear()

    # -- transcripts --------------------------------------------------------------------------
    def to_markdown(self) -> str:
        lines = [f"# localgen chat{f' — {self.model}' if self.model else ''}", ""]
        if self.system.strip():
            lines += ["**System:** " + self.system, ""]
        for t in self.turns:
            if t.role == "user":
                lines += ["## You", "", t.content, ""]
            else:
                stats = f"{t.completion_tokens} tokens"
                if t.ttft_s is not None:
                    stats += f", first token {t.ttft_s * 1000:.0f} ms"
                if t.cached_prompt_tokens:
                    stats += f", {t.cached_prompt_tokens}/{t.prompt_tokens} prompt tokens reused"
                if t.finish_reason == "abort":
                    stats += ", stopped"
                lines += ["## Assistant", "", t.content, "", f"*{stats}*", ""]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "system": self.system,
                           "sampling": asdict(self.sampling),
                           "turns": [asdict(t) for t in self.turns]}, indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> "Conversation":
        """The conversation ``to_json`` wrote (parsed). Raises KeyError/TypeError for a missing
        or misshapen field, ValueError for sampling settings out of range."""
        sp = dict(data.get("sampling") or {})
        if "stop" in sp:
            sp["stop"] = tuple(sp["stop"] or ())
        sampling = SamplingParams(**sp).validate() if sp else cls().sampling
        turns = [Turn(**t) for t in data.get("turns") or []]
        for t in turns:
            if t.role not in ("user", "assistant", "system") or not isinstance(t.content, str):
                raise ValueError(f"a turn has role {t.role!r}; expected user or assistant with text")
        return cls(system=str(data.get("system") or ""), sampling=sampling, turns=turns,
                   model=str(data.get("model") or ""))

    def save(self, path: str | Path) -> list[Path]:
        """Write ``path`` as Markdown (.md) and JSON (.json) side by side, each atomically;
        returns both paths. Raises OSError naming the file that could not be written."""
        p = Path(path).expanduser()
        base = p.with_suffix("") if p.suffix.lower() in (".md", ".json") else p
        base.parent.mkdir(parents=True, exist_ok=True)
        md, js = base.with_suffix(".md"), base.with_suffix(".json")
        atomic_write_text(md, self.to_markdown())
        atomic_write_text(js, self.to_json())
        return [md, js]
