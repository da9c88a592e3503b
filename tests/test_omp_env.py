"""localgen sets libgomp's spin count at import unless the user did, and hands the benchmarks'
peers the environment without the value it set."""

import json
import os
import subprocess
import sys

import pytest

PROBE = ("import json, os, localgen; from localgen.omp_env import peer_environ; "
         "print(json.dumps([os.environ.get('GOMP_SPINCOUNT'), peer_environ().get('GOMP_SPINCOUNT')]))")


@pytest.mark.parametrize("given,want", [(None, ["3000000", None]), ("12", ["12", "12"])])
def test_spin_count_set_unless_given_and_peers_keep_their_default(given, want):
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if given is not None:
        env["GOMP_SPINCOUNT"] = given
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert json.loads(out) == want
