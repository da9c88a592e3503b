"""Fixtures shared by the test modules.

Without a CUDA device the Triton kernels run under the Triton interpreter (on CPU tensors):
``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here, before any test module
imports triton. On a CUDA machine it is left as the caller set it, so the same tests run the
compiled kernels there (on the tensors that ``kernel_device`` puts on the GPU).
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

KERNEL_DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


@pytest.fixture
def seed():
    """A fresh torch seed each run, returned so a failing test can report it: kernel tests draw
    new inputs every time instead of passing on one lucky draw."""
    s = random.randrange(1 << 31)
    torch.manual_seed(s)
    return s


@pytest.fixture
def kernel_device():
    """Torch factory calls in the test default to the device the Triton kernels run on: the GPU
    when they are compiled, the CPU under the interpreter. Returns that device."""
    with KERNEL_DEVICE:
        yield KERNEL_DEVICE


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """Converted tokenizers go to a folder of this session, not the user's cache."""
    import os

    if "LOCALGEN_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["LOCALGEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("localgen_cache"))
    yield
    os.environ.pop("LOCALGEN_CACHE_DIR", None)
