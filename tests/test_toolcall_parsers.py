"""Tool calls and reasoning as real models write them: each format's parser on the chat templates those models ship
(tests/data/chat_templates), auto-detection from the template, malformed calls as feedback for the model (never an
exception, never executed), and ``<think>`` reasoning kept out of what the env sees without touching token ids."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import envkit
from envkit.cli import build_parser
from envkit.errors import InvalidActionError
from envkit.messages import validate_action
from generators.chat import ChatTokenizer
from generators.engines.base import ChatCompletion, Completion, InferenceEngine, SamplingParams
from generators.eval import config_from_args
from generators.parsers import TOOL_PARSERS, OutputParser, detect_tool_parser, split_reasoning
from generators.report import trajectory_html
from generators.rollout import Generator, GeneratorConfig
from generators.trajectory import Trajectory

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city for the next days.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
QUESTION = {"role": "user", "content": "Weather and time in Paris?"}


@dataclass(frozen=True)
class Model:
    """A real chat template, what auto-detection must make of it, and the model's own bos/eos tokens."""

    dir: str
    tool_parser: str
    think: bool = False
    opened: bool = False
    """The generation prompt opens <think>."""
    bos: str = ""
    eos: str = "<|im_end|>"
    parallel: bool = True
    """The template renders several calls in one turn (Llama 3.x's refuse)."""

    @property
    def template(self) -> str:
        return (TEMPLATES / self.dir / "chat_template.jinja").read_text()


LLAMA3 = {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "parallel": False}
MISTRAL = {"bos": "<s>", "eos": "</s>"}
MODELS = [
    Model("Qwen3-0.6B", "hermes", think=True),
    Model("Qwen2.5-7B-Instruct", "hermes"),
    Model("Hermes-3-Llama-3.1-8B", "hermes", bos="<|begin_of_text|>"),
    Model("DeepSeek-R1-Distill-Qwen-32B", "hermes", think=True, opened=True, bos="<｜begin▁of▁sentence｜>",
          eos="<｜end▁of▁sentence｜>"),
    Model("Llama-3.1-8B-Instruct", "llama3_json", **LLAMA3),
    Model("Llama-3.2-3B-Instruct", "llama3_json", **LLAMA3),
    Model("Mistral-Nemo-Instruct-2407", "mistral", **MISTRAL),
    Model("Mistral-Small-3.2-24B-Instruct-2506", "mistral", **MISTRAL),
    Model("Qwen3-Coder-30B-A3B-Instruct", "qwen3_coder"),
    Model("Llama-4-pythonic-vllm", "pythonic", bos="<|begin_of_text|>", eos="<|eot|>"),
]
# DeepSeek-R1's own call format (<｜tool▁calls▁begin｜>) is none of ours: it is here for its <think> prompt
WITH_CALLS = [m for m in MODELS if not m.dir.startswith("DeepSeek")]


def _tokenizer_with(chat_tokenizer: ChatTokenizer, template: str) -> ChatTokenizer:
    """The bundled tokenizer with another model's chat template (rendering needs no vocabulary of that model)."""
    raw = copy.deepcopy(chat_tokenizer.tokenizer)
    raw.chat_template = template
    return ChatTokenizer(raw)


def _render(chat_tokenizer: ChatTokenizer, model: Model, messages: list[dict[str, Any]], *,
            generation_prompt: bool) -> str:
    return chat_tokenizer.tokenizer.apply_chat_template(
        messages, tools=TOOLS, chat_template=model.template, tokenize=False, add_generation_prompt=generation_prompt,
        bos_token=model.bos, eos_token=model.eos)


def _completion(chat_tokenizer: ChatTokenizer, model: Model, assistant: dict[str, Any]) -> str:
    """What the model wrote for ``assistant``: the template's rendering of it after the generation prompt, up to
    the eos that ends the model's turn (the rollout's decode drops it)."""
    prompt = _render(chat_tokenizer, model, [QUESTION], generation_prompt=True)
    full = _render(chat_tokenizer, model, [QUESTION, assistant], generation_prompt=False)
    assert full.startswith(prompt), (prompt[-200:], full[-400:])
    return full[len(prompt):].partition(model.eos)[0]


