"""Session-wide real components, started once: the bundled model, its tokenizer, one vLLM server."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("ENVKIT_CACHE_DIR", str(REPO / ".cache"))
# A test that needs one of these is end-to-end whether or not its module says so: `make test-fast` leaves it out.
HEAVY_FIXTURES = {"vllm_engine", "docker_client"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses the vLLM server or the Docker engine (directly or through a fixture) ``e2e``."""
    for item in items:
        if HEAVY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


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


@pytest.fixture(scope="session")
def docker_client():
    """The real Docker engine (brought up once, as `make docker-up` does) and, at session end, the check that no
    container this test process started is left (`docker ps -a --filter label=org.envkit.owner=<this process>`)."""
    from sandboxes.base import owner_id
    from sandboxes.docker import OWNER_LABEL
    from sandboxes.engine import docker_client as make_client
    from sandboxes.engine import up

    try:
        up()
    except SystemExit as e:  # no engine and no way to install one (not root, not Debian): nothing to test against
        pytest.skip(f"Docker cannot run here: {e}")
    client = make_client(timeout_s=600)
    yield client
    left = client.containers.list(all=True, ignore_removed=True, filters={"label": f"{OWNER_LABEL}={owner_id()}"})
    for container in left:
        container.remove(force=True)
    client.close()
    assert not left, f"containers left behind by this test session: {[c.name for c in left]}"


@pytest.fixture(scope="session")
def arithmetic_image(docker_client) -> str:
    """The `arithmetic` env image, built once per session (a no-op when its inputs did not change)."""
    from sandboxes.images import build

    return build("arithmetic", client=docker_client).tag


@pytest.fixture(scope="session")
def code_image(docker_client) -> str:
    """The `code` env image, built once per session (a no-op when its inputs did not change)."""
    from sandboxes.images import build

    return build("code", client=docker_client).tag
