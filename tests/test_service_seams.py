"""The typed seams name only members their implementations have: ServedLLM and BatchLLM against
``localgen.api.LLM`` and the service's batch engine, ChatService against EngineService and the
TUI tests' fake service (so a fake cannot drift from the real service unnoticed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from localgen.api import LLM
from localgen.batch.runner import BatchLLM
from localgen.service import EngineService, ServedLLM
from localgen.service.batch_job import BatchEngine, BatchJob
from localgen.tui.service_seam import ChatService
from tests.tiny_models import make_hf_model
from tests.tui_fakes import FakeService


def members(proto: type) -> set[str]:
    names = {n for n in vars(proto) if not n.startswith("_")}
    return names | set(getattr(proto, "__annotations__", {}))


def missing(obj: object, proto: type) -> list[str]:
    return sorted(n for n in members(proto) if not hasattr(obj, n))


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = make_hf_model(tmp_path_factory.mktemp("seams"), "smollm")
    return LLM.load(str(path), device="cpu", kv_cache_memory=1 << 22)


def test_the_llm_is_a_served_llm_and_a_batch_llm(llm):
    assert members(ServedLLM) >= {"step", "metrics", "memory_by_tier", "model_name"}
    assert missing(llm, ServedLLM) == []
    assert missing(llm, BatchLLM) == []


def test_the_service_batch_engine_is_a_batch_llm(llm):
    job = BatchJob(Path("in.jsonl"), Path("out.jsonl"), {}, None, None)
    engine = BatchEngine(llm, job, lambda: False, llm.step)
    assert missing(engine, BatchLLM) == []
    assert engine.max_prompt_bytes == llm.max_prompt_bytes and engine.token_limit == llm.token_limit


@pytest.mark.parametrize("make", [lambda: EngineService(lambda: None), FakeService],
                         ids=["EngineService", "FakeService"])
def test_services_offer_what_the_chat_app_uses(make):
    assert members(ChatService) >= {"submit", "abort", "metrics", "batch_jobs", "model_info"}
    assert missing(make(), ChatService) == []