def _calls(message: envkit.Message) -> list[tuple[str, dict[str, Any]]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]


# ---- (a) auto-detection on real templates ---------------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.dir)
def test_auto_detection_reads_each_real_template(chat_tokenizer: ChatTokenizer, model: Model) -> None:
    tok = _tokenizer_with(chat_tokenizer, model.template)
    parser = OutputParser.for_template(tok.template, tok.generation_prompt)
    assert (parser.tool_parser, parser.think, parser.think_opened) == (model.tool_parser, model.think, model.opened)


def test_detection_falls_back_to_hermes_and_chat_mode_splits_tagged_reasoning() -> None:
    assert detect_tool_parser(None) == detect_tool_parser("{{ messages }}") == "hermes"
    assert OutputParser.for_template(None) == OutputParser("hermes", think=True, think_opened=False)
    plain = OutputParser.for_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not plain.think


def test_explicit_settings_override_the_template() -> None:
    qwen3 = (TEMPLATES / "Qwen3-0.6B" / "chat_template.jinja").read_text()
    parser = OutputParser.for_template(qwen3, tool_parser="pythonic", reasoning_parser="none")
    assert (parser.tool_parser, parser.think) == ("pythonic", False)
    with pytest.raises(ValueError, match="tool_parser must be one of hermes, llama3_json, mistral, qwen3_coder, "
                                         "pythonic, got 'hermez'"):
        OutputParser.for_template(qwen3, tool_parser="hermez")
    with pytest.raises(ValueError, match="reasoning_parser must be one of auto, think, none, got 'deepseek'"):
        OutputParser.for_template(qwen3, reasoning_parser="deepseek")


# ---- (b) round trip: a template's rendering of tool calls parses back to the same calls --------------------------

