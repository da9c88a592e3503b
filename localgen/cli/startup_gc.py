"""The cyclic garbage collector paused while a command imports the runtime and loads its model.

Importing torch and transformers and building the model create a few hundred thousand objects
that live as long as the process. The collector counts allocations, so on the way it starts
hundreds of young collections and several full ones, each walking every object made so far,
and finds next to nothing: the cycles those imports leave are a few thousand small objects
(functions, tuples, a traceback's frames). `collector_paused` skips that work and then moves the
survivors out of every later collection (``gc.freeze``, Python's `gc` module documentation).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the body with the cyclic collector off (for every thread: it is one per process),
    then freeze every object then alive into the permanent generation and turn the collector
    back on if it was on. Later collections walk only objects made after the body, so a chat's
    or a server's steps no longer pay for torch's. The unreachable cycles the body left stay
    allocated for the life of the process (frozen objects are never collected)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_on:
            gc.enable()
