"""A converted GGUF's block-served matrices, read from the .gguf itself.

For the families in DIRECT_ARCHITECTURES (Llama, Qwen2, Qwen3 files without
experts) the converter (gguf_convert.py) writes no dense copy of a matrix
the CPU kernels read as GGUF blocks; the folder says where each one is:

    <folder>/
        model.safetensors     float32: every tensor that is not block-served
                              (norms, biases, F32/F16/BF16 tensors, block types
                              the kernels do not read), as transformers reads them
        gguf_tensors.json     {"tensors": {checkpoint name: {"gguf": GGUF tensor
                              name, "type": ggml type, "shape": [rows, cols],
                              "rotary_heads": heads or null}}}
        gguf_source.json      {"gguf": path of the .gguf}

A block-served matrix is a 2-D tensor of a type in sluice_kernels.gguf_blocks
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) whose rows are whole blocks.
The shard reads it two ways (model_runner.py decides):

- as blocks (layers.gguf_weights.attach_gguf_blocks): the file's blocks,
  memory-mapped, unpacked into records, rows put in the checkpoint's order
  (`row_order`). Where the blocks take every step no float32 form of the
  matrix is ever allocated.
- dense (`tensors`): one tensor at a time, expanded to float32 by the gguf
  package's dequantizer, exactly what transformers' GGUF reader gives (it
  calls the same function and undoes the same permutation), for every path
  that computes on dense weights: CUDA, --dtype bfloat16, tensor-parallel
  slices, the packed float32 form of --dtype float32's large steps. The
  whole model is never dense at once beyond what those paths keep.

llama.cpp stores a Llama's q/k rows permuted for its rotary layout: within
each head the rows of the two rotary halves interleaved. Checkpoint row
h*D + a*D/2 + i (head h, half a, pair i) is GGUF row h*D + 2i + a;
`unpermute_rotary_rows` undoes it, for the key with the key/value head
count (as transformers' reader does). Qwen2 and Qwen3 files are not permuted.

Files of other families (Gemma 3's shifted norms, Phi-3's fused tensors,
the mixtures of experts, gpt-oss) keep the float32 conversion through
transformers (gguf_convert.py), and their blocks are attached by content.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from sluice_server.gguf_header import GGUFHeader, GGUFTensor, tensor_bytes
from sluice_server.model_folder import SOURCE_FILE

TENSORS_FILE = "gguf_tensors.json"

# GGUF architectures converted without a float32 copy of their block-served
# matrices (a `llama` file with experts is Mixtral: not one of them).
DIRECT_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Architectures whose q/k rows llama.cpp permutes (transformers undoes it for these).
ROTARY_PERMUTED = ("llama",)

# The block types the CPU kernels read (sluice_kernels.gguf_blocks.FORMATS),
# with the values per block where it is not 32.
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
BLOCK_VALUES = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256}

# GGUF tensor names -> checkpoint names (transformers'), per layer (blk.N.<part>.<kind>) or whole.
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
MODEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp's Llama 3.1 rope factors: the rotary computes them from config.json.
SKIPPED = ("rope_freqs.weight",)


def checkpoint_name(gguf_name: str) -> str | None:
    """The checkpoint's name for a GGUF tensor, None for one not mapped."""
    if gguf_name in MODEL_NAMES:
        return MODEL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in LAYER_NAMES \
            or parts[3] not in ("weight", "bias"):
        return None
    return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"


def block_served(tensor: GGUFTensor) -> bool:
    """Whether the CPU kernels read `tensor` as blocks: a matrix of a block
    type whose rows (shape[0] values, GGUF order) are whole blocks of 32."""
    cols = tensor.shape[0]
    return (
        len(tensor.shape) == 2 and tensor.type_name in BLOCK_TYPES
        and cols % 32 == 0 and cols % BLOCK_VALUES.get(tensor.type_name, 32) == 0
    )


def direct_architecture(header: GGUFHeader) -> bool:
    """Whether the file converts without a float32 copy of its block-served
    matrices: its family is one of DIRECT_ARCHITECTURES and every tensor has a
    checkpoint name (anything else takes the transformers conversion)."""
    arch = header.architecture
    if arch not in DIRECT_ARCHITECTURES or header.metadata.get(f"{arch}.expert_count", 0) > 0:
        return False
    return all(t.name in SKIPPED or checkpoint_name(t.name) is not None for t in header.tensors)


def rotary_heads(header: GGUFHeader, gguf_name: str) -> int | None:
    """The head count whose permutation `gguf_name`'s rows carry, or None."""
    arch = header.architecture
    if arch not in ROTARY_PERMUTED:
        return None
    heads = int(header.metadata[f"{arch}.attention.head_count"])
    if ".attn_q." in gguf_name:
        return heads
    if ".attn_k." in gguf_name:
        return int(header.metadata.get(f"{arch}.attention.head_count_kv", heads))
    return None


