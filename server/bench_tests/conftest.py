"""Tests of sluice-bench (server/sluice_bench): the load generator against
fake OpenAI-compatible servers and tokenizers (`_bench_fakes`), and the
benchmarks/ scripts built on it. No model, no torch."""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import sluice_bench  # noqa: F401 - installed (pip install .)
except ImportError:  # a source checkout: test the tree this file is in
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
