"""The supervised stage's data. Every source becomes :class:`Trajectory` objects, so SFT has the RL loop's token
layout, loss masks and micro-batches (``loss_mask`` 1 on the model's own tokens, 0 on prompts and env turns):

    demos         the run's env demonstrates its train tasks (``Env.demonstrate``), played for real by
                  ``Generator.demonstrate``; kept when the episode ended, every tool call ran, and the reward passed
    trajectories  JSONL written by ``envkit eval`` or a training run, filtered by reward, env and stop reason
                  (rejection sampling); refused when another tokenizer's ids are in them
    chat          rows with ``messages`` and optional ``tools``, checked whole before training starts and rendered
                  by the chat template, with tools where the generator puts them (generators/tool_prompt.py)
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envkit import Message
from generators import ChatTokenizer, Generator, Trajectory, read_jsonl
from generators.tool_prompt import ToolPrompt
from trainer.config import Config, ConfigError, SFTConfig
from trainer.sources import Mixture, dataset_tasks, generate_starts

log = logging.getLogger(__name__)

_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class SFTData:
    """The sequences to train on, those held out for the held-out loss, and what was read, kept and dropped."""

    train: list[Trajectory]
    held_out: list[Trajectory]
    counts: dict[str, int] = field(default_factory=dict)


def drop_reason(t: Trajectory, cfg: SFTConfig, *, clean_tools: bool = False) -> str | None:
    """Why the filter drops ``t`` (``failed``, ``tool_failure``, ``stop_reason``, ``env``, ``reward``: the first
    that applies), or None when it keeps it. ``clean_tools`` also drops an episode with a tool call that did not run
    cleanly (demonstrations)."""
    if t.failed or not any(t.loss_mask):
        return "failed"
    if clean_tools and any(entry["status"] != "ok" for entry in t.tool_log):
        return "tool_failure"
    if t.stop_reason not in cfg.stop_reasons:
        return "stop_reason"
    if cfg.envs and t.env_name not in cfg.envs:
        return "env"
    if cfg.min_reward is not None and t.reward < cfg.min_reward:
        return "reward"
    return None


def rejection_sample(trajectories: list[Trajectory], cfg: SFTConfig, *, clean_tools: bool = False,
                     prefix: str) -> tuple[list[Trajectory], Counter[str]]:
    """The trajectories :func:`drop_reason` keeps, and counts: ``PREFIX/read``, ``PREFIX/kept``,
    ``PREFIX/dropped_REASON``."""
    counts: Counter[str] = Counter({f"{prefix}/read": len(trajectories)})
    kept = []
    for t in trajectories:
        reason = drop_reason(t, cfg, clean_tools=clean_tools)
        if reason is None:
            kept.append(t)
        else:
            counts[f"{prefix}/dropped_{reason}"] += 1
    counts[f"{prefix}/kept"] = len(kept)
    return kept, counts


async def load_sft_data(cfg: Config, tokenizer: ChatTokenizer, envs: Mixture | None) -> SFTData:
    """The run's SFT data from ``cfg.sft.data``, split into train and held-out sequences (seeded)."""
    s = cfg.sft
    if s.data == "demos":
        if envs is None:
            raise ConfigError("sft.data=demos needs an env that demonstrates its tasks (env.name=...)")
        sequences, counts = await _demonstrations(cfg, tokenizer, envs)
    elif s.data == "trajectories":
        sequences, counts = _recorded(s, tokenizer)
    else:  # the tools go where the run's generator puts them, in the format its parser reads
        prompt = Generator(None, tokenizer, cfg.generator.generator_config()).tool_prompt
        sequences = _chat_rows(s.paths[0], tokenizer, prompt)
        counts = Counter({"chat/rows": len(sequences)})
    if not sequences:
        raise ConfigError(f"sft.data={s.data}: nothing to train on ({_describe(counts)})")
    order = list(range(len(sequences)))
    random.Random(cfg.trainer.seed).shuffle(order)
    held = max(1, round(s.eval_fraction * len(order))) if s.eval_fraction > 0 and len(order) >= 2 else 0
    data = SFTData([sequences[i] for i in order[held:]], [sequences[i] for i in order[:held]], dict(counts))
    log.info("sft data: %d sequences to train on, %d held out (%s)", len(data.train), len(data.held_out),
             _describe(counts))
    return data


