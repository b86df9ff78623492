"""The report of which CPU kernel paths ran (conftest.py) fails a run in
which the SIMD paths' tests were selected but none of them ran: here a
pytest run of one block-matmul test on a host made to look portable-only
(host_isas patched before the tests are collected), in a child process, must
print the report with every SIMD path skipped and exit with a failure.
(The passing case is every kernel test run on a host with a SIMD path.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice_kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the CPU kernels did not build")

TESTS = Path(__file__).resolve().parent


def run_one_block_matmul_test(tmp_path: Path, plugin: str) -> subprocess.CompletedProcess:
    (tmp_path / "host_plugin.py").write_text(plugin)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "host_plugin",
         str(TESTS / "test_cpu_q8_linear.py"), "-k", "a_layer_of_mixed_types"],
        cwd=TESTS.parent, env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True, text=True, timeout=600,
    )


def test_a_host_without_simd_paths_fails_the_run(tmp_path):
    out = run_one_block_matmul_test(
        tmp_path, "from sluice_kernels import cpu_kernels\ncpu_kernels.host_isas = lambda: [1]\n"
    )
    report = out.stdout + out.stderr
    assert "CPU kernel paths on this host" in report, report
    for name in ("avx512_vnni", "avx_vnni", "avx2"):
        assert f"block matmuls, {name}: 1 skipped" in report, report
    assert "block matmuls, portable: 1 passed" in report, report
    assert "FAILED: no SIMD path of the CPU kernels ran on this host" in report, report
    assert out.returncode == pytest.ExitCode.TESTS_FAILED, report

