"""The CPU kernels (C++, `csrc/` beside this file), built on first use.

torch's extension loader compiles the sources with the machine's C++ compiler
(`-march=native`: the build is for this CPU) into torch's extension cache
(`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions) and reuses the
build while the sources are unchanged: about 20 seconds once, then nothing.
The ops are registered with the dispatcher as `torch.ops.sluice_cpu.*`.

`load()` returns False, and the callers keep their plain-torch path (which
computes the same thing), only where the kernels cannot be built at all: no
C++ compiler (`$CXX`, default `c++`) or no ninja; `unavailable_reason()`
says which. Where a compiler exists, a build that fails raises `BuildError`:
a broken kernel must stop the shard (and fail the tests), not quietly turn
into the slower fallback. Whether to load them at all is the caller's
decision (the shard's `--cpu-kernels`); this module reads no setting.

    paged_decode_attention(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window, sinks)
        float32 decode attention straight from the paged cache (float32 or
        bfloat16), optionally over a sliding window and with attention sinks
        (cpu_attention.cpp)
    prefill_attention(out, q, k, v, scale): causal float32 attention of a
        prompt's new tokens over its keys, cached ones included, kv heads
        shared by G query heads (cpu_attention.cpp)
    rms_norm(x, residual, weight, eps) -> (normed, sum); rotary_(q, k, cos, sin);
    silu_mul(x): the small ops of a layer, one pass each (cpu_ops.cpp), used by
        ops.CpuOps
    argmax_rows(x) -> (max, index): torch.max(x, -1) for greedy sampling
        (cpu_ops.cpp), used by sampling once the kernels are loaded
    q8_pack(sw, cw, wq, layout); q8_linear(x, packed, layout, out_features, isa=0);
        exact_linear(...): matmuls on GGUF blocks of many types (unpacked by
        gguf_blocks), with int8 activations or expanded to float32
        (cpu_q8_linear.cpp), each call on the best instruction set this CPU
        has (`isa_path()` names it)
    block_rows(packed, format, out_features, ids): rows of such a weight,
        expanded to float32 (an embedding lookup on the blocks, cpu_q8_linear.cpp)
    q8_dot_peak(iterations): the host's int8 dot-product rate (op/s, all
        threads) the block matmuls are made of, for benchmarks/step_bench.py
    moe_block_mlp(x, ids, weights, w13, format13, w2, format2, intermediate, b13, b2,
        activation, alpha, limit, int8): a mixture-of-experts layer's expert MLP
        on every expert's blocks, tokens grouped by expert (cpu_moe.cpp, over
        cpu_q8_linear.cpp's grouped_block_linear), see moe.py
    lora_apply_(y, x, a, b, bounds, seg_starts, seg_ends, seg_slots, ranks, scales):
        LoRA's grouped matmul, each row's adapter update added to y
        (cpu_lora.cpp; layout and reference in sluice_kernels.lora)
    torch.classes.sluice_cpu.LlamaDecoder: a decode step through every layer
        in one call (cpu_decoder.cpp), driven by the Llama model's
        `sluice_server.models.llama_cpu_decoder`
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
NAME = "sluice_cpu_ops"  # the build's folder under TORCH_EXTENSIONS_DIR
SOURCES = [
    CSRC / "cpu_attention.cpp",
    CSRC / "cpu_ops.cpp",
    CSRC / "cpu_q8_linear.cpp",
    CSRC / "cpu_decoder.cpp",
    CSRC / "cpu_moe.cpp",
    CSRC / "cpu_lora.cpp",
]
HEADERS = [CSRC / "sluice_cpu.h"]
OPS = (
    "paged_decode_attention", "prefill_attention", "rms_norm", "rotary_", "silu_mul", "argmax_rows",
    "q8_pack", "q8_linear", "exact_linear", "q8_quantize", "q8_isas", "block_rows", "moe_block_mlp", "lora_apply_",
    "lora_bf16_products", "q8_dot_peak",
)
_lock = threading.Lock()
# "ok": the outcome of the first load(); "reason": why the kernels are off;
# "error": the BuildError of a failed build, raised again by every call.
_state: dict = {}


class BuildError(RuntimeError):
    """A C++ compiler is there, but the kernels did not build or load."""


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


def missing_toolchain() -> str | None:
    """Why this machine cannot build the kernels at all, or None when it can."""
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")  # what torch's extension builder runs
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH (Debian: apt-get install g++)"
    _put_ninja_on_path()
    if not is_ninja_available():
        return "ninja is missing (pip install ninja)"
    return None


def build_folder_name() -> str:
    """NAME plus a hash of where the sources are: one build folder per source
    location. ninja rebuilds when a source's path changes, so an installed
    package and a checkout (the tests start shards from both), or two
    checkouts, sharing one folder would rebuild each other's build at every
    switch, each start waiting minutes on the other's lock."""
    import hashlib

    return f"{NAME}_{hashlib.sha256(str(CSRC).encode()).hexdigest()[:10]}"


