"""A GGUF file's header: its metadata and tensor list, without the tensor data.

`gguf.GGUFReader` builds an object per array element (a 262k-token
vocabulary is 262k of them: minutes on a busy machine); checking what a file
is before converting it needs only the scalar metadata and the tensor table,
so this reads those and steps over the arrays.

    magic "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata:  key (string) | value type u32 | value
    tensors:   name (string) | n_dims u32 | dims u64 x n_dims | ggml type u32 | offset u64

Strings are a u64 length and UTF-8 bytes; an array is an element type u32,
a count u64 and the elements. Everything is little-endian (version 2 and 3;
version 1 counted in 32 bits and is long gone). Tensor data follows the
table, from the next multiple of `general.alignment` (32 by default); each
offset counts from there.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# Fixed-size metadata value types: struct format by type id.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """Not a GGUF file this reader understands."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: the contiguous dimension first
    type_name: str  # the ggml type's name (Q4_K, F32, ...), or TYPE_<id> for one the gguf package does not know
    offset: int  # of the first byte of its data, from the start of the file

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the first dimension), for a type the gguf package knows."""
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[self.type_name]]
        return self.shape[0] // block * type_size

    @property
    def nbytes(self) -> int:
        return self.row_bytes * math.prod(self.shape[1:])


def tensor_bytes(path: Path, tensor: GGUFTensor) -> np.ndarray:
    """The tensor's stored data as uint8 [rows, bytes per row] (rows: every
    dimension but the first), memory-mapped, for gguf.quants.dequantize."""
    rows = math.prod(tensor.shape[1:])
    return np.memmap(path, dtype=np.uint8, mode="r", offset=tensor.offset, shape=(rows, tensor.row_bytes))


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    # Scalars and strings; each array is (element type id, count).
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensor, ...]

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def by_layer(self, skipped: tuple[str, ...] = ()) -> list[tuple[str, dict[str, GGUFTensor]]]:
        """The tensors not in `skipped`, grouped as a converter writes them a
        file at a time: "layer-NNNNN" for each `blk.N.*`, "rest" for the
        others; groups in name order, tensors in file order."""
        groups: dict[str, dict[str, GGUFTensor]] = {}
        for t in self.tensors:
            if t.name in skipped:
                continue
            parts = t.name.split(".", 2)
            group = f"layer-{int(parts[1]):05d}" if parts[0] == "blk" else "rest"
            groups.setdefault(group, {})[t.name] = t
        return sorted(groups.items())


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise GGUFFormatError(f"{self.path.name}: truncated GGUF header") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFFormatError(f"{self.path.name}: truncated GGUF header")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.unpack("<Q")
        self.pos += n

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            element, count = self.unpack("<I"), self.unpack("<Q")
            if element in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[element])
                if self.pos > len(self.buf):
                    raise GGUFFormatError(f"{self.path.name}: truncated GGUF header")
            elif element == _STRING:
                for _ in range(count):
                    self.skip_string()
            else:
                for _ in range(count):
                    self.value(element)
            return (element, count)
        raise GGUFFormatError(f"{self.path.name}: unknown GGUF metadata type {kind}")


def read_header(path: Path) -> GGUFHeader:
    """The metadata and tensor table of the GGUF file at `path`."""
    if path.stat().st_size < 24:
        raise GGUFFormatError(f"{path.name} is too short to be a GGUF file")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise GGUFFormatError(f"{path.name} is not a GGUF file (no GGUF magic)")
        cur = _Cursor(buf, path)
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"{path.name}: GGUF version {version} is not supported (2 and 3 are)")
        num_tensors, num_metadata = cur.unpack("<Q"), cur.unpack("<Q")
        metadata = {}
        for _ in range(num_metadata):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("<I"))
        table = []
        for _ in range(num_tensors):
            name = cur.string()
            shape = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
            type_id = cur.unpack("<I")
            table.append((name, shape, type_id, cur.unpack("<Q")))
        alignment = metadata.get("general.alignment", 32)
        data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, shape, type_id, offset in table:
        try:
            type_name = GGMLQuantizationType(type_id).name
        except ValueError:
            type_name = f"TYPE_{type_id}"
        tensors.append(GGUFTensor(name, shape, type_name, data_start + offset))
    return GGUFHeader(version, metadata, tuple(tensors))
