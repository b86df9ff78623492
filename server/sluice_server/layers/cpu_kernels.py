"""The shard's own CPU kernels (C++, `sluice_server/csrc/`), built on first use.

torch's extension loader compiles the sources with the machine's C++ compiler
(`-march=native`: the build is for this CPU) into torch's extension cache
(`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions) and reuses the
build while the sources are unchanged: about 20 seconds once, then nothing.
The ops are registered with the dispatcher as `torch.ops.sluice_cpu.*`.

Without a compiler, or with SLUICE_CPU_KERNELS=0, `load()` returns False and
the callers keep their plain-torch path, which computes the same thing.

    paged_decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens, scale)
        float32 decode attention straight from the paged cache (cpu_attention.cpp)
    rms_norm(x, residual, weight, eps) -> (normed, sum); rotary_(q, k, cos, sin);
    silu_mul(x): the small ops of a layer, one pass each (cpu_ops.cpp), used by
        layers.ops.CpuOps
    quant_linear(x, blocks, format, out_features); dequantize(...): matmuls on
        GGUF's Q4_1 / Q8_0 blocks (cpu_quant_linear.cpp), see layers.gguf_weights
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCES = [CSRC / "cpu_attention.cpp", CSRC / "cpu_ops.cpp", CSRC / "cpu_quant_linear.cpp"]
OPS = ("paged_decode_attention", "rms_norm", "rotary_", "silu_mul", "quant_linear", "dequantize")
_lock = threading.Lock()
_state: dict[str, bool] = {}


def enabled_by_env() -> bool:
    return os.environ.get("SLUICE_CPU_KERNELS", "1") not in ("0", "false", "no")


def _put_ninja_on_path() -> None:
    """torch finds ninja on PATH; the pip-installed one lives in the virtual
    environment's bin folder, which is not on PATH when the launcher is run
    by its full path without activating the environment."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + (os.pathsep + path if path else "")


def load() -> bool:
    """Builds (or reuses) and loads the CPU kernels; True when they are usable."""
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        ok = False
        if not enabled_by_env():
            log.info("CPU kernels disabled by SLUICE_CPU_KERNELS")
        else:
            try:
                from torch.utils.cpp_extension import load as load_extension

                _put_ninja_on_path()
                load_extension(
                    name="sluice_cpu_ops",
                    sources=[str(p) for p in SOURCES],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    is_python_module=False,
                    verbose=False,
                )
                ok = all(hasattr(torch.ops.sluice_cpu, op) for op in OPS)
            except Exception as e:  # no compiler, no ninja, a build error
                log.warning("CPU kernels unavailable, using plain torch attention: %s", str(e).splitlines()[0])
        _state["ok"] = ok
        return ok


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> None:
    torch.ops.sluice_cpu.paged_decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens, scale)
