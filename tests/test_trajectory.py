"""Trajectory: JSONL round trip, consistency checks, padded and packed tensor views."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import envkit
from generators.engines.base import ChatCompletion, Completion, InferenceEngine, SamplingParams
from generators.rollout import Generator, GeneratorConfig
from generators.trajectory import Trajectory, read_jsonl, write_jsonl
from trainer.batching import micro_batches, mini_batch_order, stack_rows, to_packed, to_padded


def _traj(prompt: list[int], response: list[int], mask: list[int], **kw) -> Trajectory:
    logprobs = [-0.5 * (i + 1) if m else 0.0 for i, m in enumerate(mask)]
    return Trajectory(prompt_ids=prompt, response_ids=response, loss_mask=mask, rollout_logprobs=logprobs, **kw)


def test_jsonl_round_trip_is_exact(tmp_path):
    trajs = [
        _traj([1, 2], [3, 4, 5], [1, 0, 1], reward=1.0, step_rewards=[0.0, 1.0], num_turns=2, task_id="t-1",
              group_id="t-1", messages=[{"role": "user", "content": "hi <b>"}], timings={"total": 0.5}),
        Trajectory(stop_reason="error", error="EnvError: boom", seed=7),
    ]
    path = write_jsonl(trajs, tmp_path / "out" / "t.jsonl")
    assert list(read_jsonl(path)) == trajs
    assert not (tmp_path / "out" / "t.jsonl.tmp").exists()
    assert [json.loads(line)["stop_reason"] for line in path.read_text().splitlines()] == ["done", "error"]


def test_from_json_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown Trajectory fields: \\['rewardz'\\]"):
        Trajectory.from_json({"rewardz": 1.0})


def test_failed_and_model_token_count():
    assert Trajectory(stop_reason="timeout").failed and Trajectory(stop_reason="error").failed
    assert not Trajectory(stop_reason="max_turns").failed
    assert _traj([1], [2, 3, 4], [1, 0, 1]).num_model_tokens == 2


@pytest.mark.parametrize(
    ("response", "mask", "logprobs", "match"),
    [([1, 2], [1], [0.0, 0.0], "same length"), ([1, 2], [1, 1], [0.0], "same length"),
     ([1], [2], [0.0], "only 0 and 1")],
)
def test_check_rejects_inconsistent_lists(response, mask, logprobs, match):
    with pytest.raises(ValueError, match=match):
        Trajectory(response_ids=response, loss_mask=mask, rollout_logprobs=logprobs).check()


def test_padded_view_aligns_masks_and_logprobs_with_input_ids():
    a = _traj([10, 11], [12, 13, 14], [1, 0, 1])
    b = _traj([20], [21], [1])
    batch = to_padded([a, b], pad_id=0)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 13, 14], [20, 21, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0]]
    assert batch["rollout_logprobs"].tolist() == [[0.0, 0.0, -0.5, 0.0, -1.5], [0.0, -0.5, 0.0, 0.0, 0.0]]


def test_packed_view_concatenates_without_padding():
    a = _traj([10, 11], [12, 13, 14], [1, 0, 1])
    b = _traj([20], [21], [1])
    packed = to_packed([a, b])
    assert packed["input_ids"].tolist() == [[10, 11, 12, 13, 14, 20, 21]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert packed["loss_mask"].tolist() == [[0, 0, 1, 0, 1, 0, 1]]
    assert packed["cu_seqlens"].tolist() == [0, 5, 7] and packed["cu_seqlens"].dtype == torch.int32
    padded = to_padded([a, b], pad_id=0)
    # the same model tokens and logprobs, in the same order, in both views
    assert packed["rollout_logprobs"][packed["loss_mask"] > 0].tolist() == \
        padded["rollout_logprobs"][padded["loss_mask"] > 0].tolist()


@pytest.mark.parametrize("packing", [False, True])
def test_micro_batches_cover_every_rollout_once_within_the_token_budget(packing):
    lengths = [9, 2, 5, 3, 7, 1, 4]  # prompt 1 token + response
    trajs = [_traj([1], list(range(n - 1)), [1] * (n - 1)) for n in lengths]
    budget = 10
    seen = []
    for batch, rows in micro_batches(list(range(len(trajs))), trajs, budget=budget, packing=packing, pad_id=0):
        cost = sum(lengths[i] for i in rows) if packing else len(rows) * max(lengths[i] for i in rows)
        assert cost <= budget or len(rows) == 1, (rows, cost)
        assert batch["input_ids"].shape[0] == len(rows)
        assert ("packed_input_ids" in batch) == packing
        seen += rows
    assert sorted(seen) == list(range(len(trajs)))
    # a rollout longer than the budget still trains, alone
    [(batch, rows)] = micro_batches([0], trajs, budget=4, packing=packing, pad_id=0)
    assert rows == [0] and batch["input_ids"].shape == (1, 9)


def test_rollouts_of_one_prompt_share_micro_batches_that_count_the_prompt_once():
    group = [_traj([1, 2, 3, 4, 5], list(range(n)), [1] * n) for n in (6, 2, 4, 3, 5)]  # one prompt of 5 tokens
    other = [_traj([9, 9], [7, 7], [1, 1]) for _ in range(2)]
    alone = [_traj([1, 2, 3, 4], [8], [1])]  # a prefix of the group's prompt, but not the same prompt
    trajs = group + other + alone
    budget = 4 + 7 + 6  # the prompt less its last token, then each row's response and that token
    tight = _shared_micro_batches(trajs, budget)
    assert [rows for batch, rows in tight if "segments" in batch] == [[0, 4], [2, 3, 1], [5, 6]]
    # with room, the two prompts' parts share one micro-batch, each part attending within itself
    roomy = _shared_micro_batches(trajs, 100)
    assert [(rows, batch["part_bounds"].tolist()) for batch, rows in roomy if "segments" in batch] == [
        ([0, 4, 2, 3, 1, 5, 6], [[0, 29], [29, 36]])]
    plain = micro_batches(list(range(len(trajs))), trajs, budget=budget, packing=False, pad_id=0)
    assert not any("segments" in batch for batch, _ in plain)


def _shared_micro_batches(trajs: list[Trajectory], budget: int) -> list[tuple[dict, list[int]]]:
    """The shared-prompt micro-batches of ``trajs`` within ``budget``, each checked: every rollout once, each part
    of a micro-batch its prompt once and then its rollouts' rests, where ``row_starts`` says they are."""
    batches = list(micro_batches(list(range(len(trajs))), trajs, budget=budget, packing=False, pad_id=0,
                                 share_prompt=True))
    seen = []
    for batch, rows in batches:
        seen += rows
        if "segments" not in batch:
            assert rows == [7] and batch["input_ids"].shape == (1, 5)
            continue
        assert batch["packed_input_ids"].shape[1] == batch["part_bounds"][-1, 1] <= budget
        r = 0
        for begin, end in batch["part_bounds"].tolist():
            segments = batch["segments"][0, begin:end]
            prompt = trajs[rows[r]].prompt_ids
            assert segments[:len(prompt) - 1].tolist() == [0] * (len(prompt) - 1)
            assert batch["packed_input_ids"][0, begin:begin + len(prompt) - 1].tolist() == prompt[:-1]
            for k in range(1, int(segments.max()) + 1):  # the part's rollouts
                ids = trajs[rows[r]].prompt_ids + trajs[rows[r]].response_ids
                assert trajs[rows[r]].prompt_ids == prompt
                at = batch["row_starts"][r] + torch.arange(len(prompt) - 1, len(ids))
                assert begin <= at.min() and at.max() < end
                assert batch["packed_input_ids"][0, at].tolist() == ids[len(prompt) - 1:]
                assert batch["position_ids"][0, at].tolist() == list(range(len(prompt) - 1, len(ids)))
                assert (batch["segments"][0, at] == k).all()
                r += 1
        assert r == len(rows)
    assert sorted(seen) == list(range(len(trajs)))
    return batches


