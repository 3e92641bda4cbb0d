"""The guard of the test modules that run compiled Triton kernels on a GPU: a CUDA device, Triton,
and no interpreter (``TRITON_INTERPRET=1``, which the CPU test modules turn on for their whole
process). Called at a module's import, before it imports the kernels."""
from __future__ import annotations

import os

import pytest
import torch


def require_compiled_triton() -> None:
    """Skip the calling module unless its kernels can run compiled on a CUDA GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU", allow_module_level=True)
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the Triton interpreter is on in this process: run this file on its own", allow_module_level=True)
    pytest.importorskip("triton")
