"""GGUF files before conversion: the header reader, and the check that an
unsupported architecture or tensor type fails at once, naming what is
supported, with nothing written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sluice_server import gguf_convert
from sluice_server.download import ModelResolutionError, resolve_model
from sluice_server.gguf_convert import GGUF_ARCHITECTURES, GGUF_TENSOR_TYPES
from sluice_server.gguf_header import GGUFFormatError, read_header, tensor_bytes
from sluice_server.models import MODEL_FAMILIES


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> Path:
    """A small GGUF: a few metadata keys (a string array among them, and
    `metadata`'s strings) and the tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_token_list(["<s>", "</s>", "hello", "world"])
    for key, value in (metadata or {}).items():
        writer.add_string(key, value)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_header_matches_the_gguf_reader(tmp_path):
    import gguf

    path = write_gguf(tmp_path / "m.gguf", "qwen3", {
        "token_embd.weight": np.arange(8 * 32, dtype=np.float32).reshape(8, 32),
        "blk.0.attn_norm.weight": np.ones(32, dtype=np.float16),
    })
    header = read_header(path)
    reader = gguf.GGUFReader(str(path))
    assert header.architecture == "qwen3" and header.version == 3
    assert header.metadata["qwen3.block_count"] == 1 and header.metadata["qwen3.context_length"] == 64
    assert header.metadata["tokenizer.ggml.tokens"] == (gguf.GGUFValueType.STRING, 4)
    assert [(t.name, t.shape, t.type_name) for t in header.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), t.tensor_type.name) for t in reader.tensors
    ]
    assert [t.type_name for t in header.tensors] == ["F32", "F16"]
    for ours, theirs in zip(header.tensors, reader.tensors):
        assert tensor_bytes(path, ours).tobytes() == np.asarray(theirs.data).tobytes()


def test_header_of_the_bundled_model(smollm2_gguf):
    header = read_header(smollm2_gguf)
    assert header.architecture == "llama" and header.metadata["llama.block_count"] == 30
    assert {t.type_name for t in header.tensors} == {"F32", "Q4_1", "Q8_0"}
    assert len(header.tensors) == 272


@pytest.mark.parametrize("content", [b"", b"GGU", b"not a gguf" * 10, b"GGUF\x03\x00\x00\x00\x05"])
def test_not_a_gguf_is_a_format_error(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFFormatError, match="bad.gguf"):
        read_header(path)


def test_every_gguf_architecture_is_served():
    assert set(GGUF_ARCHITECTURES.values()) <= set(MODEL_FAMILIES)


def test_every_listed_tensor_type_dequantizes():
    """The conversion's dequantizer (the gguf package's) knows each type it is promised."""
    import gguf
    from gguf.quants import dequantize

    for name in GGUF_TENSOR_TYPES:
        qtype = gguf.GGMLQuantizationType[name]
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((2, type_size), dtype=np.uint8) if name not in ("F32", "F16", "BF16") else None
        if raw is not None:
            assert dequantize(raw, qtype).shape == (2, block), name


def no_conversion(monkeypatch):
    def fail(*args):
        raise AssertionError("the conversion started")

    monkeypatch.setattr(gguf_convert, "_write_folder", fail)


def test_unsupported_architecture_fails_before_converting(tmp_path, monkeypatch):
    no_conversion(monkeypatch)
    path = write_gguf(tmp_path / "gpt2-small.gguf", "gpt2", {"token_embd.weight": np.zeros((4, 32), np.float32)})
    cache = tmp_path / "cache"
    with pytest.raises(ModelResolutionError) as error:
        resolve_model(str(path), cache_dir=str(cache))
    assert str(error.value) == (
        "gpt2-small.gguf: GGUF architecture 'gpt2' is not supported; "
        "supported: gemma3, gpt-oss, llama, mistral, phi3, qwen2, qwen2moe, qwen3, qwen3moe"
    )
    assert not cache.exists()


def test_unsupported_rope_scaling_fails_before_converting(tmp_path, monkeypatch):
    no_conversion(monkeypatch)
    path = write_gguf(tmp_path / "odd-rope.gguf", "llama", {"token_embd.weight": np.zeros((4, 32), np.float32)},
                      metadata={"llama.rope.scaling.type": "xpos"})
    with pytest.raises(ModelResolutionError) as error:
        resolve_model(str(path), cache_dir=str(tmp_path / "cache"))
    assert str(error.value) == "odd-rope.gguf: rope scaling type 'xpos' is not supported; supported: none, linear, yarn"


def test_unsupported_tensor_type_fails_before_converting(tmp_path, monkeypatch):
    no_conversion(monkeypatch)
    path = write_gguf(tmp_path / "ints.gguf", "llama", {
        "token_embd.weight": np.zeros((4, 32), np.float32),
        "blk.0.odd.weight": np.zeros(32, np.int32),
    })
    cache = tmp_path / "cache"
    with pytest.raises(ModelResolutionError, match=r"ints.gguf: tensor blk.0.odd.weight is of type I32, which cannot "
                                                   r"be dequantized; supported: F32, F16, BF16, Q4_0, .*Q4_K, Q5_K, Q6_K"):
        resolve_model(str(path), cache_dir=str(cache))
    assert not cache.exists()


def test_a_broken_gguf_fails_before_converting(tmp_path, monkeypatch):
    no_conversion(monkeypatch)
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    with pytest.raises(ModelResolutionError, match="broken.gguf is damaged or cut short"):
        resolve_model(str(path), cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()


def test_an_interrupted_conversion_removes_its_temporary_folder(tmp_path, monkeypatch):
    """SIGTERM reaches the converter as KeyboardInterrupt (cli.download_weights)."""
    path = write_gguf(tmp_path / "tiny.gguf", "llama", {"token_embd.weight": np.zeros((4, 32), np.float32)})
    cache = tmp_path / "cache"

    def interrupted(gguf_path, folder):
        assert folder.is_dir()
        (folder / "model.safetensors").write_bytes(b"\0" * 1024)
        raise KeyboardInterrupt("SIGTERM")

    monkeypatch.setattr(gguf_convert, "_write_folder", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gguf_convert.convert_gguf(path, cache)
    assert list(cache.iterdir()) == []


def test_temporary_folders_of_dead_conversions_on_this_host_are_removed(tmp_path):
    import os
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    host = gguf_convert._host()
    cache = tmp_path / "cache"
    folders = {
        "dead": cache / f".tmp-m-0123456789abcdef-{host}-{dead.pid}",
        "alive": cache / f".tmp-m-0123456789abcdef-{host}-{os.getpid()}",
        "other host": cache / f".tmp-m-0123456789abcdef-elsewhere-{dead.pid}",
        "converted": cache / "m-0123456789abcdef",
    }
    for folder in folders.values():
        folder.mkdir(parents=True)
    assert gguf_convert.remove_stale_tmp(cache) == [folders["dead"]]
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        folders[k].name for k in ("alive", "other host", "converted")
    )