def _describe(counts: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "no data"


async def _demonstrations(cfg: Config, tokenizer: ChatTokenizer, envs: Mixture
                          ) -> tuple[list[Trajectory], Counter[str]]:
    """Each env's first ``num_demos`` train starts (split among a mixture's envs by weight), demonstrated."""
    generator = Generator(None, tokenizer, cfg.generator.generator_config(samples_per_prompt=1))
    jobs = [generate_starts(generator, stream, [stream.train[i] for i in range(min(quota, len(stream.train)))],
                            demonstrate=True)
            for stream, quota in zip(envs.streams, envs.quotas(cfg.sft.num_demos), strict=True)]
    played = [t for trajectories in await asyncio.gather(*jobs) for t in trajectories]
    demo_filter = SFTConfig(min_reward=cfg.sft.min_reward)  # demonstrations must end ("done") with clean calls
    kept, counts = rejection_sample(played, demo_filter, clean_tools=True, prefix="demos")
    errors = sorted({t.error for t in played if t.error})
    if errors:
        log.warning("%d demonstrations failed; first errors: %s", counts["demos/dropped_failed"], errors[:3])
    if not kept and errors:
        raise ConfigError(f"no demonstration could be played ({_describe(counts)}); the env said: {errors[0]}")
    return kept, counts


def _recorded(s: SFTConfig, tokenizer: ChatTokenizer) -> tuple[list[Trajectory], Counter[str]]:
    """The trajectories of ``s.paths``, refused when another tokenizer wrote them, then filtered."""
    mine = tokenizer.fingerprint.rpartition("@")[2]
    trajectories: list[Trajectory] = []
    for path in s.paths:
        if not Path(path).is_file():
            raise ConfigError(f"sft.paths: {path} is not a file (trajectories JSONL, as envkit eval writes)")
        for line, t in enumerate(read_jsonl(path), 1):
            if t.tokenizer.rpartition("@")[2] != mine:
                written = f"the tokenizer {t.tokenizer}" if t.tokenizer else "a tokenizer it does not record"
                raise ConfigError(f"{path} line {line}: its token ids are {written}'s, not this model's "
                                  f"({tokenizer.fingerprint}): train on trajectories the same tokenizer wrote")
            trajectories.append(t)
    kept, counts = rejection_sample(trajectories, s, prefix="trajectories")
    return [sequence for t in kept for sequence in t.sequences()], counts  # an agent's episode: its segments


def _chat_rows(path: str, tokenizer: ChatTokenizer, prompt: ToolPrompt) -> list[Trajectory]:
    """Every row of the dataset at ``path``, checked (all before any is rendered) and rendered."""
    rows = dataset_tasks(path, {})
    chats = [_checked_row(row, i, path) for i, row in enumerate(rows)]
    return [render_chat(messages, tools, tokenizer, prompt, name=str(row["id"]))
            for (messages, tools), row in zip(chats, rows, strict=True)]


def _without_nulls(value: Any) -> Any:
    """``value`` without the null fields a columnar format adds where rows differ (a message's missing
    ``tool_calls``, a tool schema's missing property)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _checked_row(row: dict[str, Any], index: int, path: str) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """A row's messages and tools, or a ConfigError naming the row and what is wrong with it."""
    def bad(problem: str) -> ConfigError:
        return ConfigError(f"sft data {path} row {index}: {problem}")

    messages = _without_nulls(row.get("messages"))
    if not isinstance(messages, list) or not messages:
        raise bad("no 'messages' (a list of chat messages)")
    tools = _without_nulls(row.get("tools"))
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) and "function" in t
                                                                  for t in tools)):
        raise bad("'tools' must be a list of OpenAI function tools ({'type': 'function', 'function': {...}})")
    calls_open = False
    for i, m in enumerate(messages):
        problem = _message_problem(messages, i, calls_open=calls_open)
        if problem:
            raise bad(problem)
        calls_open = m["role"] == "tool" or (m["role"] == "assistant" and bool(m.get("tool_calls")))
    if not any(m["role"] == "assistant" for m in messages):
        raise bad("no assistant message: there is nothing to train on")
    return messages, tools


