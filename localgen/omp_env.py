"""How long the OpenMP runtime's idle threads spin before they sleep, set before torch loads it.

torch's CPU operators and localgen's C kernels (``kernels/csrc``, built with ``-fopenmp``) share
one libgomp, which reads ``GOMP_SPINCOUNT`` once, when it loads. A CPU decode step runs a
hundred or more short parallel regions with a little Python between them. With libgomp's default
of 300000 spins a worker thread often falls asleep in those gaps, and waking it again costs more
than the region's work on a virtual machine's CPUs. Ten times that keeps the workers awake
through a step and lets them sleep a few milliseconds after it ends. ``docs/benchmarks.md``
gives the measured effect. A value the user set is left alone. Setting it has no effect when
torch was imported before localgen.
"""

from __future__ import annotations

import os

GOMP_SPINCOUNT = "3000000"
_SET_HERE = "GOMP_SPINCOUNT" not in os.environ
if _SET_HERE:
    os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT


def peer_environ() -> dict[str, str]:
    """The environment as the user gave it, without the spin count set here: what the
    benchmarks' peers (llama.cpp's tools, which use libgomp too) run with, their defaults."""
    env = dict(os.environ)
    if _SET_HERE and env.get("GOMP_SPINCOUNT") == GOMP_SPINCOUNT:
        del env["GOMP_SPINCOUNT"]
    return env
