"""Request bodies of the OpenAI API as pydantic models, and their sampling settings.

Field names, types and ranges follow the OpenAI API reference
(https://platform.openai.com/docs/api-reference/chat/create and /completions/create); ``top_k``,
``min_p``, ``repetition_penalty`` and ``ignore_eos`` are the extensions vLLM and llama.cpp's server
accept too. Types are strict (a string is not a number); unknown fields are ignored, as clients
send many optional ones (``user``, ``metadata``, ``store``, ...). A value out of range or of the
wrong type fails validation with its field path (see ``errors.from_validation_error``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from localgen.runtime.request import SamplingParams

MAX_N = 16  # choices per request: each is its own engine request in the shared batch
MAX_STOP = 4  # OpenAI's limit on stop sequences


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Model):
    include_usage: bool = False


class TextPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Model):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _SamplingFields(_Model):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: Probability | None = None
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: Union[str, list[str], None] = None
    max_tokens: int | None = Field(None, ge=1)
    ignore_eos: bool = False
    response_format: dict[str, Any] | None = None

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int]] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=5)  # the legacy API: top alternatives, 0..5
    echo: bool = False
    suffix: str | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """One prompt text, several, or one prompt of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


def sampling_params(body: _SamplingFields, max_tokens: int, *, seed_offset: int = 0,
                    response_format: dict | None = None) -> SamplingParams:
    """The engine's settings for one choice. OpenAI's defaults: temperature 1, top_p 1.
    ``seed_offset`` gives each of ``n`` seeded choices its own seed; ``response_format``
    overrides the body's (tool calls constrained to a schema)."""
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=top_k,
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=None if body.seed is None else body.seed + seed_offset,
        max_tokens=max_tokens, stop=body.stop_list(), ignore_eos=body.ignore_eos,
        logprobs=body.num_logprobs(),
        response_format=response_format if response_format is not None else body.response_format,
    )