def _message_problem(messages: list[Any], i: int, *, calls_open: bool) -> str | None:
    """What is wrong with message ``i`` of a conversation whose earlier messages passed (``calls_open``: the one
    before it called a tool or was a tool result), or None."""
    m = messages[i]
    role = m.get("role") if isinstance(m, dict) else None
    if role not in _ROLES:
        return f"message {i} has role {role!r}; roles are {', '.join(_ROLES)}"
    if role == "system" and i > 0:
        return f"message {i} is a system message; only the first message may be one"
    first = 1 if messages[0]["role"] == "system" else 0
    if i == first and role != "user":
        return f"message {i} is {role}; the conversation must open with a user message (after the system one)"
    if role == "tool" and not calls_open:
        return f"message {i} is a tool result, but no assistant tool call precedes it"
    if not isinstance(m.get("content"), str) and not (role == "assistant" and m.get("tool_calls")):
        return f"message {i} ({role}) has no text content"
    return None


def render_chat(messages: list[Message], tools: list[dict[str, Any]] | None, tokenizer: ChatTokenizer,
                prompt: ToolPrompt, *, name: str = "") -> Trajectory:
    """One conversation as a trajectory: the messages before the first assistant turn are the prompt; each assistant
    turn's tokens (through its eos) get loss_mask 1; everything else, the template's turn suffixes included, 0.

    Each message's tokens are the difference between renderings with and without it, so the ids are what the chat
    template writes for the whole conversation (a template that rewrites earlier turns is refused)."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    chat, template_tools = prompt.apply(list(messages[:first]), tools)
    prompt_ids = tokenizer.prompt_ids(chat, template_tools)
    ids, mask = list(prompt_ids), []

    def extend(rendered: list[int], model: bool) -> None:
        if rendered[:len(ids)] != ids:
            raise ConfigError(f"sft data {name}: the chat template renders earlier turns differently once later ones "
                              "follow, so a turn's tokens are not well defined: use another template")
        new = rendered[len(ids):]
        end = len(new) - new[::-1].index(tokenizer.eos_id) if model and tokenizer.eos_id in new else len(new)
        ids.extend(new)
        mask.extend([int(model)] * end + [0] * (len(new) - end))

    for m in messages[first:last + 1]:
        if m["role"] == "assistant":
            extend(tokenizer.render(chat, template_tools), False)  # the generation prompt that opens the turn
        chat.append(prompt.as_written(m))
        extend(tokenizer.render(chat, template_tools, generation_prompt=False), m["role"] == "assistant")
    while mask and not mask[-1]:  # the template's suffix after the last turn: a rollout ends at the model's eos
        mask.pop()
        ids.pop()
    response = ids[len(prompt_ids):]
    return Trajectory(prompt_ids=prompt_ids, response_ids=response, loss_mask=mask,
                      rollout_logprobs=[0.0] * len(response), messages=chat, env_name="chat", task_id=name,
                      group_id=name, num_turns=sum(m["role"] == "assistant" for m in chat), policy_version=-1,
                      tokenizer=tokenizer.fingerprint)


def write_sft_data(data: SFTData, out: Path) -> Path:
    """The sequences as trained (train and held-out) in ``out/sft_data.jsonl``, and the counts beside them."""
    from generators import write_jsonl

    out.mkdir(parents=True, exist_ok=True)
    (out / "sft_data_counts.json").write_text(json.dumps(data.counts, indent=2) + "\n")
    return write_jsonl(data.train + data.held_out, out / "sft_data.jsonl")
