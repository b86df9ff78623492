"""LoRA's grouped (segment) matmul: every row of a step gets the low-rank
update of its own adapter, all adapters in one call.

A layer's adapters are stacked by slot; a layer that fuses several matrices
(q/k/v, gate/up) has one A per piece and one B whose rows are the pieces'
outputs, each reading its own piece of the shrunk row:

    a       [S, P, R, IN]   S slots, P pieces, R the stacks' rank
    b       [S, OUT, R]     rows [bounds[p], bounds[p+1]) belong to piece p
    ranks   [S, P] int32    slot s's rank on piece p; 0: s leaves p alone
    scales  [S] float32     lora_alpha / r (or / sqrt(r))

The step's rows come grouped by slot; segment g is rows
[seg_starts[g], seg_ends[g]) on slot seg_slots[g], and rows in no segment
(the base model's) are left alone:

    rows       0  1  2  3  4  5  6  7
    segments      [1, 3) s2   [4, 8) s0

For each segment, r = ranks[s, p], and each of its rows t:

    shrink   h[p] = A[s, p, :r] x[t]                         (r numbers per piece)
    expand   y[t, bounds[p]:bounds[p+1]] += scales[s] * (B[s, rows of p, :r] h[p])

in PEFT's order (the update, then the scale). Implementations:

    lora_apply_reference   plain torch, a loop over segments and pieces
    lora_apply_cpu         csrc/cpu_lora.cpp: one call, spread over the
                           threads by (segment, rows) or by (segment, piece,
                           chunk of inputs) then (segment, block of 64
                           outputs); x, y and the sums float32, the stacks
                           float32 or bfloat16 (below), packed by
                           `lora_pack_cpu`
    triton.lora            lora_apply_triton: a shrink and an expand kernel,
                           one program per (segment, row tile, piece or
                           output tile)

The C++ kernel reads the stacks in its own layout, written once when an
adapter is loaded (`lora_pack_cpu` for whole stacks, `lora_write_cpu_` for
one slot's piece), so that both of its phases stream them front to back:

    a  [S, P, RP/16, IN, 16]   panel j: ranks 16j .. 16j+15 of every input,
                               a[s, p, j, i, l] = A[s, p, 16j + l, i]
                               (RP: R rounded up to 16, zeros past R)
    b  [S, NB, R, 64]          block n: outputs 64n .. 64n+63 of every rank,
                               b[s, n, k, o] = B[s, 64n + o, k]
                               (NB = ceil(OUT / 64), zeros past OUT)

bfloat16 stacks hold the same shapes with each panel's and block's two
last dimensions in pairs (`to_pairs`): a panel [IN, 16] as [IN/2, 16, 2]
(inputs 2i and 2i+1 of rank l side by side), a block [R, 64] as
[R/2, 64, 2] (ranks 2k and 2k+1 of output o), the operand layout of
AVX512-BF16's pair dot product, so IN and R must be even. Where the CPU has
that instruction the kernel multiplies in bfloat16 pairs (x and h rounded
to bfloat16, every sum float32: `cpu_bfloat16_products`); elsewhere it
widens each pair exactly and multiplies in float32, as for float32 stacks.

`check_lora_args` is the one validator of a call, for every
implementation's layout: lora_apply_cpu and lora_apply_triton call it (the
C++ kernel itself checks nothing). Callers that make many calls a step
split it instead: the C++ decoder's Python side and the model's layers
(sluice_server.layers.lora) check their stacks with `lora_dims` when they
make or take them, the step's segments with `check_segments` once per
step, and each call's rows with `check_rows` (a few attribute reads, where
check_lora_args reads the index tensors' values every call: 70 us, 8 ms
over the 120 calls of a step of the bundled model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LANES = 16  # ranks per panel of the packed A
OUT_BLOCK = 64  # outputs per block of the packed B
# The element types of the C++ kernel's stacks (x, y and its sums are float32).
PACKED_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class LoraDims:
    slots: int  # S
    pieces: int  # P
    rank: int  # R, the stacks' rank
    in_features: int  # IN
    out_features: int  # OUT


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def lora_dims(a: torch.Tensor, b: torch.Tensor, packed: bool, out_features: int | None = None) -> LoraDims:
    """The stacks' dimensions, checking their layout: the module's `a`/`b`
    ([S, P, R, IN] and [S, OUT, R], any float dtype, a's) or, `packed`, the
    C++ kernel's (float32 or bfloat16, a's; `out_features` is then needed:
    blocks pad it)."""
    _need(a.is_contiguous() and b.is_contiguous(), "a and b must be contiguous")
    if not packed:
        _need(a.dim() == 4 and b.dim() == 3, "a must be [S, P, R, IN] and b [S, OUT, R]")
        S, P, R, IN = a.shape
        _need(b.shape[0] == S and b.shape[2] == R, "b must be [S, OUT, R] with a's S and R")
        _need(a.dtype == b.dtype and a.dtype.is_floating_point, "a and b must share one float dtype")
        return LoraDims(S, P, R, IN, b.shape[1])
    _need(a.dim() == 5 and a.shape[4] == LANES and b.dim() == 4 and b.shape[3] == OUT_BLOCK,
          f"packed a must be [S, P, RP/{LANES}, IN, {LANES}] and b [S, NB, R, {OUT_BLOCK}] (lora_pack_cpu)")
    _need(a.dtype == b.dtype and a.dtype in PACKED_DTYPES, "packed a and b must share one dtype, float32 or bfloat16")
    S, P, panels, IN = a.shape[:4]
    R = b.shape[2]
    _need(out_features is not None and b.shape[0] == S and b.shape[1] == -(-out_features // OUT_BLOCK)
          and panels == -(-R // LANES), "packed b must be [S, ceil(OUT / 64), R, 64] with a's S and R")
    if a.dtype == torch.bfloat16:
        _check_pairs(R, IN)
    return LoraDims(S, P, R, IN, out_features)


def _check_pairs(rank: int, in_features: int) -> None:
    _need(rank % 2 == 0 and in_features % 2 == 0,
          f"bfloat16 stacks hold pairs: their rank ({rank}) and input size ({in_features}) must be even")


def check_segments(seg_starts: torch.Tensor, seg_ends: torch.Tensor, seg_slots: torch.Tensor, rows: int,
                   slots: int) -> None:
    """Segments are int32 [G] each, inside the `rows` rows, on slots below
    `slots`. Their values are read only on the CPU (not to wait for a GPU)."""
    for t, name in ((seg_starts, "seg_starts"), (seg_ends, "seg_ends"), (seg_slots, "seg_slots")):
        _need(t.dtype == torch.int32 and t.is_contiguous(), f"{name} must be a contiguous int32 tensor")
    _need(seg_starts.numel() == seg_ends.numel() == seg_slots.numel(), "one start, end and slot per segment")
    if seg_starts.device.type != "cpu":
        return
    for g, (start, end, slot) in enumerate(zip(seg_starts.tolist(), seg_ends.tolist(), seg_slots.tolist())):
        _need(0 <= start <= end <= rows, f"segment {g} [{start}, {end}) is not inside the {rows} rows")
        _need(0 <= slot < slots, f"segment {g}: slot {slot} is not below {slots}")


def check_rows(y: torch.Tensor, x: torch.Tensor, dims: LoraDims, rows: int, packed: bool) -> None:
    """x [rows, IN] and y [rows, OUT] with contiguous rows on the stacks
    `dims` describes (float32 for the C++ kernel's `packed` stacks)."""
    _need(x.dim() == 2 and y.dim() == 2 and x.stride(1) == 1 and y.stride(1) == 1
          and tuple(x.shape) == (rows, dims.in_features) and tuple(y.shape) == (rows, dims.out_features),
          f"x must be [{rows}, {dims.in_features}] and y [{rows}, {dims.out_features}] with contiguous rows")
    if packed:
        _need(x.dtype == torch.float32 and y.dtype == torch.float32, "x and y must be float32")


def check_lora_args(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_ends: torch.Tensor,
    seg_slots: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    packed: bool,
) -> LoraDims:
    """ValueError naming the first thing a call's arguments get wrong
    (the module docstring has the layout; `packed`: the C++ kernel's);
    else their dimensions. Tensors' values are read only on the CPU."""
    _need(y.dim() == 2 and x.dim() == 2 and y.stride(1) == 1 and x.stride(1) == 1,
          "x and y must be [T, IN] and [T, OUT] with contiguous rows")
    d = lora_dims(a, b, packed, y.shape[1])
    _need(x.shape[1] == d.in_features and tuple(y.shape) == (x.shape[0], d.out_features),
          f"x must be [T, {d.in_features}] and y [T, {d.out_features}] with one T")
    if packed:
        _need(x.dtype == torch.float32 and y.dtype == torch.float32, "x and y must be float32")
    devices = {t.device for t in (y, x, a, b, bounds, seg_starts, seg_ends, seg_slots, ranks, scales)}
    _need(len(devices) == 1, f"every tensor must be on one device, not {', '.join(map(str, devices))}")
    for t, name in ((bounds, "bounds"), (ranks, "ranks")):
        _need(t.dtype == torch.int32 and t.is_contiguous(), f"{name} must be a contiguous int32 tensor")
    _need(bounds.numel() == d.pieces + 1, f"bounds must hold P + 1 = {d.pieces + 1} row boundaries")
    _need(ranks.numel() == d.slots * d.pieces, "ranks must be [S, P]")
    _need(scales.dtype == torch.float32 and scales.is_contiguous() and scales.numel() == d.slots,
          "scales must be float32 [S]")
    check_segments(seg_starts, seg_ends, seg_slots, x.shape[0], d.slots)
    if bounds.device.type == "cpu":
        edges = bounds.tolist()
        _need(edges[0] == 0 and edges[-1] == d.out_features, "bounds must run from 0 to OUT")
        _need(all(lo <= hi for lo, hi in zip(edges, edges[1:])), "bounds must not decrease")
        _need(all(0 <= r <= d.rank for r in ranks.flatten().tolist()), f"ranks must be in [0, R = {d.rank}]")
    return d


def to_pairs(t: torch.Tensor) -> torch.Tensor:
    """[..., N, L] -> the same shape with the last two dimensions in pairs
    along N: element (n, l) moves to flat position (n // 2) * 2L + 2l + n % 2
    of its [N, L] (N even). The layout of bfloat16 stacks (module docstring)."""
    *lead, n, lanes = t.shape
    return t.reshape(*lead, n // 2, 2, lanes).transpose(-1, -2).reshape(*lead, n, lanes)


def from_pairs(t: torch.Tensor) -> torch.Tensor:
    """The inverse of to_pairs."""
    *lead, n, lanes = t.shape
    return t.reshape(*lead, n // 2, lanes, 2).transpose(-1, -2).reshape(*lead, n, lanes)


def cpu_bfloat16_products() -> bool:
    """Whether the C++ kernel multiplies bfloat16 stacks in bfloat16 pairs
    (this CPU has AVX512-BF16) rather than widened to float32; needs the
    CPU kernels loaded."""
    return bool(torch.ops.sluice_cpu.lora_bf16_products())


def lora_pack_cpu(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacks a [S, P, R, IN], b [S, OUT, R] in the C++ kernel's layout
    (module docstring), as `dtype` (float32 or bfloat16: rounded to nearest,
    in pairs)."""
    _need(dtype in PACKED_DTYPES, f"packed stacks are float32 or bfloat16, not {dtype}")
    S, P, R, IN = a.shape
    OUT = b.shape[1]
    panels = -(-R // LANES)
    a_pad = torch.zeros(S, P, panels * LANES, IN, dtype=dtype, device=a.device)
    a_pad[:, :, :R] = a
    a_packed = a_pad.view(S, P, panels, LANES, IN).transpose(3, 4).contiguous()
    blocks = -(-OUT // OUT_BLOCK)
    b_pad = torch.zeros(S, blocks * OUT_BLOCK, R, dtype=dtype, device=b.device)
    b_pad[:, :OUT] = b
    b_packed = b_pad.view(S, blocks, OUT_BLOCK, R).transpose(2, 3).contiguous()
    if dtype == torch.bfloat16:
        _check_pairs(R, IN)
        a_packed, b_packed = to_pairs(a_packed).contiguous(), to_pairs(b_packed).contiguous()
    return a_packed, b_packed


def lora_write_cpu_(a_packed: torch.Tensor, b_packed: torch.Tensor, slot: int, piece: int, first_out: int,
                    a: torch.Tensor, b: torch.Tensor) -> None:
    """Writes one piece's A [r, IN] and B [out, r] (its outputs from
    `first_out` on) into slot `slot` of packed stacks, in place (rounded to
    the stacks' dtype); ranks past r keep what they hold (zeros in an
    emptied slot)."""
    r = a.shape[0]
    _need(r <= b_packed.shape[2], f"rank {r} is above the stacks' {b_packed.shape[2]}")
    paired = a_packed.dtype == torch.bfloat16
    panels = -(-r // LANES)
    a_pad = torch.zeros(panels * LANES, a.shape[1], dtype=a_packed.dtype)
    a_pad[:r] = a
    a_panels = a_pad.view(panels, LANES, a.shape[1]).transpose(1, 2)
    a_packed[slot, piece, :panels].copy_(to_pairs(a_panels) if paired else a_panels)
    outs = torch.arange(first_out, first_out + b.shape[0], device=b_packed.device)
    if not paired:
        b_packed[slot, outs // OUT_BLOCK, :r, outs % OUT_BLOCK] = b.to(b_packed.device, b_packed.dtype)
        return
    blocks = from_pairs(b_packed[slot])
    blocks[outs // OUT_BLOCK, :r, outs % OUT_BLOCK] = b.to(b_packed.device, b_packed.dtype)
    b_packed[slot].copy_(to_pairs(blocks))


def lora_apply_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: list[int],
    seg_starts: list[int],
    seg_ends: list[int],
    seg_slots: list[int],
    ranks: list[list[int]],
    scales: torch.Tensor,
    products: torch.dtype | None = None,
) -> None:
    """y += each row's adapter update (module docstring), in place.
    Segments and ranks as Python lists; the rest as the kernels take them.
    `products`: x and h rounded to this dtype before they are multiplied
    (bfloat16, as the C++ kernel's pair dot products do)."""

    def operand(t: torch.Tensor) -> torch.Tensor:
        return t if products is None else t.to(products).to(a.dtype)

    for start, end, s in zip(seg_starts, seg_ends, seg_slots):
        rows = operand(x[start:end].to(a.dtype))
        for p in range(a.shape[1]):
            r = ranks[s][p]
            if r == 0:
                continue
            lo, hi = bounds[p], bounds[p + 1]
            update = operand(rows @ a[s, p, :r].T) @ b[s, lo:hi, :r].T
            y[start:end, lo:hi] += (update * scales[s]).to(y.dtype)


def lora_apply_cpu(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_ends: torch.Tensor,
    seg_slots: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    pair_products: bool | None = None,
) -> None:
    """The C++ kernel (`cpu_kernels.load()` first) on stacks packed by
    `lora_pack_cpu` (float32 or bfloat16): every index tensor int32, y, x,
    scales float32, rows contiguous (checked: check_lora_args).
    `pair_products` picks how bfloat16 stacks are multiplied (None: as
    `cpu_bfloat16_products` says; False: widened to float32; True: in
    bfloat16 pairs, where the CPU can)."""
    check_lora_args(y, x, a, b, bounds, seg_starts, seg_ends, seg_slots, ranks, scales, packed=True)
    torch.ops.sluice_cpu.lora_apply_(y, x, a, b, bounds, seg_starts, seg_ends, seg_slots, ranks, scales,
                                     pair_products)
