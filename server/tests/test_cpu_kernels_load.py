"""cpu_kernels.load(): the plain-torch fallback is taken only where the
kernels cannot be built at all; a compile error where a compiler exists is an
error, never a quiet fallback."""

from __future__ import annotations

import shutil

import pytest

from sluice_kernels import cpu_kernels


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """load() as in a new process, building (if at all) into tmp_path."""
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.delenv("SLUICE_CPU_KERNELS", raising=False)
    return tmp_path


def test_no_compiler_falls_back_and_says_why(fresh, monkeypatch):
    monkeypatch.setenv("CXX", str(fresh / "no-such-compiler"))
    assert cpu_kernels.load() is False
    assert "no C++ compiler" in cpu_kernels.unavailable_reason()
    assert "no-such-compiler" in cpu_kernels.unavailable_reason()


def test_switched_off_by_environment(fresh, monkeypatch):
    monkeypatch.setenv("SLUICE_CPU_KERNELS", "0")
    assert cpu_kernels.load() is False
    assert "SLUICE_CPU_KERNELS" in cpu_kernels.unavailable_reason()


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (scripts/install.sh installs g++)")
def test_compile_error_raises_every_time(fresh, monkeypatch):
    broken = fresh / "broken.cpp"
    broken.write_text("int kernel( { return 0; }\n")  # fails at once, no headers to parse
    monkeypatch.setattr(cpu_kernels, "SOURCES", [broken])
    monkeypatch.setattr(cpu_kernels, "NAME", "sluice_cpu_ops_broken_test")
    with pytest.raises(cpu_kernels.BuildError, match="broken.cpp") as first:
        cpu_kernels.load()
    assert "SLUICE_CPU_KERNELS=0" in str(first.value)
    # Cached: a second caller gets the same error, not a silent False.
    with pytest.raises(cpu_kernels.BuildError):
        cpu_kernels.load()
    assert cpu_kernels.unavailable_reason() is None
