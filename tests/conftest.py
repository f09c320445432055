"""Test setup: Triton runs under its CPU interpreter when no GPU is present.

TRITON_INTERPRET must be set before triton is first imported, hence at conftest import time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


TRITON = _triton_available()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

requires_triton = pytest.mark.skipif(not TRITON, reason="triton is not installed")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
