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
