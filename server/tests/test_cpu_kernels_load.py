"""cpu_kernels.load(): the plain-torch fallback is taken only where the
kernels cannot be built at all; a compile error where a compiler exists is an
error, never a quiet fallback. And the shard's --cpu-kernels: auto takes that
fallback, on refuses to start without the kernels, off never loads them."""

from __future__ import annotations

import shutil

import pytest

import torch

from sluice_kernels import cpu_kernels
from sluice_server.model_runner import CpuKernelsUnavailable, use_cpu_kernels
from sluice_server.options import ShardOptions


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """load() as in a new process, building (if at all) into tmp_path."""
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    return tmp_path


def test_no_compiler_falls_back_and_says_why(fresh, monkeypatch):
    monkeypatch.setenv("CXX", str(fresh / "no-such-compiler"))
    assert cpu_kernels.load() is False
    assert "no C++ compiler" in cpu_kernels.unavailable_reason()
    assert "no-such-compiler" in cpu_kernels.unavailable_reason()


def test_cpu_kernels_flag_without_a_compiler(fresh, monkeypatch):
    monkeypatch.setenv("CXX", str(fresh / "no-such-compiler"))
    cpu = torch.device("cpu")
    assert use_cpu_kernels("off", cpu) is False
    assert cpu_kernels.unavailable_reason() is None, "off: the kernels are not even looked for"
    assert use_cpu_kernels("auto", cpu) is False
    with pytest.raises(CpuKernelsUnavailable, match="--cpu-kernels on: .*no C\\+\\+ compiler"):
        use_cpu_kernels("on", cpu)
    assert use_cpu_kernels("on", torch.device("cuda")) is False, "a CUDA shard runs no C++ CPU kernels"


def test_shard_options_name_the_bad_flag():
    with pytest.raises(ValueError, match="--cpu-kernels 'yes' is not one of auto, on, off"):
        ShardOptions(cpu_kernels="yes")
    with pytest.raises(ValueError, match="--kv-cache-dtype 'fp8' is not one of auto, float32, bfloat16"):
        ShardOptions(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="--cpu-block-rows must be >= 0, got -1"):
        ShardOptions(cpu_block_rows=-1)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (scripts/install.sh installs g++)")
def test_compile_error_raises_every_time(fresh, monkeypatch):
    broken = fresh / "broken.cpp"
    broken.write_text("int kernel( { return 0; }\n")  # fails at once, no headers to parse
    monkeypatch.setattr(cpu_kernels, "SOURCES", [broken])
    monkeypatch.setattr(cpu_kernels, "NAME", "sluice_cpu_ops_broken_test")
    with pytest.raises(cpu_kernels.BuildError, match="broken.cpp") as first:
        cpu_kernels.load()
    assert "--cpu-kernels off" in str(first.value)
    # Cached: a second caller gets the same error, not a silent False.
    with pytest.raises(cpu_kernels.BuildError):
        cpu_kernels.load()
    assert cpu_kernels.unavailable_reason() is None
