"""Kernel-test fixtures: a fresh random seed per test, the device to run on.

``TRITON_INTERPRET=1`` is set by the root conftest before anything imports Triton.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (set SPECINFER_TEST_SEED to replay one); tests put it in their failure messages."""
    fixed = os.environ.get("SPECINFER_TEST_SEED")
    return int(fixed) if fixed else random.SystemRandom().randrange(2**31)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")