def test_mini_batches_keep_the_rollouts_of_a_prompt_together_when_they_share_it():
    trajs = [_traj(prompt, [1], [1]) for prompt in ([1, 2], [3], [1, 2], [4], [3], [1, 2], [5, 6], [5, 6])]
    groups = {0: "a", 1: "b", 2: "a", 3: "c", 4: "b", 5: "a", 6: "d", 7: "d"}
    seen = set()
    for seed in range(20):
        torch.manual_seed(seed)
        order = mini_batch_order(trajs, share_prompt=True)
        assert sorted(order) == list(range(8))
        runs = [groups[i] for i in order]
        assert len([g for k, g in enumerate(runs) if k == 0 or runs[k - 1] != g]) == 4  # each prompt one run
        seen.add(tuple(runs))
    assert len(seen) > 1  # the groups come in a random order
    torch.manual_seed(0)
    mixed = [[groups[i] for i in mini_batch_order(trajs, share_prompt=False)] for _ in range(20)]
    assert any(len([g for k, g in enumerate(r) if k == 0 or r[k - 1] != g]) > 4 for r in mixed)


def test_stack_rows_cuts_and_pads_to_the_micro_batch():
    per_rollout = {3: torch.tensor([1.0, 2.0, 3.0]), 5: torch.tensor([4.0])}
    assert stack_rows(per_rollout, [5, 3], torch.Size([2, 2])).tolist() == [[4.0, 0.0], [1.0, 2.0]]


class Interrupted(InferenceEngine):
    """Plays back completions as a vLLM server does when a weight update stops requests in flight (partial rollouts):
    what a request had sampled, finish_reason abort, then the continuation on the new version."""

    model_name = "interrupted"

    def __init__(self, parts: list[Completion]) -> None:
        self.parts = list(parts)

    @property
    def base_url(self) -> str:
        return "interrupted://"

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        return self.parts.pop(0)

    async def chat(self, messages: list[dict[str, Any]], sampling: SamplingParams,
                   tools: list[dict[str, Any]] | None = None) -> ChatCompletion:
        raise NotImplementedError


@pytest.mark.parametrize(("sampled_before", "spans", "policy_version"), [
    (2, [[0, 0], [2, 1]], 0),
    (0, [[0, 1]], 1),  # stopped before its first token: version 0 sampled nothing, so it is neither span nor policy
])
async def test_version_spans_say_which_version_sampled_each_token_of_an_interrupted_turn(
        chat_tokenizer, sampled_before, spans, policy_version):
    """An update that stops a request starts a span where the new version's tokens begin, and only there."""
    answer = chat_tokenizer.tokenizer.encode("The answer is 4.", add_special_tokens=False)
    before, after = answer[:sampled_before], [*answer[sampled_before:], chat_tokenizer.eos_id]
    engine = Interrupted([Completion(before, [-0.5] * len(before), "abort", 0),
                          Completion(after, [-0.25] * len(after), "stop", 1)])
    task = {"id": "t", "question": "What is 2+2?", "answer": 4}
    [traj] = await Generator(engine, chat_tokenizer, GeneratorConfig(max_turns=1)).generate(
        lambda: envkit.make("arithmetic"), tasks=[task])
    traj.check()
    assert traj.error is None and traj.reward == 1.0 and not engine.parts
    assert traj.response_ids == [*before, *after]
    assert traj.rollout_logprobs == [-0.5] * len(before) + [-0.25] * len(after)
    assert traj.version_spans == spans and traj.policy_version == policy_version
