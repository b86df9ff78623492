"""Kernel tests: Triton's interpreter on CPU unless a CUDA device is present.

TRITON_INTERPRET must be set before triton is first imported (triton.jit
reads it when a kernel is defined), so it is set here, at collection time,
before any test module imports the kernels. Other test folders of the same
pytest session do not use triton, so the variable does not change them.

Tests marked `gpu` are the larger set (many heads, long contexts, big
batches): too slow for the interpreter, so they are skipped without CUDA.
That skip is expected on CPU-only machines and in CI.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# The kernels live in the server package beside this folder; make it
# importable from a plain checkout.
_SERVER = Path(__file__).resolve().parent.parent
if str(_SERVER) not in sys.path:
    sys.path.insert(0, str(_SERVER))

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: larger kernel cases, run only where CUDA is available")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (the interpreter would take too long)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
