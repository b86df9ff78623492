"""GGUF block formats as the int8 CPU kernel reads them.

Every format below is, for each run of 16 weights of a row,

    w_j = sw * wq_j + cw        wq_j unsigned, at most 8 bits

(`unpack` returns sw, cw [rows, K/16] float32 and wq [rows, K] uint8), which
is the form csrc/cpu_q8_linear.cpp multiplies with int8 activations:

    type   bytes / weights   per 32 weights                 sw        cw           wq
    Q4_0   18 / 32           d, 16 bytes of nibbles         d         -8 d         nibble
    Q4_1   20 / 32           d, m, nibbles                  d         m            nibble
    Q5_0   22 / 32           d, 32 high bits, nibbles       d         -16 d        nibble + 16 bit
    Q5_1   24 / 32           d, m, high bits, nibbles       d         m            nibble + 16 bit
    Q8_0   34 / 32           d, 32 int8                     d         -128 d       q + 128
    Q4_K   144 / 256         d, dmin, 12 bytes of 6-bit     d * sc    -dmin * m    nibble
                             (sc, m) pairs, nibbles
    Q5_K   176 / 256         as Q4_K, plus 32 bytes of      d * sc    -dmin * m    nibble + 16 bit
                             high bits
    Q6_K   210 / 256         low nibbles, 2 high bits,      d * sc    -32 d * sc   6 bits
                             an int8 scale per 16, d

(d, m, dmin are fp16.) sw * wq + cw is the gguf package's dequantized weight
bit for bit (kernels/tests/test_cpu_q8_linear.py checks every type).
All but Q6_K have one (sw, cw) per 32 weights.

`layout` chooses the record layout of a layer: one scale pair per 32
weights where its types have that (4-bit weights if every wq fits in 4 bits,
fp16 scales where fp16 holds every sw and cw exactly, as for all the
32-weight types, else fp32), else a pair per 16 (Q6_K, alone or mixed).

`QuantizedWeight` is one layer's packed records with the matmul that reads
them: `q8_linear` (int8 activations, llama.cpp's arithmetic) or
`exact_linear` (each record expanded to the float32 weight in registers).
Which layers get one is the shard's decision (its layers.gguf_weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 32
# 4-bit weights; formats of the first set only are read with 4-bit records.
FOUR_BIT = {"Q4_0", "Q4_1", "Q4_K"}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_VALUES = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
# Record layouts of csrc/cpu_q8_linear.cpp.
U4_F16, U8_F16, U4_F32, U8_F32, U8_HALVES = range(5)
FORMATS = frozenset(BLOCK_BYTES)


@dataclass
class Records:
    sw: np.ndarray  # float32 [rows, K/16]
    cw: np.ndarray  # float32 [rows, K/16]
    wq: np.ndarray  # uint8 [rows, K]

    def take(self, order) -> "Records":
        return Records(self.sw[order], self.cw[order], self.wq[order])

    def expand(self) -> np.ndarray:
        """The float32 weight [rows, K] the records stand for."""
        rows, k = self.wq.shape
        w = self.wq.reshape(rows, k // 16, 16).astype(np.float32) * self.sw[..., None] + self.cw[..., None]
        return w.reshape(rows, k)


def _fp16(raw: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block, as float32 [..., 1]."""
    return np.ascontiguousarray(raw[..., at : at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: the low nibbles, then the high ones."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit j (j < count) of little-endian bytes qh [..., count/8] -> [..., count] in {0, 1}."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :count]


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of a K-quant super-block -> its 8 (scale, min) 6-bit pairs."""
    s = scales.astype(np.uint8)
    lo, hi = s[..., 0:4], s[..., 4:8]
    mix = s[..., 8:12]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), m.astype(np.float32)


def unpack(type_name: str, blocks: np.ndarray, k: int) -> Records:
    """GGUF blocks [rows, row bytes] of one tensor -> its records."""
    rows = blocks.shape[0]
    per = BLOCK_VALUES.get(type_name, QK)
    raw = np.asarray(blocks, dtype=np.uint8).reshape(rows, k // per, BLOCK_BYTES[type_name])
    if type_name == "Q6_K":
        return _unpack_q6_k(raw, rows, k)
    if per == QK:
        d = _fp16(raw, 0)
        if type_name == "Q8_0":
            wq = (raw[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            sw, cw = d, -128.0 * d
        elif type_name in ("Q4_0", "Q4_1"):
            start = 2 if type_name == "Q4_0" else 4
            wq = _nibbles(raw[..., start : start + 16])
            sw, cw = d, (-8.0 * d if type_name == "Q4_0" else _fp16(raw, 2))
        else:  # Q5_0, Q5_1
            start = 2 if type_name == "Q5_0" else 4
            high = _high_bits(raw[..., start : start + 4], 32)
            wq = _nibbles(raw[..., start + 4 : start + 20]) | (high << 4)
            sw, cw = d, (-16.0 * d if type_name == "Q5_0" else _fp16(raw, 2))
        sw, cw = sw[..., 0], cw[..., 0]
    else:
        # Q4_K, Q5_K: super-blocks of 256 = 8 sub-blocks of 32.
        d, dmin = _fp16(raw, 0), _fp16(raw, 2)
        sc, m = _k_scales(raw[..., 4:16])
        qs = raw[..., -128:].reshape(rows, -1, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low), 2c + 1 (high)
        wq = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, -1, 8, 32)
        if type_name == "Q5_K":
            high = _high_bits(raw[..., 16:48], 256).reshape(rows, -1, 32, 8)  # [.., l, j]: bit j of qh[l]
            wq = wq | (high.transpose(0, 1, 3, 2) << 4)
        sw, cw = d * sc, -(dmin * m)
    # One pair per 32 weights -> the same pair for both halves of 16.
    sw, cw = (np.repeat(a.reshape(rows, -1), 2, axis=1) for a in (sw, cw))
    return Records(sw, cw, wq.reshape(rows, k).astype(np.uint8))


def _unpack_q6_k(raw: np.ndarray, rows: int, k: int) -> Records:
    """Q6_K: [ql: 128 | qh: 64 | scales: 16 int8 | d: fp16] per 256 weights.
    In each half of 128 (ql 64 bytes, qh 32), value 32 i + l (i < 4, l < 32)
    is a nibble of ql (l, low for i = 0; l + 32, low, i = 1; l, high, i = 2;
    l + 32, high, i = 3) with bits 2i, 2i + 1 of qh[l] above it; the 16
    weights of group g have scale sc[g]; w = d * sc * (q - 32)."""
    ql = raw[..., 0:128].reshape(rows, -1, 2, 2, 32)  # [half, 32-byte run, l]
    qh = raw[..., 128:192].reshape(rows, -1, 2, 1, 32)
    low = np.stack([ql & 15, ql >> 4], axis=3).reshape(rows, -1, 2, 4, 32)  # i = 0..3: runs (0 lo, 1 lo, 0 hi, 1 hi)
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)
    high = (qh >> shifts) & 3
    wq = (low | (high << 4)).reshape(rows, k)
    sc = raw[..., 192:208].view(np.int8).astype(np.float32)
    sw = (_fp16(raw, 208) * sc).reshape(rows, -1)
    return Records(sw, -32.0 * sw, wq.astype(np.uint8))


def _fits_fp16(a: np.ndarray) -> bool:
    return bool(np.array_equal(a.astype(np.float16).astype(np.float32), a))


def layout(types: set[str], records: Records) -> int:
    """The record layout of csrc/cpu_q8_linear.cpp for a layer made of
    `types` (module docstring)."""
    if not (np.array_equal(records.sw[:, ::2], records.sw[:, 1::2])
            and np.array_equal(records.cw[:, ::2], records.cw[:, 1::2])):
        return U8_HALVES
    four = types <= FOUR_BIT
    f32 = not (_fits_fp16(records.sw) and _fits_fp16(records.cw))
    return (U4_F32 if four else U8_F32) if f32 else (U4_F16 if four else U8_F16)


def pack(records: Records, layout_code: int) -> torch.Tensor:
    """The packed weight q8_linear reads (see csrc/cpu_q8_linear.cpp): one
    scale pair per 32 weights, or per 16 for U8_HALVES."""
    step = 1 if layout_code == U8_HALVES else 2
    return torch.ops.sluice_cpu.q8_pack(
        torch.from_numpy(np.ascontiguousarray(records.sw[:, ::step], dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(records.cw[:, ::step], dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(records.wq, dtype=np.uint8)),
        layout_code,
    )


@dataclass
class QuantizedWeight:
    """One layer's GGUF blocks in the form its kernel reads."""

    # uint8: the blocks as records (pack), rows in the layer's order.
    data: torch.Tensor
    # The record layout (layout()).
    format: int
    out_features: int
    # Activations quantized to int8 (q8_linear), else the exact expansion.
    int8: bool
    # Matmuls of at most this many rows run here; larger ones on the dense weights.
    max_rows: int

    def handles(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[0] <= self.max_rows and x.dtype == torch.float32 and x.device.type == "cpu"

    def tensors(self) -> list[torch.Tensor]:
        """What this holds in memory (for the shard's weight count)."""
        return [self.data]

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        linear = torch.ops.sluice_cpu.q8_linear if self.int8 else torch.ops.sluice_cpu.exact_linear
        return linear(x, self.data, self.format, self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] (int64) of the weight, float32 [T, K], for an
        embedding lookup on the blocks: the C++ kernel (csrc/cpu_q8_linear.cpp
        `block_rows`, a few microseconds a step) computing what
        `rows_reference` computes."""
        return torch.ops.sluice_cpu.block_rows(self.data, self.format, self.out_features, ids.contiguous())

    def rows_reference(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] (int64) of the weight, float32 [T, K]: each record
        expanded as `Records.expand` does (sw * wq + cw, rounded after the
        product and after the sum), read out of the packed layout of
        csrc/cpu_q8_linear.cpp, in plain torch (~80 us a call: a dozen ops):

            group g = id // 16, lane i = id % 16; record (g, b) of rb bytes:
            [ scale sets (sw, cw; or sw lo, sw hi, cw lo, cw hi) x 16 lanes ]
            [ weights: 8-bit, chunk c < 8: lane i's wq[4c .. 4c+3] at 64c + 4i
                       4-bit, chunk c < 4: byte 64c + 4i + j holds
                       wq[4c + j] (low nibble) and wq[16 + 4c + j] (high) ]
        """
        four, halves = self.format in (U4_F16, U4_F32), self.format == U8_HALVES
        scale_dtype = torch.float16 if self.format in (U4_F16, U8_F16) else torch.float32
        sets = 4 if halves else 2
        header = sets * 16 * scale_dtype.itemsize
        rb = header + (16 * QK // 2 if four else 16 * QK)
        nb = self.data.numel() // (-(-self.out_features // 16) * rb)  # records per group: K / 32
        record = torch.arange(nb)[:, None]

        def gather(dtype: torch.dtype, at: torch.Tensor) -> torch.Tensor:
            """Lane i's `dtype` units at unit offsets `at` [K/32, n] of each
            of its group's records -> [T, K/32, n]: one gather out of the
            packed bytes, no copy of the other lanes'."""
            per_record = rb // dtype.itemsize
            first = (ids // 16) * (nb * per_record) + ids % 16  # lane i's unit of record 0
            return self.data.view(dtype)[first[:, None, None] + record * per_record + at]

        # scale set w's unit at w * 16 + i; weight chunk c's word at header / 4 + c * 16 + i
        scales = gather(scale_dtype, torch.arange(sets) * 16).float()  # [T, K/32, sets]
        chunks = 4 if four else 8
        wq = gather(torch.int32, header // 4 + torch.arange(chunks) * 16).view(torch.uint8)  # [T, K/32, 4 * chunks]
        if four:  # the high nibble as (byte & 0xf0) / 16, exact in float32
            wq = torch.cat([(wq & 15).float(), (wq & 240).float() * (1 / 16)], dim=-1)
        t = ids.numel()
        runs = 2 if halves else 1  # scale pairs per record
        wq = wq.reshape(t, nb, runs, QK // runs).float()
        sw, cw = scales[:, :, :runs, None], scales[:, :, runs : 2 * runs, None]
        return (wq * sw + cw).reshape(t, nb * QK)
