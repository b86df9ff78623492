"""Kernel tests: Triton's interpreter on CPU unless a CUDA device is present.

TRITON_INTERPRET must be set before triton is first imported (triton.jit
reads it when a kernel is defined), so it is set here, at collection time,
before any test module imports the kernels. Other test folders of the same
pytest session do not use triton, so the variable does not change them.

Tests marked `gpu` are the larger set (many heads, long contexts, big
batches): too slow for the interpreter, so they are skipped without CUDA.
That skip is expected on CPU-only machines and in CI.

The C++ block matmuls have one kernel per instruction set (AVX-512 VNNI,
AVX-VNNI, AVX2, portable C++), each forced by the tests marked `isa(name)`;
a host runs those its CPU has. The run ends with a report of which paths
ran here, and fails when tests of the SIMD paths were selected but none of
them ran: a CI host that silently tested only the portable path would
otherwise pass without testing what serves.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# The kernels under test are the checkout's (kernels/sluice_kernels, beside
# this folder), installed or not.
_KERNELS = Path(__file__).resolve().parent.parent
if str(_KERNELS) not in sys.path:
    sys.path.insert(0, str(_KERNELS))

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: larger kernel cases, run only where CUDA is available")
    config.addinivalue_line("markers", "isa(name): a test of the CPU kernel for one instruction set")
    config.stash[_ISA_RUNS] = {}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (the interpreter would take too long)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# nodeid -> (isa name, "selected" | "passed" | "failed" | "skipped"), for
# the tests marked `isa` that the session runs.
_ISA_RUNS = pytest.StashKey[dict]()


def pytest_collection_finish(session):
    runs = session.config.stash[_ISA_RUNS]
    for item in session.items:  # after -k / -m deselection
        marker = item.get_closest_marker("isa")
        if marker is not None:
            runs[item.nodeid] = (marker.args[0], "selected")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    runs = item.config.stash[_ISA_RUNS]
    if item.nodeid in runs:
        name, outcome = runs[item.nodeid]
        if report.skipped or report.failed:
            runs[item.nodeid] = (name, report.outcome)
        elif report.when == "call" and outcome == "selected":
            runs[item.nodeid] = (name, "passed")
    return report


def _isa_counts(config) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for name, outcome in config.stash[_ISA_RUNS].values():
        counts.setdefault(name, {}).setdefault(outcome, 0)
        counts[name][outcome] += 1
    return counts


def _no_fast_path_ran(config) -> bool:
    """SIMD-path tests were selected, and not one of them passed."""
    from sluice_kernels.cpu_kernels import FAST_ISAS, ISA_NAMES

    counts = _isa_counts(config)
    fast = [ISA_NAMES[code] for code in FAST_ISAS if ISA_NAMES[code] in counts]
    return bool(fast) and not any(counts[name].get("passed") for name in fast)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    if _no_fast_path_ran(session.config) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Which CPU kernel paths this host ran (the block matmuls' kernel per
    instruction set; decode attention and the small ops are compiled for the
    host, -march=native, and use AVX-512 where the CPU has it)."""
    from sluice_kernels import cpu_kernels
    from sluice_kernels.cpu_matmuls import cpu_flags

    counts = _isa_counts(config)
    if not counts:
        return
    terminalreporter.section("CPU kernel paths on this host")
    for code in sorted(cpu_kernels.ISA_NAMES, reverse=True):
        name = cpu_kernels.ISA_NAMES[code]
        outcomes = counts.get(name, {})
        ran = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items())) or "not selected"
        terminalreporter.write_line(f"block matmuls, {name}: {ran}")
    avx512 = "AVX-512" if "avx512f" in cpu_flags() else "no AVX-512 (AVX2 or portable C++)"
    terminalreporter.write_line(f"decode attention and small ops: compiled for this host, {avx512}")
    if not cpu_kernels.loaded():
        terminalreporter.write_line(f"the CPU kernels did not load: {cpu_kernels.unavailable_reason()}")
    if _no_fast_path_ran(config):
        terminalreporter.write_line(
            "FAILED: no SIMD path of the CPU kernels ran on this host (see above)", red=True, bold=True
        )
