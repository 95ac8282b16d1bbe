"""Op tests: Triton kernels (through the interpreter on CPU, natively on CUDA)
and the CPU plain-torch implementations.

``TRITON_INTERPRET=1`` must be in the environment before Triton is imported,
so it is set here (when no GPU is present) before any test module imports a
kernel.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


from invariance import Inv  # noqa: E402


@pytest.fixture
def inv() -> type[Inv]:
    return Inv


@pytest.fixture
def device() -> str:
    """Where the Triton kernels run: CUDA natively, else CPU through the interpreter."""
    from unified_models.ops.triton._common import INTERPRET

    if torch.cuda.is_available() and not INTERPRET:
        return "cuda"
    if not INTERPRET:
        pytest.fail("TRITON_INTERPRET=1 must be set before triton is imported to run kernels on CPU")
    return "cpu"


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
