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

`layout` chooses the record layout of a layer: for a layer all of Q4_K or
all of Q6_K, the super-block layouts U4_K / U6_K, which keep the fields
sw and cw are products of (d, dmin and the 6-bit scales; d and the int8
scales) and so hold about the file's bytes (`Records.kquant`, `_pack_k`);
else one scale pair per 32 weights where its types have that (4-bit weights
if every wq fits in 4 bits, fp16 scales where fp16 holds every sw and cw
exactly, as for all the 32-weight types, else fp32), else a pair per 16
(Q6_K mixed with other types).

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
U4_F16, U8_F16, U4_F32, U8_F32, U8_HALVES, U4_K, U6_K = range(7)
FORMATS = frozenset(BLOCK_BYTES)


@dataclass
class Records:
    sw: np.ndarray  # float32 [rows, K/16]
    cw: np.ndarray  # float32 [rows, K/16]
    wq: np.ndarray  # uint8 [rows, K]
    # Q4_K and Q6_K only (`kquant` names which): the super-block fields sw and
    # cw are products of, which the compact layouts U4_K / U6_K keep instead:
    #   Q4_K  d: fp16 [rows, K/256, 2] (d, dmin); scales: uint8 [rows, K/32, 2] (sc, m)
    #   Q6_K  d: fp16 [rows, K/256, 1];          scales: uint8 [rows, K/16, 1] (int8 sc)
    kquant: str | None = None
    d: np.ndarray | None = None
    scales: np.ndarray | None = None

    def take(self, order) -> "Records":
        if self.kquant is None:
            return Records(self.sw[order], self.cw[order], self.wq[order])
        return Records(self.sw[order], self.cw[order], self.wq[order], self.kquant, self.d[order], self.scales[order])

    @staticmethod
    def concat(parts: list["Records"]) -> "Records":
        """The rows of all parts, in order; the K-quant fields kept where
        every part is of the same K-quant type."""
        sw, cw, wq = (np.concatenate(a) for a in zip(*((r.sw, r.cw, r.wq) for r in parts)))
        kinds = {r.kquant for r in parts}
        if len(kinds) != 1 or None in kinds:
            return Records(sw, cw, wq)
        return Records(sw, cw, wq, parts[0].kquant, np.concatenate([r.d for r in parts]),
                       np.concatenate([r.scales for r in parts]))

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
    wq = wq.reshape(rows, k).astype(np.uint8)
    sw, cw = (np.repeat(a.reshape(rows, -1), 2, axis=1) for a in (sw, cw))
    if type_name == "Q4_K":
        fields = np.stack([d[..., 0], dmin[..., 0]], axis=-1).astype(np.float16)
        return Records(sw, cw, wq, "Q4_K", fields, np.stack([sc, m], axis=-1).reshape(rows, -1, 2).astype(np.uint8))
    return Records(sw, cw, wq)


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
    sc = raw[..., 192:208]
    d = _fp16(raw, 208)
    sw = (d * sc.view(np.int8).astype(np.float32)).reshape(rows, -1)
    return Records(sw, -32.0 * sw, wq.astype(np.uint8), "Q6_K", d.astype(np.float16),
                   np.ascontiguousarray(sc).reshape(rows, -1, 1))


def _fits_fp16(a: np.ndarray) -> bool:
    return bool(np.array_equal(a.astype(np.float16).astype(np.float32), a))


def layout(types: set[str], records: Records) -> int:
    """The record layout of csrc/cpu_q8_linear.cpp for a layer made of
    `types` (module docstring)."""
    if records.kquant is not None and types == {records.kquant}:
        return U4_K if records.kquant == "Q4_K" else U6_K
    if not (np.array_equal(records.sw[:, ::2], records.sw[:, 1::2])
            and np.array_equal(records.cw[:, ::2], records.cw[:, 1::2])):
        return U8_HALVES
    four = types <= FOUR_BIT
    f32 = not (_fits_fp16(records.sw) and _fits_fp16(records.cw))
    return (U4_F32 if four else U8_F32) if f32 else (U4_F16 if four else U8_F16)