@pytest.mark.parametrize("model", WITH_CALLS, ids=lambda m: m.dir)
def test_calls_rendered_by_the_real_template_parse_back(chat_tokenizer: ChatTokenizer, model: Model) -> None:
    # the pythonic template quotes every value, so only strings survive it
    weather = {"city": "Paris", "days": "3"} if model.tool_parser == "pythonic" else {"city": "Paris", "days": 3}
    wanted = [("get_weather", weather), ("get_time", {"city": "Paris"})][: 2 if model.parallel else 1]
    ids = ["abcdefghi", "jklmnopqr"]  # Mistral's templates want 9 alphanumerics
    assistant = {"role": "assistant", "content": "", "tool_calls": [
        {"id": i, "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in zip(ids, wanted, strict=False)]}
    text = _completion(chat_tokenizer, model, assistant)
    parser = OutputParser.for_template(model.template)
    message = parser.parse(text, TOOLS)
    assert _calls(message) == wanted, text
    assert "tool_call_errors" not in message
    if model.tool_parser == "mistral":  # tool results must answer with ids the template accepts
        assert [c["id"] for c in message["tool_calls"]] == ids[: len(wanted)]


def test_string_arguments_as_a_template_renders_them_parse_back(chat_tokenizer: ChatTokenizer) -> None:
    """Trajectories hold OpenAI arguments (a JSON string); Llama's template writes that string as the value."""
    model = next(m for m in MODELS if m.dir == "Llama-3.2-3B-Instruct")
    assistant = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    text = _completion(chat_tokenizer, model, assistant)
    assert '"parameters": "{' in text
    assert _calls(OutputParser("llama3_json").parse(text, TOOLS)) == [("get_weather", {"city": "Oslo"})]


def test_qwen3_reasoning_round_trips_and_calls_inside_it_are_not_made(chat_tokenizer: ChatTokenizer) -> None:
    model = MODELS[0]
    thought = 'Maybe <tool_call>{"name": "delete_all", "arguments": {}}</tool_call>? No: look the weather up.'
    assistant = {"role": "assistant", "content": "Checking.", "reasoning_content": thought, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    text = _completion(chat_tokenizer, model, assistant)
    assert text.startswith("<think>\n") and "delete_all" in text
    message = OutputParser.for_template(model.template).parse(text, TOOLS)
    assert message["reasoning_content"] == thought
    assert message["content"].startswith("Checking.") and "delete_all" not in message["content"]
    assert _calls(message) == [("get_weather", {"city": "Paris"})]
    unsplit = OutputParser.for_template(model.template, reasoning_parser="none").parse(text, TOOLS)
    assert [name for name, _ in _calls(unsplit)] == ["delete_all", "get_weather"]  # what "none" means


def test_a_prompt_that_opens_think_makes_the_text_before_the_close_reasoning(chat_tokenizer: ChatTokenizer) -> None:
    model = next(m for m in MODELS if m.opened)
    tok = _tokenizer_with(chat_tokenizer, model.template)
    assert tok.generation_prompt.endswith("<think>\n")
    parser = OutputParser.for_template(tok.template, tok.generation_prompt)
    done = parser.parse("2 + 2 is 4.\n</think>\n\nThe answer is 4.")
    assert (done["reasoning_content"], done["content"]) == ("2 + 2 is 4.", "The answer is 4.")
    cut_off = parser.parse('Still thinking <tool_call>{"name": "get_time", "arguments": {"city": "Rome"}}')
    assert cut_off["content"] == "" and "tool_calls" not in cut_off
    assert cut_off["reasoning_content"].startswith("Still thinking")


@pytest.mark.parametrize(("text", "split"), [
    ("<think>\na\n</think>\n\nb", ("a", "b")),
    ("no tags", (None, "no tags")),
    ("x <think>cut", ("cut", "x")),
    ("<think>one</think>mid<think>two</think>end", ("onemidtwo", "end")),
])
def test_split_reasoning(text: str, split: tuple[str | None, str]) -> None:
    assert split_reasoning(text) == split


# ---- (c) malformed calls: errors for the model, never exceptions, never executed ---------------------------------

MALFORMED = [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par', "not valid JSON"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', "not valid JSON"),
    ("llama3_json", '<|python_tag|>get_weather(city="Paris")', 'write {"name": "...", "parameters": {...}}'),
    ("llama3_json", '{"name": 7, "parameters": {}}', 'needs an object with a "name" string'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": ', "not valid JSON"),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', "not valid JSON"),
    ("mistral", "[TOOL_CALLS]get_weather(city=Paris)", "neither name[ARGS]{...} nor a JSON list"),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": [1]}]', "arguments must be a JSON object"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", "cut off before </function>"),
    ("qwen3_coder", '<tool_call>{"name": "get_weather"}</tool_call>', "no <function=NAME> inside"),
    ("pythonic", '[get_weather(city="Paris"', "not a valid Python list"),
    ("pythonic", '[get_weather("Paris")]', "pass every argument by keyword"),
    ("pythonic", "[get_weather(city=CITY)]", "CITY is not a literal"),
    ("pythonic", "[__import__('os').system('touch {marker}')]", "is not a plain function name"),
    ("pythonic", "[get_weather(city=__import__('os').system('touch {marker}'))]", "is not a literal"),
    ("pythonic", "[get_weather(city=open('{marker}', 'w'))]", "is not a literal"),
]


@pytest.mark.parametrize(("fmt", "text", "problem"), MALFORMED, ids=[f"{f}-{i}" for i, (f, *_) in enumerate(MALFORMED)])
def test_malformed_calls_become_errors_not_exceptions(fmt: str, text: str, problem: str, tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    calls, errors = TOOL_PARSERS[fmt](text.replace("{marker}", str(marker)), TOOLS)
    assert calls == [] and len(errors) == 1 and problem in errors[0], errors
    assert errors[0].startswith("tool call")
    assert not marker.exists()  # read with ast, never evaluated


def test_garbage_never_raises() -> None:
    garbage = ["", "[", "]", "{", "[TOOL_CALLS]", "[TOOL_CALLS][", "<tool_call>", "<function=", "<|python_tag|>",
               "[f(" * 500, "[" * 10_000, '{"name": "x", "parameters": ' * 300, "<tool_call><function=f>" * 50,
               "[f(x=" + "[" * 300 + "]" * 300 + ")]", "[TOOL_CALLS]f[ARGS]" + "[" * 5000,
               '{"name": "x", "parameters": "' + "[" * 5000 + '"}', "[f(x='" + "[" * 5000 + "')]"]
    for text in garbage:
        for parse in TOOL_PARSERS.values():
            calls, errors = parse(text, TOOLS)
            assert isinstance(calls, list) and all(isinstance(e, str) for e in errors)


def test_text_that_is_an_answer_is_not_a_call() -> None:
    for fmt, answer in [("llama3_json", "The answer is 42."), ("pythonic", "Per [1] (see above) it is 42."),
                        ("mistral", "It is 42."), ("qwen3_coder", "It is 42."), ("hermes", "It is 42.")]:
        assert TOOL_PARSERS[fmt](answer, TOOLS) == ([], [])


def test_qwen3_coder_types_values_by_the_schema_else_json_else_text() -> None:
    schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"}, "tags": {"type": "array"},
        "opts": {"type": "object"}, "s": {"type": "string"}, "maybe": {"type": ["integer", "null"]},
        "bad": {"type": "integer"}}}}}
    params = {"n": "3", "x": "2.5", "ok": "True", "tags": "['a', 'b']", "opts": '{"k": 1}', "s": "007",
              "maybe": "null", "bad": "three", "free": "[1, 2]", "text": "hello world"}
    text = "<tool_call>\n<function=f>\n" + "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items()) + "</function>\n</tool_call>"
    [call], errors = TOOL_PARSERS["qwen3_coder"](text, [schema])
    assert errors == []
    assert json.loads(call["function"]["arguments"]) == {
        "n": 3, "x": 2.5, "ok": True, "tags": ["a", "b"], "opts": {"k": 1}, "s": "007", "maybe": None,
        "bad": "three", "free": [1, 2], "text": "hello world"}


