"""Trajectories as training tensors: padded and packed batches, and micro-batches within a token budget.

Layout (what the backends and ``trainer/algorithms.py`` expect): token tensors are (B, T), right-padded, with
``loss_mask`` and ``rollout_logprobs`` aligned with ``input_ids`` (zero over the prompt and the padding), so the
logprob of token ``t`` comes from the logits at ``t - 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from generators.trajectory import Trajectory
from trainer.backends.base import Batch


@dataclass
class StepBatch:
    """One step's training data after filtering: the trajectories and one advantage per trajectory."""

    trajectories: list[Trajectory]
    advantages: torch.Tensor  # (B,); zeros with a critic, whose advantages are per token
    counts: dict[str, int] = field(default_factory=dict)


def to_padded(trajectories: list[Trajectory], pad_id: int) -> Batch:
    """Right-padded ``input_ids``, ``attention_mask``, ``loss_mask`` and ``rollout_logprobs``, each (B, T) with T
    the longest prompt + response."""
    rows = [_row(t) for t in trajectories]
    width = max(len(ids) for ids, _, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (ids, mask, lps) in enumerate(rows):
        n = len(ids)
        input_ids[i, :n] = torch.tensor(ids)
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(mask, dtype=torch.float32)
        logprobs[i, :n] = torch.tensor(lps, dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
            "rollout_logprobs": logprobs}


def to_packed(trajectories: list[Trajectory]) -> Batch:
    """All sequences concatenated into one row (1, sum T) with per-sequence ``position_ids`` restarting at 0.

    No padding compute: attention implementations that honour position-id boundaries (flash/sdpa varlen in
    transformers) keep sequences apart. ``cu_seqlens`` gives the boundaries.
    """
    rows = [_row(t) for t in trajectories]
    lengths = [len(ids) for ids, _, _ in rows]
    return {
        "input_ids": torch.tensor([[i for ids, _, _ in rows for i in ids]], dtype=torch.long),
        "position_ids": torch.tensor([[p for n in lengths for p in range(n)]], dtype=torch.long),
        "loss_mask": torch.tensor([[m for _, mask, _ in rows for m in mask]], dtype=torch.float32),
        "rollout_logprobs": torch.tensor([[lp for _, _, lps in rows for lp in lps]], dtype=torch.float32),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
    }


def collate(trajectories: list[Trajectory], pad_id: int, packing: bool) -> Batch:
    """Padded (B, T) tensors for the loss; with packing, also the one-row packed model input."""
    padded = to_padded(trajectories, pad_id)
    if not packing:
        return padded
    packed = to_packed(trajectories)
    return {**padded, "packed_input_ids": packed["input_ids"], "position_ids": packed["position_ids"],
            "cu_seqlens": packed["cu_seqlens"], "row_starts": packed["cu_seqlens"][:-1].long()}


def mini_batch_order(trajectories: list[Trajectory], *, share_prompt: bool) -> list[int]:
    """The rollouts in a random order to cut into mini-batches. With ``share_prompt`` the rollouts of one prompt stay
    together: spread over several mini-batches, they would read their prompt once in each."""
    if not share_prompt:
        return torch.randperm(len(trajectories)).tolist()
    groups = _by_prompt(range(len(trajectories)), trajectories)
    return [i for k in torch.randperm(len(groups)).tolist() for i in groups[k]]


def micro_batches(index: list[int], trajectories: list[Trajectory], *, budget: int, packing: bool, pad_id: int,
                  share_prompt: bool = False) -> Iterator[tuple[Batch, list[int]]]:
    """Split the rollouts ``index`` into micro-batches of at most ``budget`` tokens (longest first, greedy; a
    rollout longer than the budget goes alone); yields each collated batch and its rollouts' indices.

    With ``share_prompt`` (instead of packing), rollouts with the same prompt go into parts of micro-batches of their
    own (:func:`shared_prompt_batch`): the model reads the prompt once for all of them, so a group of n costs
    P + n·R tokens instead of n·(P + R), and its budget is counted that way. Several groups' parts share a
    micro-batch, each attending only within itself.
    """
    if share_prompt and not packing:
        groups = _by_prompt(index, trajectories)
        parts = [part for rows in groups if len(rows) > 1 for part in _prompt_parts(rows, trajectories, budget)]
        tokens = {k: _part_tokens(part, trajectories) for k, part in enumerate(parts)}
        for chosen in _fill(list(tokens), tokens, lambda ks: sum(tokens[k] for k in ks), budget):
            yield (shared_prompt_batch([[trajectories[i] for i in parts[k]] for k in chosen], pad_id),
                   [i for k in chosen for i in parts[k]])
        index = [i for rows in groups if len(rows) == 1 for i in rows]
    length = {i: len(trajectories[i].prompt_ids) + len(trajectories[i].response_ids) for i in index}
    # packed: the tokens themselves; padded: rows × the longest row (the first, as they are sorted)
    cost = (lambda part: sum(length[j] for j in part)) if packing else (lambda part: len(part) * length[part[0]])
    for part in _fill(index, length, cost, budget):
        yield collate([trajectories[j] for j in part], pad_id, packing), part


def _by_prompt(index: Iterable[int], trajectories: list[Trajectory]) -> list[list[int]]:
    """The rollouts ``index`` grouped by identical prompt token ids, in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in index:
        groups.setdefault(tuple(trajectories[i].prompt_ids), []).append(i)
    return list(groups.values())


def _prompt_parts(rows: list[int], trajectories: list[Trajectory], budget: int) -> Iterator[list[int]]:
    """Rollouts with one prompt cut into parts that each cost the prompt once plus their responses within budget."""
    return _fill(rows, {i: len(trajectories[i].response_ids) + 1 for i in rows},
                 lambda part: _part_tokens(part, trajectories), budget)


def _part_tokens(part: list[int], trajectories: list[Trajectory]) -> int:
    # The prompt's last token stays in each row's own part: it predicts the row's first response token.
    return len(trajectories[part[0]].prompt_ids) - 1 + sum(len(trajectories[i].response_ids) + 1 for i in part)


def shared_prompt_batch(parts: list[list[Trajectory]], pad_id: int) -> Batch:
    """Parts, each of rollouts with one prompt, as one row for the model: each part's prompt (less its last token)
    once, then each of its rollouts' rest. ``part_bounds`` (P, 2) says where each part begins and ends in the row,
    ``segments`` numbers its tokens (0 on the shared ones, r + 1 on its rollout r's) for the attention mask that
    lets each rollout see its part's shared tokens and itself only; the padded (B, T) tensors for the loss besides.
    ``row_starts[r] + t`` is the position in that row of rollout r's token t (t >= its prompt's length - 1)."""
    ids: list[int] = []
    positions: list[int] = []
    segments: list[int] = []
    starts, bounds = [], []
    for trajectories in parts:
        shared = len(trajectories[0].prompt_ids) - 1
        begin = len(ids)
        ids += trajectories[0].prompt_ids[:shared]
        positions += range(shared)
        segments += [0] * shared
        for r, t in enumerate(trajectories):
            rest = (t.prompt_ids + t.response_ids)[shared:]
            starts.append(len(ids) - shared)
            ids += rest
            positions += range(shared, shared + len(rest))
            segments += [r + 1] * len(rest)
        bounds.append((begin, len(ids)))
    return {
        **to_padded([t for trajectories in parts for t in trajectories], pad_id),
        "packed_input_ids": torch.tensor([ids]), "position_ids": torch.tensor([positions]),
        "segments": torch.tensor([segments]), "row_starts": torch.tensor(starts), "part_bounds": torch.tensor(bounds),
    }


def _fill(index: list[int], length: dict[int, int], cost: Callable[[list[int]], int], budget: int
          ) -> Iterator[list[int]]:
    """``index`` longest first, cut greedily into runs whose ``cost`` stays within ``budget`` (a row over it alone)."""
    current: list[int] = []
    for i in sorted(index, key=lambda i: -length[i]):
        if current and cost([*current, i]) > budget:
            yield current
            current = []
        current.append(i)
    if current:
        yield current


def stack_rows(per_rollout: dict[int, torch.Tensor], rows: list[int], shape: torch.Size) -> torch.Tensor:
    """Stack per-rollout (T_i,) tensors into a (B, T) tensor shaped like a micro-batch (cut or zero-padded)."""
    out = torch.zeros(shape)
    for r, i in enumerate(rows):
        n = min(shape[1], per_rollout[i].shape[0])
        out[r, :n] = per_rollout[i][:n]
    return out


def _row(t: Trajectory) -> tuple[list[int], list[int], list[float]]:
    t.check()
    pad = [0] * len(t.prompt_ids)
    return t.prompt_ids + t.response_ids, pad + t.loss_mask, [0.0] * len(t.prompt_ids) + t.rollout_logprobs
