"""Tool calling pieces of the server: parsing the formats models emit, rendering tools into a
prompt (native template or the fallback system message), and the forced-call schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from localgen.server.protocol import ChatMessage, NamedToolChoice, Tool
from localgen.server.tools import (may_become_call, parse_tool_calls, render_messages,
                                   template_has_tools, tool_call_schema)
from tests.tiny_models import make_tokenizer

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"]}}})
TIME = Tool.model_validate({"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}})
TOOLS = [WEATHER, TIME]


def test_hermes_qwen_blocks_with_text_around():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>')
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                      ("get_time", {"tz": "CET"})]
    openai_call = calls[0].to_openai()
    assert openai_call["type"] == "function" and openai_call["id"].startswith("call_")
    assert json.loads(openai_call["function"]["arguments"]) == {"city": "Paris"}


def test_unclosed_block_at_the_end_still_parses():
    _, calls = parse_tool_calls('<tool_call>{"name": "get_time", "arguments": {}}', TOOLS)
    assert [c.name for c in calls] == ["get_time"]


def test_llama3_json_calls_with_parameters_and_python_tag():
    content, calls = parse_tool_calls('<|python_tag|>{"name": "get_weather", "parameters": '
                                      '{"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
                                      TOOLS)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo"}),
                                                      ("get_time", {})]


@pytest.mark.parametrize("text", [
    "The weather is nice.",
    '{"name": "send_email", "arguments": {}}',  # not one of the tools
    '<tool_call>{"name": "get_weather", "arguments": </tool_call>',  # broken JSON
    '{"city": "Paris"}',  # JSON, but no call
])
def test_text_that_is_not_a_call_stays_content(text):
    assert parse_tool_calls(text, TOOLS) == (text, [])


def test_streamed_prefixes_that_may_become_calls():
    assert may_become_call("") and may_become_call("<tool") and may_become_call(' {"na')
    assert may_become_call("<|python") and not may_become_call("Hello")


def test_forced_call_schema_admits_only_calls_to_the_chosen_tool():
    named = tool_call_schema(TOOLS, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_weather"}}))
    schema = named["json_schema"]["schema"]
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}, schema)
    for bad in ({"name": "get_time", "arguments": {}},
                {"name": "get_weather", "arguments": {"unit": "c"}},  # city is required
                {"name": "get_weather", "arguments": {"city": "Rome", "unit": "k"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    anyof = tool_call_schema(TOOLS, "required")["json_schema"]["schema"]
    jsonschema.validate({"name": "get_time", "arguments": {"tz": "UTC"}}, anyof)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "other", "arguments": {}}, anyof)


def test_template_without_tools_gets_a_system_message_listing_them():
    tok = make_tokenizer()
    assert not template_has_tools(tok)
    text = render_messages(tok, [ChatMessage(role="user", content="Weather in Paris?")], TOOLS)
    assert "<tool_call>" in text and '"name": "get_weather"' in text and "Weather in Paris?" in text
    assert text.index("get_weather") < text.index("Weather in Paris?")


def test_native_tool_template_renders_tools_and_past_calls():
    tok = make_tokenizer()
    tok.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}"
        "{% endfor %}|{% endfor %}")
    assert template_has_tools(tok)
    msgs = [ChatMessage(role="user", content="Weather?"),
            ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}),
            ChatMessage(role="tool", content="sunny", tool_call_id="call_1")]
    text = render_messages(tok, msgs, TOOLS)
    # the template reads the arguments as a mapping, as transformers' tool templates expect
    assert text == "TOOLS:get_weather;get_time;|user: Weather?|assistant: CALL get_weather Paris|tool: sunny|"
