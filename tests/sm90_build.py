"""Builds a Triton kernel for sm_90 on a machine without a GPU (Triton's own ptxas) and reports
the bytes of stack its threads use: a register spill turns a kernel's tile into local-memory
traffic. The build runs in a child process, since the interpreter that the CPU tests use
replaces Triton's compiler in this one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_BUILD = """
import importlib, json, os, re, subprocess, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

spec = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
consts = {k: getattr(tl, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v
          for k, v in spec["consts"].items()}
sig = dict(spec["signature"], **{k: "constexpr" for k in consts})
attrs = {(i,): [["tt.divisibility", 16]] for i in spec["aligned"]}
kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=spec["num_warps"], **spec["options"]))
path = os.path.join(os.environ["OUT_DIR"], "k.cubin")
open(path, "wb").write(kernel.asm["cubin"])
tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
print("STACK", re.search(r"STACK:(\\d+)", usage).group(1))
"""


def stack_bytes(module: str, kernel: str, signature: dict, consts: dict, aligned: list[int],
                num_warps: int, tmp_path, num_stages: int | None = None) -> int:
    """Stack bytes a thread of ``module.kernel`` uses when built for sm_90 with ``signature``
    (argument name -> Triton type, in order), ``consts`` (constexpr values; a Triton dtype as
    ``"tl.bfloat16"``), the arguments at ``aligned`` positions 16-divisible, ``num_warps`` and
    ``num_stages`` (None: Triton's default).
    Skips the test where this Triton has no CUDA tools."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__),
                                       "backends/nvidia/bin/cuobjdump")):
        pytest.skip("this Triton has no CUDA tools")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OUT_DIR=str(tmp_path), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    spec = dict(module=module, kernel=kernel, signature=signature, consts=consts,
                aligned=aligned, num_warps=num_warps,
                options={} if num_stages is None else dict(num_stages=num_stages))
    out = subprocess.run([sys.executable, "-c", _BUILD, json.dumps(spec)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split("STACK", 1)[1].split()[0])