def unpermute_rotary_rows(w, heads: int):
    """Undoes llama.cpp's q/k row order (module docstring) on an array or
    tensor whose first dimension is the rows."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized(path: Path, tensor: GGUFTensor, heads: int | None) -> np.ndarray:
    """`tensor` as float32 in the checkpoint's shape and row order: the gguf
    package's expansion (transformers' reader calls the same function)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = tensor_bytes(path, tensor)
    if tensor.type_name == "F32":
        values = np.array(raw).view(np.float32)
    else:
        values = dequantize(np.asarray(raw), GGMLQuantizationType[tensor.type_name])
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(tuple(reversed(tensor.shape)))
    return np.ascontiguousarray(unpermute_rotary_rows(values, heads)) if heads else values


@dataclass(frozen=True)
class BlockTensor:
    """One block-served matrix of the folder (gguf_tensors.json)."""

    gguf: str  # the GGUF tensor's name
    type_name: str
    shape: tuple[int, int]  # [rows, cols], the checkpoint's
    rotary_heads: int | None

    def row_order(self) -> np.ndarray | None:
        """For each checkpoint row, its row in the file (None: the same)."""
        if not self.rotary_heads:
            return None
        return unpermute_rotary_rows(np.arange(self.shape[0]), self.rotary_heads)


class GGUFTensors:
    """The block-served matrices of a converted folder and the file holding them."""

    def __init__(self, gguf: Path, tensors: dict[str, BlockTensor]):
        self.gguf = gguf
        self.tensors = tensors  # checkpoint name -> tensor
        self.by_gguf_name = {t.gguf: t for t in tensors.values()}
        self._offsets: dict[str, GGUFTensor] | None = None

    @classmethod
    def of_folder(cls, folder: Path) -> "GGUFTensors | None":
        """The folder's block-served matrices, None for a folder without them."""
        path = folder / TENSORS_FILE
        if not path.is_file():
            return None
        source = folder / SOURCE_FILE
        gguf = Path(json.loads(source.read_text())["gguf"])
        if not gguf.is_file():
            raise FileNotFoundError(
                f"{folder} reads its weights from {gguf}, which is gone: pass the .gguf again to convert it"
            )
        entries = json.loads(path.read_text())["tensors"]
        return cls(gguf, {
            name: BlockTensor(e["gguf"], e["type"], tuple(e["shape"]), e.get("rotary_heads"))
            for name, e in entries.items()
        })

    def header_tensor(self, name: str) -> GGUFTensor:
        """The file's tensor `name` (a GGUF name), with its offset."""
        if self._offsets is None:
            from sluice_server.gguf_header import read_header

            self._offsets = {t.name: t for t in read_header(self.gguf).tensors}
        return self._offsets[name]

    def blocks(self, tensor: BlockTensor) -> np.ndarray:
        """The matrix's blocks, memory-mapped: uint8 [rows, bytes per row], file row order."""
        return tensor_bytes(self.gguf, self.header_tensor(tensor.gguf))

    def dense(self, name: str) -> np.ndarray:
        """Checkpoint tensor `name` expanded to float32 [rows, cols]."""
        t = self.tensors[name]
        return dequantized(self.gguf, self.header_tensor(t.gguf), t.rotary_heads)

    def slices(self) -> Iterator[tuple[str, "DenseSlice"]]:
        for name in self.tensors:
            yield name, DenseSlice(self, name)

    def parameter_count(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors.values())


class DenseSlice:
    """A block-served matrix read like a safetensors slice (`get_shape`,
    `[rows, cols]` indexing) by a parameter's weight loader: expanded to
    float32 on the first read, and kept only while the slice lives (one
    tensor at a time during loading)."""

    def __init__(self, tensors: GGUFTensors, name: str):
        self.tensors, self.name = tensors, name
        self._value = None

    def get_shape(self) -> list[int]:
        return list(self.tensors.tensors[self.name].shape)

    def __getitem__(self, key):
        import torch

        if self._value is None:
            self._value = torch.from_numpy(self.tensors.dense(self.name))
        return self._value[key]


def manifest(header: GGUFHeader) -> dict[str, dict]:
    """gguf_tensors.json's "tensors" for a file whose architecture is direct."""
    out = {}
    for t in header.tensors:
        if t.name in SKIPPED or not block_served(t):
            continue
        out[checkpoint_name(t.name)] = {
            "gguf": t.name, "type": t.type_name, "shape": [t.shape[1], t.shape[0]],
            "rotary_heads": rotary_heads(header, t.name),
        }
    return out
