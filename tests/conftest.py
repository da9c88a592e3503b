"""Fixtures shared by the test modules."""

import random

import pytest
import torch


@pytest.fixture
def seed():
    """A fresh torch seed each run, returned so a failing test can report it: kernel tests draw
    new inputs every time instead of passing on one lucky draw."""
    s = random.randrange(1 << 31)
    torch.manual_seed(s)
    return s


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