def test_llama3_json_reads_several_calls_and_the_python_tag() -> None:
    text = '<|python_tag|>{"name": "get_time", "parameters": {"city": "Rome"}}; ' \
           '{"name": "get_weather", "arguments": {"city": "Oslo"}}<|eom_id|>'
    calls, errors = TOOL_PARSERS["llama3_json"](text, TOOLS)
    assert errors == [] and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]


def test_pythonic_reads_only_literals() -> None:
    text = '<|python_start|>[get_weather(city="Paris", days=-2, when=[1, 2.5], opts={"a": None}, hot=true)]' \
           '<|python_end|>'
    [call], errors = TOOL_PARSERS["pythonic"](text, TOOLS)
    assert errors == [] and json.loads(call["function"]["arguments"]) == {
        "city": "Paris", "days": -2, "when": [1, 2.5], "opts": {"a": None}, "hot": True}


def test_a_pythonic_call_named_eval_is_only_a_name(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    [call], errors = TOOL_PARSERS["pythonic"](f"[eval(source=\"__import__('os').system('touch {marker}')\")]", TOOLS)
    assert errors == [] and call["function"]["name"] == "eval"  # the env answers "unknown tool"
    assert not marker.exists()


@pytest.mark.parametrize("fmt", list(TOOL_PARSERS))
async def test_every_formats_errors_reach_the_model_through_tool_env(fmt: str) -> None:
    """ToolEnv gets the calls and the errors with the action, so a malformed call next to a good one is reported
    and the good one still runs (envkit itself reads only the <tool_call> form)."""
    good = {"hermes": '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>\n'
                      '<tool_call>{"name": "calculator", "arguments": </tool_call>',
            "llama3_json": '{"name": "calculator", "parameters": {"expression": "6*7"}}; {"name": 1}',
            "mistral": '[TOOL_CALLS]calculator[ARGS]{"expression": "6*7"}[TOOL_CALLS]calculator[ARGS]{"expr',
            "qwen3_coder": "<tool_call>\n<function=calculator>\n<parameter=expression>\n6*7\n</parameter>\n"
                           "</function>\n</tool_call>\n<tool_call>\n<function=calculator>\n<parameter=exp",
            "pythonic": '[calculator(expression="6*7"), calculator(expression=x)]'}[fmt]
    action = OutputParser(fmt).parse(good)
    env = envkit.make("calculator")
    await env.reset(task={"id": "t", "question": "What is 6*7?", "answer": 42})
    result = await env.step(action)
    assert not result.done and result.info["tool_calls"] == 1 and result.info["tool_call_errors"] == 1
    tool, feedback = result.observation
    assert tool["role"] == "tool" and tool["content"] == "42"
    assert feedback["role"] == "user" and feedback["content"].startswith("Malformed tool call: tool call 1")
    assert ("<tool_call>{" in feedback["content"]) == (fmt == "hermes")  # advice in the model's format only


def test_actions_with_reasoning_and_errors_are_validated() -> None:
    ok = envkit.assistant("", None)
    ok.update(reasoning_content="why", tool_call_errors=["tool call 0: bad"])
    assert validate_action(ok) is ok
    with pytest.raises(InvalidActionError, match="reasoning_content must be a string"):
        validate_action({"role": "assistant", "content": "x", "reasoning_content": 3})
    with pytest.raises(InvalidActionError, match="tool_call_errors must be a list of strings"):
        validate_action({"role": "assistant", "content": "x", "tool_call_errors": "bad"})


def test_chat_mode_keeps_the_endpoints_own_calls_and_reasoning() -> None:
    native = [{"id": "x1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Rome"}'}}]
    parser = OutputParser.for_template(None)
    message = parser.parse('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', TOOLS,
                           native_calls=native, reasoning="the server split this off")
    assert message["tool_calls"] == native and message["reasoning_content"] == "the server split this off"
    tagged = parser.parse('<think>hmm</think>{"a": 1}')
    assert (tagged["reasoning_content"], tagged["content"]) == ("hmm", '{"a": 1}')


# ---- (d) reasoning in a rollout: the env sees content without it; the token ids are the sampler's ---------------

async def test_reasoning_split_leaves_a_real_rollouts_tokens_alone(chat_tokenizer: ChatTokenizer,
                                                                    bundled_model: Path) -> None:
    """The bundled model under DeepSeek-R1's template (its prompt opens <think>): the same greedy rollout with the
    reasoning split off and without it has the same ids and logprobs; only the message the env saw differs."""
    from generators.engines.hf import HFEngine

    model = next(m for m in MODELS if m.opened)
    tok = _tokenizer_with(chat_tokenizer, model.template)
    task = {"id": "t", "question": "What is 2 + 2?", "answer": 4}
    runs: dict[str, Trajectory] = {}
    async with HFEngine(bundled_model) as engine:
        for setting in ("think", "none"):
            config = GeneratorConfig(temperature=0.0, max_tokens=12, max_turns=1, reasoning_parser=setting)
            [runs[setting]] = await Generator(engine, tok, config).generate(
                lambda: envkit.make("arithmetic"), tasks=[task])
    think, none = runs["think"], runs["none"]
    assert think.error is None and think.response_ids and think.loss_mask == [1] * len(think.response_ids)
    assert (think.prompt_ids, think.response_ids, think.rollout_logprobs) == \
        (none.prompt_ids, none.response_ids, none.rollout_logprobs)
    text = tok.decode(think.response_ids)
    assert none.messages[-1]["content"] == text and "reasoning_content" not in none.messages[-1]
    assert think.messages[-1]["content"] == "" and think.messages[-1]["reasoning_content"] == text.strip()
    assert json.loads(json.dumps(think.to_json()))["messages"][-1]["reasoning_content"] == text.strip()
    assert "reasoning" in trajectory_html(0, think, 1.0)


class Replay(InferenceEngine):
    """Plays back fixed model turns as token ids: the bundled 135M model cannot be made to write <think> blocks and
    Qwen3-style calls, and what is under test is the loop around the engine, with the real tokenizer and template."""

    model_name = "replay"

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns = list(turns)

    @property
    def base_url(self) -> str:
        return "replay://"

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        ids = self.turns.pop(0)
        return Completion(ids, [-0.25] * len(ids), "stop")

    async def chat(self, messages: list[dict[str, Any]], sampling: SamplingParams,
                   tools: list[dict[str, Any]] | None = None) -> ChatCompletion:
        raise NotImplementedError


async def test_a_thinking_tool_rollout_under_qwen3s_template(chat_tokenizer: ChatTokenizer) -> None:
    """Qwen3's template on the bundled (ChatML) tokenizer: the call inside <think> is not made, the one after is; the
    env grades the answer without the reasoning; the model's ids are in the trajectory as sampled, and re-rendering
    the chat as the model wrote it reproduces the running ids (no template mismatch from the split)."""
    tok = _tokenizer_with(chat_tokenizer, MODELS[0].template)
    written = [
        '<think>\nFirst <tool_call>\n{"name": "calculator", "arguments": {"expression": "1/0"}}\n</tool_call>? '
        'No.\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>',
        "<think>\nThe tool said 42.\n</think>\n\nThe answer is 42.",
    ]
    turns = [[*tok.tokenizer.encode(text, add_special_tokens=False), tok.eos_id] for text in written]
    task = {"id": "t", "question": "What is 6*7?", "answer": 42}
    [traj] = await Generator(Replay(turns), tok, GeneratorConfig(temperature=0.0, max_turns=3)).generate(
        lambda: envkit.make("calculator"), tasks=[task])
    assert traj.error is None and traj.stop_reason == "done" and traj.reward == 1.0
    assert traj.template_mismatches == 0
    model_ids = [i for i, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m]
    assert model_ids == turns[0] + turns[1]
    first, tool, second = (m for m in traj.messages[2:] if m["role"] in ("assistant", "tool"))
    assert "1/0" in first["reasoning_content"] and "1/0" not in first["content"]
    assert _calls(first) == [("calculator", {"expression": "6*7"})] and tool["content"] == "42"
    assert (second["content"], second["reasoning_content"]) == ("The answer is 42.", "The tool said 42.")


# ---- configuration ---------------------------------------------------------------------------------------------

def test_generator_config_names_the_choices() -> None:
    with pytest.raises(ValueError, match="tool_parser must be one of auto, hermes, llama3_json, mistral, "
                                         "qwen3_coder, pythonic, got 'qwen'"):
        GeneratorConfig(tool_parser="qwen")
    with pytest.raises(ValueError, match="reasoning_parser must be one of auto, think, none, got 'r1'"):
        GeneratorConfig(reasoning_parser="r1")


def test_trainer_and_eval_share_the_setting() -> None:
    import trainer
    from trainer.config import ConfigError

    cfg = trainer.compose(["generator.tool_parser=mistral", "generator.reasoning_parser=none"])
    assert (cfg.generator.tool_parser, cfg.generator.reasoning_parser) == ("mistral", "none")
    assert cfg.generator.generator_config(temperature=0.0).tool_parser == "mistral"
    with pytest.raises(ConfigError, match=r"generator\.tool_parser must be one of auto, hermes, .*got 'bogus'"):
        trainer.compose(["generator.tool_parser=bogus"])
    args = build_parser().parse_args(["eval", "calculator", "--tool-parser", "qwen3_coder",
                                      "--reasoning-parser", "think"])
    rollout = config_from_args(args).rollout
    assert (rollout.tool_parser, rollout.reasoning_parser) == ("qwen3_coder", "think")
    assert config_from_args(build_parser().parse_args(["eval", "calculator"])).rollout.tool_parser == "auto"


def test_the_bundled_model_keeps_todays_hermes_reading(chat_tokenizer: ChatTokenizer) -> None:
    parser = Generator(Replay([]), chat_tokenizer).parser
    assert parser == OutputParser("hermes", think=False, think_opened=False)