def unavailable_reason() -> str | None:
    """After load(): why the kernels are off, or None when they are loaded."""
    return _state.get("reason")


def loaded() -> bool:
    """True once load() succeeded; never builds (for callers that only use
    the kernels where the shard already loaded them)."""
    return _state.get("ok", False)


# The instruction-set paths of the block matmuls (cpu_q8_linear.cpp's isa
# codes; 0 asks for the best this CPU has). "portable" is plain C++ that any
# CPU runs.
ISA_NAMES = {4: "avx512_vnni", 3: "avx_vnni", 2: "avx2", 1: "portable"}
FAST_ISAS = (4, 3, 2)


def host_isas() -> list[int]:
    """The isa codes this CPU runs, best first (needs the kernels loaded)."""
    return list(torch.ops.sluice_cpu.q8_isas())


def isa_path() -> str:
    """The path the block matmuls take on this CPU (a name of ISA_NAMES), or
    "none" when the kernels are not loaded. Decode attention and the small
    ops are compiled for the host (-march=native): AVX-512 where it has it."""
    return ISA_NAMES[host_isas()[0]] if loaded() else "none"


def load() -> bool:
    """Builds (or reuses) and loads the CPU kernels. True when they are usable;
    False when they are switched off or cannot be built here (see
    unavailable_reason()). Raises BuildError when the build fails although a
    compiler exists."""
    with _lock:
        if "error" in _state:
            raise _state["error"]
        if "ok" in _state:
            return _state["ok"]
        reason = missing_toolchain()
        if reason is not None:
            log.warning("CPU kernels off, using plain torch: %s", reason)
            _state.update(ok=False, reason=reason)
            return False
        try:
            _build()
        except Exception as e:
            error = BuildError(
                f"the CPU kernels ({', '.join(p.name for p in SOURCES)}) failed to build or load: {e}\n"
                "--cpu-kernels off serves without them, on plain torch"
            )
            _state["error"] = error
            raise error from e
        log.info("CPU kernels loaded: %s", ", ".join(OPS))
        _state["ok"] = True
        return True


def _headers_hash() -> str:
    import hashlib

    digest = hashlib.sha256()
    for header in HEADERS:
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


def _build() -> None:
    from torch.utils.cpp_extension import load as load_extension

    load_extension(
        name=build_folder_name(),
        sources=[str(p) for p in SOURCES],
        # torch rebuilds when a source or a flag changes; the headers' hash in
        # a flag makes it rebuild when only a header changed.
        extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DSLUICE_HEADERS_HASH={_headers_hash()}"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    missing = [op for op in OPS if not hasattr(torch.ops.sluice_cpu, op)]
    if not hasattr(torch.classes.sluice_cpu, "LlamaDecoder"):
        missing.append("LlamaDecoder")
    if missing:
        raise RuntimeError(f"ops not registered: {', '.join(missing)}")


def prefill_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
    """out[t] = causal softmax attention of q[t] over k[:S - T + t + 1], v[...]:
    the T new tokens of a sequence of S (S - T cached before them). q, out
    [T, Hq, D] with contiguous heads, k, v [S, Hkv, D] with contiguous rows;
    float32."""
    torch.ops.sluice_cpu.prefill_attention(out, q, k, v, scale)


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """`window` (None: the whole context): each sequence attends to its last `window` keys;
    `sinks` (None, or [Hq]): each query head's sink logit (gpt-oss)."""
    if sinks is not None:
        sinks = sinks.float().contiguous()
    torch.ops.sluice_cpu.paged_decode_attention(
        out, q, k_cache, v_cache, block_tables, seq_lens, scale, window or 0, sinks
    )
