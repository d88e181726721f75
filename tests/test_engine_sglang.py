"""SGLangEngine: its launch command and /generate parsing (pure), the whole HTTP flow against a stand-in server
that speaks SGLang's routes (restart after kill -9 included), and a real SGLang server when one is installed."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from generators.engines.base import EngineError, SamplingParams
from generators.engines.managed import ServerOptions
from generators.engines.sglang import (
    SGLangEngine,
    _completion_from_generate,
    generate_body,
    launch_env,
    sglang_available,
)
from generators.precision import cpu_has_bf16

SGLANG_MISSING = sglang_available()
# Only the real-server tests need sglang; the reason shows in the skip summary (`-rs`/`-ra`).
needs_sglang = pytest.mark.skipif(SGLANG_MISSING is not None, reason=f"needs sglang: {SGLANG_MISSING}")
on_session_loop = pytest.mark.asyncio(loop_scope="session")

# A non-streaming /generate answer in the shape SGLang 0.5.x gives with return_logprob (tokenizer_manager.py):
# output_token_logprobs entries are [logprob, token_id, text] (text is null unless return_text_in_logprobs).
RECORDED_GENERATE = {
    "text": "Blue.",
    "output_ids": [12550, 30, 2],
    "meta_info": {
        "id": "8c1d0e6a4b7f4f7c9a3e2d1b0c9f8e7d",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 31,
        "weight_version": "3",
        "num_retractions": 0,
        "input_token_logprobs": [],
        "output_token_logprobs": [[-1.3862943, 12550, None], [-0.0512, 30, None], [-0.0009, 2, None]],
        "output_token_logprobs_length": 3,
        "reasoning_tokens": 0,
        "completion_tokens": 3,
        "cached_tokens": 0,
        "e2e_latency": 0.0831,
    },
}


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# --- pure: command line, environment, request body, response parsing ------------------------------------


def _command(engine: SGLangEngine, port: int) -> list[str]:
    engine._model_path = str(engine.model)  # start() resolves it
    return engine._command(port)


def test_launch_command_carries_every_option(tmp_path):
    options = ServerOptions(served_model_name="pol", host="0.0.0.0", port=31234, max_model_len=4096, dtype="float32",
                            extra_args=("--tp-size", "2"), log_path=tmp_path / "s.log")
    engine = SGLangEngine("/ckpt/model", options, mem_fraction_static=0.4, device="cpu", python="/opt/sgl/bin/python")
    argv = _command(engine, 31234)
    assert argv[:3] == ["/opt/sgl/bin/python", "-m", "sglang.launch_server"]
    assert _flag(argv, "--model-path") == "/ckpt/model" and _flag(argv, "--served-model-name") == "pol"
    assert _flag(argv, "--host") == "0.0.0.0" and _flag(argv, "--port") == "31234"
    assert _flag(argv, "--context-length") == "4096" and _flag(argv, "--dtype") == "float32"
    assert _flag(argv, "--mem-fraction-static") == "0.4" and _flag(argv, "--device") == "cpu"
    assert _flag(argv, "--weight-version") == "0" and "--disable-overlap-schedule" in argv
    assert argv[-2:] == ["--tp-size", "2"]
    assert engine.server.env == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false", "SGLANG_USE_CPU_ENGINE": "1"}
    assert engine.server.health_path == "/health_generate" and engine.server.log_path == tmp_path / "s.log"
    assert launch_env(None) == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}


def test_launch_command_defaults_leave_device_and_memory_to_sglang():
    argv = _command(SGLangEngine("/m"), 1)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert "--device" not in argv and "--mem-fraction-static" not in argv and "--disable-overlap-schedule" not in argv
    assert _flag(argv, "--served-model-name") == "policy" and _flag(argv, "--context-length") == "2048"
    assert _flag(argv, "--dtype") == "bfloat16"


def test_auto_dtype_is_bfloat16_on_an_accelerator_and_follows_the_cpu_on_the_cpu_backend():
    assert SGLangEngine("/ckpt", ServerOptions(dtype="auto")).dtype == "bfloat16"
    assert SGLangEngine("/ckpt", ServerOptions(dtype="auto"), device="cpu").dtype == \
        ("bfloat16" if cpu_has_bf16() else "float32")


def test_generate_body_maps_the_sampling_params():
    body = generate_body([1, 2, 3], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, stop=("\n",), seed=5))
    assert body == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 16, "temperature": 0.7, "top_p": 0.9, "stop": ["\n"],
                            "sampling_seed": 5},
        "return_logprob": True, "logprob_start_len": -1, "stream": False,
    }
    assert "stop" not in generate_body([1], SamplingParams())["sampling_params"]


def test_completion_from_a_recorded_generate_answer():
    c = _completion_from_generate(RECORDED_GENERATE, weight_version=0)
    assert c.token_ids == [12550, 30, 2]
    assert c.logprobs == pytest.approx([-1.3862943, -0.0512, -0.0009])
    assert c.finish_reason == "stop"
    assert c.weight_version == 3  # the server's, not the caller's


def test_completion_finish_reasons_and_version_fallback():
    def answer(finish, version="default"):
        return {"output_ids": [5], "meta_info": {"finish_reason": finish, "weight_version": version,
                                                 "output_token_logprobs": [[-0.5, 5, None]]}}

    assert _completion_from_generate(answer({"type": "length", "length": 1}), 7).finish_reason == "length"
    aborted = _completion_from_generate(answer({"type": "abort", "message": "Aborted", "status_code": None}), 7)
    assert aborted.finish_reason == "abort" and aborted.weight_version == 7
    assert _completion_from_generate(answer("stop", "12"), 7).weight_version == 12


@pytest.mark.parametrize("broken, match", [
    ({"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-0.1, 1, None]]}}, "do not match"),
    ({"output_ids": [1], "meta_info": {"output_token_logprobs": [[-0.1, 9, None]]}}, "do not match"),
    ({"output_ids": [1], "meta_info": {}}, "return_logprob"),
    ({"output_ids": [1], "meta_info": {"output_token_logprobs": [[None, 1, None]]}}, "non-finite"),
    ({"text": "x"}, "meta_info"),
])
def test_completion_rejects_inconsistent_answers(broken, match):
    with pytest.raises(EngineError, match=match):
        _completion_from_generate(broken, 0)


def test_sglang_available_finds_the_package_without_importing_it_and_says_why_when_it_cannot(tmp_path):
    """Run in fresh interpreters: one where a package named sglang is on the path (its import would raise, so it must
    be found without importing it), one where the import system cannot see any."""
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("raise RuntimeError('sglang was imported')\n")
    check = "from generators.engines.sglang import sglang_available; print(repr(sglang_available()))"

    def answer(prelude: str, path: str) -> str:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])}
        result = subprocess.run([sys.executable, "-c", prelude + check], capture_output=True, text=True, env=env,
                                timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout.strip()

    assert answer("", str(tmp_path)) == "None"
    hidden = answer("import sys; sys.modules['sglang'] = None; ", "")
    assert "sglang is not installed in" in hidden and "pip install sglang" in hidden, hidden


# --- the HTTP flow against a stand-in server --------------------------------------------------------------

# A tiny server that answers SGLang's routes the way SGLang does, started through the real launch command (a
# package named `sglang` on the server's PYTHONPATH). Its output ids depend on the loaded checkpoint, so a test
# can tell which weights it serves.
FAKE_LAUNCH_SERVER = textwrap.dedent('''
    import argparse, json, os
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    p = argparse.ArgumentParser()
    for flag in ("--model-path", "--host", "--port", "--served-model-name", "--weight-version"):
        p.add_argument(flag)
    args, _ = p.parse_known_args()
    state = {"model_path": args.model_path, "version": args.weight_version}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, obj, code=200):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health_generate":
                return self.reply({})
            if self.path == "/model_info":
                return self.reply({"model_path": state["model_path"], "weight_version": state["version"]})
            self.reply({"detail": "Not Found"}, 404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path == "/generate":
                n = body["sampling_params"]["max_new_tokens"]
                base = 100 if state["model_path"] == args.model_path else 500
                ids = [base + k for k in range(n)]
                return self.reply({"text": "", "output_ids": ids, "meta_info": {
                    "id": "r", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": 3,
                    "weight_version": state["version"], "completion_tokens": n,
                    "output_token_logprobs": [[-0.25, i, None] for i in ids]}})
            if self.path == "/update_weights_from_disk":
                if not os.path.isdir(body["model_path"]):
                    return self.reply({"success": False, "message": "no such dir", "num_paused_requests": 0}, 400)
                state["model_path"], state["version"] = body["model_path"], body["weight_version"]
                return self.reply({"success": True, "message": "ok", "num_paused_requests": 0})
            if self.path == "/v1/chat/completions":
                return self.reply({"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                                   "choices": [{"index": 0, "finish_reason": "stop",
                                                "message": {"role": "assistant", "content": "hello"}}],
                                   "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
            self.reply({"detail": "Not Found"}, 404)

    ThreadingHTTPServer((args.host, int(args.port)), Handler).serve_forever()
''')


def _checkpoint(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.fixture
def fake_sglang(tmp_path: Path) -> Path:
    package = tmp_path / "fake" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    return package.parent


@on_session_loop
async def test_engine_flow_and_restart_against_a_stand_in_server(fake_sglang, tmp_path):
    engine = SGLangEngine(_checkpoint(tmp_path / "base"), ServerOptions(log_path=tmp_path / "sglang.log",
                                                                        startup_timeout=30))
    engine.server.env["PYTHONPATH"] = str(fake_sglang)
    with pytest.raises(EngineError, match="not started"):
        await engine.generate([1, 2, 3], SamplingParams())
    async with engine:
        first = await engine.generate([1, 2, 3], SamplingParams(max_tokens=4))
        assert first.token_ids == [100, 101, 102, 103] and first.logprobs == [-0.25] * 4
        assert first.finish_reason == "length" and first.weight_version == 0
        assert await engine.server_weight_version() == "0"

        chat = await engine.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4))
        assert chat.content == "hello" and chat.completion_tokens == 1 and chat.weight_version == 0

        await engine.load_weights(_checkpoint(tmp_path / "step1"), version=1)
        after = await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))
        assert after.token_ids == [500, 501] and after.weight_version == engine.weight_version == 1
        assert await engine.server_weight_version() == "1"

        with pytest.raises(FileNotFoundError):
            await engine.load_weights(tmp_path / "missing", version=2)
        assert engine.weight_version == 1

        old_pid = engine.server.process.pid
        os.killpg(old_pid, signal.SIGKILL)  # the server crashes, helpers and watchdog too
        restarted = await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))
        assert engine.restarts == 1 and engine.server.process.pid != old_pid
        assert restarted.token_ids == [500, 501] and restarted.weight_version == 1  # the latest weights came back

        # Concurrent requests that hit a dead server share one restart and all see the restored weights.
        os.killpg(engine.server.process.pid, signal.SIGKILL)
        results = await asyncio.gather(*(engine.generate([1], SamplingParams(max_tokens=2)) for _ in range(8)))
        assert engine.restarts == 2 and all(r.token_ids == [500, 501] and r.weight_version == 1 for r in results)
    assert not engine.server.alive


@on_session_loop
async def test_no_restart_when_auto_restart_is_off(fake_sglang, tmp_path):
    engine = SGLangEngine(_checkpoint(tmp_path / "base"), ServerOptions(log_path=tmp_path / "sglang.log",
                                                                        startup_timeout=30, auto_restart=False))
    engine.server.env["PYTHONPATH"] = str(fake_sglang)
    async with engine:
        os.killpg(engine.server.process.pid, signal.SIGKILL)
        await engine.server.exited_within(5.0)
        with pytest.raises(EngineError, match="not running"):
            await engine.generate([1], SamplingParams(max_tokens=1))
        assert engine.restarts == 0


# --- a real SGLang server on the bundled model -------------------------------------------------------------


# SGLang's CPU backend needs telling; with a GPU, SGLang picks it itself.
REAL_DEVICE = None if Path("/dev/nvidiactl").exists() else "cpu"


@pytest.fixture(scope="module")
async def sglang_engine(bundled_model: Path):
    engine = SGLangEngine(bundled_model, ServerOptions(
        log_path=Path(os.environ["ENVKIT_CACHE_DIR"]) / "logs" / "sglang-tests.log"), device=REAL_DEVICE)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@needs_sglang
@on_session_loop
async def test_real_sglang_token_in_token_out(sglang_engine, chat_tokenizer):
    prompt = chat_tokenizer.prompt_ids([{"role": "user", "content": "Name a color."}])
    c = await sglang_engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=16))
    assert 0 < len(c.token_ids) <= 16 and len(c.logprobs) == len(c.token_ids)
    assert all(math.isfinite(lp) and lp <= 0 for lp in c.logprobs)
    assert c.finish_reason in ("stop", "length") and c.weight_version == 0
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    assert (await sglang_engine.generate(prompt, greedy)).token_ids == (
        await sglang_engine.generate(prompt, greedy)).token_ids


@needs_sglang
@on_session_loop
async def test_real_sglang_chat(sglang_engine):
    reply = await sglang_engine.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=16))
    assert isinstance(reply.content, str) and reply.content and reply.completion_tokens > 0


@needs_sglang
@on_session_loop
async def test_real_sglang_load_weights_bumps_the_version(sglang_engine, chat_tokenizer, bundled_model):
    prompt = chat_tokenizer.prompt_ids([{"role": "user", "content": "Name a color."}])
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    before = await sglang_engine.generate(prompt, greedy)
    version = sglang_engine.weight_version + 1
    await sglang_engine.load_weights(bundled_model, version=version)
    assert sglang_engine.weight_version == version
    assert await sglang_engine.server_weight_version() == str(version)
    after = await sglang_engine.generate(prompt, greedy)
    assert after.weight_version == version and after.token_ids == before.token_ids