def _nibble_records(wq: np.ndarray) -> np.ndarray:
    """wq [16 G, K] (values < 16) -> [G, K/32, 256]: each block's 4-bit
    weight record, byte 64 c + 4 i + j = wq[i, 4c + j] | wq[i, 16 + 4c + j] << 4."""
    n, k = wq.shape
    q = wq.reshape(n // 16, 16, k // 32, 2, 4, 4)  # [g, i, block, half, c, j]
    byte = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [g, i, block, c, j]
    return byte.transpose(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 256)


def _pack_k(records: Records, layout_code: int) -> torch.Tensor:
    """The super-block layouts U4_K and U6_K (csrc/cpu_q8_linear.cpp): per
    group of 16 rows and super-block of 256 values, a header of the
    super-block's own fields, then its 8 blocks' weights:

        U4_K  [d: 16 fp16][dmin: 16 fp16][sc: 8 x 16 bytes][m: 8 x 16 bytes]
              then per block the 4-bit record (256 bytes)
        U6_K  [d: 16 fp16][sc: 16 x 16 int8]
              then per block the low 4 bits as a 4-bit record (256 bytes) and
              two planes of 64 bytes for the high 2 bits: byte 64 p + 4 i + j
              holds bits 4, 5 of wq[i, 4 (p + 2t) + j] at bits 2t, 2t + 1
    """
    n, k = records.wq.shape
    rows = -(-n // 16) * 16
    groups, supers = rows // 16, k // 256

    def padded(a: np.ndarray) -> np.ndarray:  # padding rows: zero weights and scales
        return np.concatenate([a, np.zeros((rows - n,) + a.shape[1:], a.dtype)]) if rows > n else a

    wq, d, scales = padded(records.wq), padded(records.d), padded(records.scales)
    # Per-row fields -> [g, super-block, field, i] so each field is 16 lanes.
    d_bytes = d.reshape(groups, 16, supers, -1).transpose(0, 2, 3, 1).copy().view(np.uint8).reshape(groups, supers, -1)
    if layout_code == U4_K:
        sc = scales.reshape(groups, 16, supers, 8, 2).transpose(0, 2, 4, 3, 1)  # [g, s, (sc, m), block, i]
        blocks = _nibble_records(wq)
    else:
        sc = scales.reshape(groups, 16, supers, 16).transpose(0, 2, 3, 1)  # [g, s, run of 16, i]
        high = (wq >> 4).reshape(groups, 16, k // 32, 4, 2, 4)  # [g, i, block, t, p, j]
        planes = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)
        planes = planes.transpose(0, 2, 3, 1, 4).reshape(groups, k // 32, 128)
        blocks = np.concatenate([_nibble_records(wq & 15), planes], axis=-1)
    header = np.concatenate([d_bytes, sc.reshape(groups, supers, -1)], axis=-1)
    data = np.concatenate([header, blocks.reshape(groups, supers, -1)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(data).reshape(-1))


def pack(records: Records, layout_code: int) -> torch.Tensor:
    """The packed weight q8_linear reads (see csrc/cpu_q8_linear.cpp): one
    scale pair per 32 weights, or per 16 for U8_HALVES, or the K-quant
    super-block layouts."""
    if layout_code in (U4_K, U6_K):
        want = "Q4_K" if layout_code == U4_K else "Q6_K"
        if records.kquant != want:
            raise ValueError(f"layout {layout_code} holds {want} records only, not {records.kquant or 'these'}")
        return _pack_k(records, layout_code)
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

    def pieces(self) -> list["QuantizedWeight"]:
        """The packed weights whose outputs make this layer's, in order."""
        return [self]

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
        if self.format in (U4_K, U6_K):
            return torch.from_numpy(_k_rows(self.data.numpy(), self.format, self.out_features, ids.numpy()))
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


def _k_rows(data: np.ndarray, layout_code: int, n: int, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a U4_K / U6_K packed weight of n rows (`_pack_k`),
    each weight wq * sw + cw rounded as `Records.expand` rounds it, read
    back field by field: the reference the C++ `block_rows` and the packing
    are tested against."""
    header, block = (320, 256) if layout_code == U4_K else (288, 384)
    supers = data.size // (-(-n // 16) * (header + 8 * block))
    t = len(ids)
    sup = data.reshape(-1, supers, header + 8 * block)[ids // 16]  # [T, S, bytes]: each id's group
    lane = ids % 16

    def pick(a: np.ndarray, axis: int) -> np.ndarray:
        """Each id's own lane i along `axis` of a [T, ...] array."""
        shape = [1] * a.ndim
        shape[0] = t
        return np.take_along_axis(a, lane.reshape(shape), axis=axis).squeeze(axis)

    def nibbles(records: np.ndarray) -> np.ndarray:  # [T, S, 8, 256] 4-bit records -> [T, S, 8, 32]
        b = pick(records.reshape(t, supers, 8, 4, 16, 4), 4)  # [T, S, block, c, j]
        return np.concatenate([(b & 15).reshape(t, supers, 8, 16), (b >> 4).reshape(t, supers, 8, 16)], axis=-1)

    blocks = sup[..., header:].reshape(t, supers, 8, block)
    if layout_code == U4_K:
        d = pick(sup[..., :64].copy().view(np.float16).reshape(t, supers, 2, 16), 3).astype(np.float32)
        sc_m = pick(sup[..., 64:320].reshape(t, supers, 2, 8, 16), 4).astype(np.float32)  # [T, S, (sc, m), block]
        sw = (d[..., 0:1] * sc_m[:, :, 0])[..., None]  # [T, S, block, 1]
        cw = (-(d[..., 1:2] * sc_m[:, :, 1]))[..., None]
        wq = nibbles(blocks).astype(np.float32)
    else:
        d = pick(sup[..., :32].copy().view(np.float16).reshape(t, supers, 16), 2).astype(np.float32)
        sc = pick(sup[..., 32:288].view(np.int8).reshape(t, supers, 16, 16), 3).astype(np.float32)  # [T, S, run]
        sw = (d[..., None] * sc).reshape(t, supers, 8, 2, 1)
        cw = -32.0 * sw
        planes = pick(blocks[..., 256:].reshape(t, supers, 8, 2, 16, 4), 4)  # [T, S, block, p, j]
        high = np.stack([(planes >> (2 * i)) & 3 for i in range(4)], axis=3)  # [T, S, block, t, p, j]
        wq = (nibbles(blocks[..., :256]) | (high.reshape(t, supers, 8, 32) << 4)).astype(np.float32)
        wq = wq.reshape(t, supers, 8, 2, 16)
    return (wq * sw + cw).reshape(t, -1).astype(np.float32)


@dataclass
class QuantizedParts:
    """A layer whose pieces are of different block types (Q4_K_M's q and k
    in Q4_K beside v in Q6_K), each run of one type in its own layout, so
    each keeps its compact records instead of all taking the one layout that
    holds every type (8-bit weights with a float32 pair per 16: 1.5 bytes a
    weight). The outputs of the parts follow each other."""

    parts: list[QuantizedWeight]

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def int8(self) -> bool:
        return self.parts[0].int8

    @property
    def max_rows(self) -> int:
        return self.parts[0].max_rows

    def handles(self, x: torch.Tensor) -> bool:
        return self.parts[0].handles(x)

    def tensors(self) -> list[torch.Tensor]:
        return [p.data for p in self.parts]

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.linear(x) for p in self.parts], dim=1)

    def pieces(self) -> list[QuantizedWeight]:
        return list(self.parts)
