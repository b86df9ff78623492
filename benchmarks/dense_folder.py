"""A dense model folder of a GGUF file, for engines that serve only
dense checkpoints (vLLM's CPU build in benchmarks/cpu_compare.sh).

Sluice's converted folder leaves the block-served matrices in the .gguf
(sluice_server.gguf_checkpoint); vLLM would load such a folder without
them and serve uninitialized weights without a warning. This writes the
same folder with every tensor expanded from its blocks (bfloat16 by
default: what vLLM's CPU path computes in), so each engine serves the
same weights:

    python benchmarks/dense_folder.py path/to/model.gguf path/to/dense [--dtype float32]
    VLLM_MODEL=path/to/dense MODEL=path/to/model.gguf VLLM_PYTHON=... bash benchmarks/cpu_compare.sh
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sluice_server.download import resolve_model
from sluice_server.gguf_checkpoint import TENSORS_FILE, checkpoint_name, dequantized, rotary_heads
from sluice_server.gguf_header import read_header


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    folder = Path(resolve_model(str(args.gguf)))
    args.out.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():  # config, tokenizer, templates: as converted
        if item.is_file() and item.name not in ("model.safetensors", TENSORS_FILE):
            shutil.copy2(item, args.out / item.name)
    tensors = {name: t.to(dtype) for name, t in load_file(str(folder / "model.safetensors")).items()}
    header = read_header(args.gguf)
    for t in header.tensors:
        name = checkpoint_name(t.name)
        if name is None or name in tensors:
            continue
        tensors[name] = torch.from_numpy(dequantized(args.gguf, t, rotary_heads(header, t.name))).to(dtype)
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"{len(tensors)} tensors, {size / 2**30:.2f} GiB {args.dtype} -> {args.out}")


if __name__ == "__main__":
    main()
