"""`collector_paused`: generate and chat load their model with the cyclic collector off, then
freeze what the load made and turn the collector back on (issue 31's cold start)."""

from __future__ import annotations

import gc

import pytest

from localgen.cli.startup_gc import collector_paused


@pytest.fixture(autouse=True)
def restore_gc():
    was_on = gc.isenabled()
    yield
    gc.unfreeze()  # the frozen objects go back to the oldest generation for later tests
    (gc.enable if was_on else gc.disable)()


class Node:
    """A gc-tracked object that can sit in a reference cycle."""

    def __init__(self):
        self.me = self


def test_the_body_runs_without_the_collector_and_its_objects_are_frozen_after():
    gc.enable()
    frozen_before = gc.get_freeze_count()
    with collector_paused():
        assert not gc.isenabled()
        made = [Node() for _ in range(100)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen_before + len(made)
    young = {id(o) for o in gc.get_objects(generation=0)}
    assert not any(id(n) in young for n in made)


def test_an_error_in_the_body_still_restores_the_collector():
    gc.enable()
    with pytest.raises(RuntimeError, match="load failed"):
        with collector_paused():
            raise RuntimeError("load failed")
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_cycles_made_during_the_pause_are_kept_not_collected():
    """The documented cost: frozen garbage is never freed (gc.collect finds none of it)."""
    import weakref

    gc.enable()
    with collector_paused():
        ref = weakref.ref(Node())  # unreachable at once, but a cycle: only the collector frees it
    gc.collect()
    assert ref() is not None


def test_generate_and_chat_load_with_the_collector_off(monkeypatch):
    import localgen.service
    from localgen.api import LLM
    from localgen.cli import chat_cmd, generate_cmd

    gc.enable()
    seen = []
    monkeypatch.setattr(LLM, "load", classmethod(lambda cls, *a, **kw: seen.append(gc.isenabled())))
    generate_cmd.load_llm(None)
    assert gc.isenabled()
    monkeypatch.setattr(localgen.service, "EngineService", lambda load, **kw: load)
    chat_cmd.make_service(None)()
    assert gc.isenabled()
    assert seen == [False, False]
