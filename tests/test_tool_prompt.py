"""Tool prompts: injected where a chat template drops ``tools=`` and left alone where it renders them, per real
template; every format's prompt and written calls read back by its own parser; prefix-exact ids in a rollout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import envkit
from generators import ChatTokenizer, Generator, GeneratorConfig
from generators.parsers import TOOL_PARSERS
from generators.tool_prompt import FORMATS, ToolPrompt, template_renders_tools, tool_prompt, write_calls

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
# Which of the vendored templates write tools= into the prompt (DeepSeek-R1's drops them, like SmolLM2's).
RENDERS_TOOLS = {"DeepSeek-R1-Distill-Qwen-32B": False, "Hermes-3-Llama-3.1-8B": True,
                 "Llama-3.1-8B-Instruct": True, "Llama-3.2-3B-Instruct": True, "Llama-4-pythonic-vllm": True,
                 "Mistral-Nemo-Instruct-2407": True, "Mistral-Small-3.2-24B-Instruct-2506": True,
                 "Qwen2.5-7B-Instruct": True, "Qwen3-0.6B": True, "Qwen3-Coder-30B-A3B-Instruct": True}
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a key up.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["key"]}}}]
OPENING = [envkit.system("Be brief."), envkit.user("What is the capital of France?")]


def _call(name: str, arguments: dict) -> envkit.ToolCall:
    return {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _tokenizer(chat_tokenizer: ChatTokenizer, template: str | None) -> ChatTokenizer:
    """The bundled tokenizer with another model's chat template (no model files are downloaded)."""
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer.tokenizer.name_or_path)
    if template is not None:
        tokenizer.chat_template = template
    return ChatTokenizer(tokenizer)


def test_every_vendored_template_is_classified() -> None:
    assert sorted(RENDERS_TOOLS) == sorted(p.name for p in TEMPLATES.iterdir() if p.is_dir())


@pytest.mark.parametrize("name", sorted(RENDERS_TOOLS))
def test_the_prompt_is_injected_exactly_where_the_template_drops_tools(name: str, chat_tokenizer) -> None:
    template = (TEMPLATES / name / "chat_template.jinja").read_text()
    tokenizer = _tokenizer(chat_tokenizer, template)
    assert template_renders_tools(tokenizer.tokenizer) is RENDERS_TOOLS[name]
    generator = Generator(None, tokenizer, GeneratorConfig())
    messages, template_tools = generator.tool_prompt.apply(OPENING, TOOLS)
    text = tokenizer.tokenizer.decode(tokenizer.prompt_ids(messages, template_tools))
    assert "lookup" in text  # the model is told about the tool either way...
    if RENDERS_TOOLS[name]:  # ...by its own template, which is left alone
        assert (messages, template_tools) == (OPENING, TOOLS) and "# Tools\n\nYou may call these" not in text
    else:  # ...or by the prompt written into the system message, once, in the parser's format
        assert template_tools is None and messages[1:] == OPENING[1:]
        assert messages[0]["content"].startswith("Be brief.\n\n# Tools") and text.count('"name": "lookup"') == 2
        assert text.count("<tools>\n") == 1


def test_the_bundled_template_drops_tools_and_gets_the_prompt(chat_tokenizer) -> None:
    assert not template_renders_tools(chat_tokenizer.tokenizer)
    bare = chat_tokenizer.tokenizer.decode(chat_tokenizer.prompt_ids(OPENING, TOOLS))
    assert "lookup" not in bare  # what the issue measured: tools= alone tells this model nothing
    auto = Generator(None, chat_tokenizer, GeneratorConfig()).tool_prompt
    assert auto == ToolPrompt(inject=True, to_template=False, fmt="hermes")
    for setting, expected in (("template", (OPENING, TOOLS)), ("none", (OPENING, None))):
        prompt = Generator(None, chat_tokenizer, GeneratorConfig(tool_prompt=setting)).tool_prompt
        assert prompt.apply(OPENING, TOOLS) == expected
    no_system = auto.apply(OPENING[1:], TOOLS)[0]
    assert no_system[0] == {"role": "system", "content": tool_prompt(TOOLS, "hermes")} and no_system[1:] == OPENING[1:]
    assert auto.apply(OPENING, None) == (OPENING, None)  # an env without tools: nothing to write


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_written_calls_read_back_with_the_same_parser(fmt: str) -> None:
    assert sorted(FORMATS) == sorted(TOOL_PARSERS)
    calls = [_call("lookup", {"key": 'say "hi"\nthen {x}', "limit": 3}), _call("lookup", {"key": "ü/\\", "limit": -1})]
    parsed, errors = TOOL_PARSERS[fmt](write_calls(calls, fmt), TOOLS)
    assert errors == []
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    example = tool_prompt(TOOLS, fmt).split(FORMATS[fmt].how + "\n", 1)[1].rsplit("\nTheir results", 1)[0]
    parsed, errors = TOOL_PARSERS[fmt](example, TOOLS)  # the prompt's example is a call its parser reads
    assert errors == [] and [c["function"]["name"] for c in parsed] == ["lookup"]


def test_an_unknown_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="tool_prompt must be one of auto, template, inject, none"):
        GeneratorConfig(tool_prompt="system")


class Lookup(envkit.ToolEnv):
    """A tool env that demonstrates its one task: look the key up, then answer with what came back."""

    @envkit.tool
    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: what to look up
        """
        return {"france": "Paris"}.get(key, "unknown")

    async def start_episode(self, *, seed, task):
        return [envkit.system("Be brief."), envkit.user("What is the capital of France?")], {}

    async def grade(self, answer):
        return float("Paris" in answer), {}

    async def demonstrate(self, messages):
        results = [m for m in messages if m["role"] == "tool"]
        if results:
            return envkit.assistant(f"It is {results[-1]['content']}.")
        return envkit.assistant("Let me look.", [_call("lookup", {"key": "france"})])


async def test_a_demonstration_is_played_prefix_exact_with_the_injected_prompt(chat_tokenizer) -> None:
    generator = Generator(None, chat_tokenizer, GeneratorConfig(max_tokens=64))
    [t] = await generator.demonstrate(lambda: envkit.make("test_tool_prompt:Lookup"), seeds=[0])
    assert (t.stop_reason, t.reward, t.error, t.policy_version) == ("done", 1.0, None, -1)
    assert t.tool_log == [{"turn": 1, "name": "lookup", "status": "ok"}] and t.tool_calls == 1
    assert t.tokenizer == chat_tokenizer.fingerprint and t.template_mismatches == 0
    assert "# Tools" in t.messages[0]["content"] and '"lookup"' in t.messages[0]["content"]
    # the running ids are what the template renders for the whole chat as the model wrote it
    written = [{"role": m["role"], "content": m["content"]} for m in t.messages]
    assert t.prompt_ids + t.response_ids == chat_tokenizer.render(written, generation_prompt=False)[:-1]
    model = chat_tokenizer.tokenizer.decode([i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m])
    assert model == ('Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "france"}}\n</tool_call>'
                     "<|im_end|>It is Paris.<|im_end|>")


async def test_an_env_without_demonstrations_fails_each_rollout_saying_so(chat_tokenizer) -> None:
    generator = Generator(None, chat_tokenizer, GeneratorConfig())
    [t] = await generator.demonstrate(lambda: envkit.make("calculator"), seeds=[0])
    assert t.failed and "offers no demonstrations" in (t.error or "")
    with pytest.raises(ValueError, match="can only play demonstrations"):
        await generator.generate(lambda: envkit.make("calculator"), seeds=[0])
