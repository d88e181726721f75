"""Trajectories as training tensors: padded and packed batches, and micro-batches within a token budget.

Layout (what the backends and ``trainer/algorithms.py`` expect): token tensors are (B, T), right-padded, with
``loss_mask`` and ``rollout_logprobs`` aligned with ``input_ids`` (zero over the prompt and the padding), so the
logprob of token ``t`` comes from the logits at ``t - 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import accumulate

import torch

from generators.trajectory import Trajectory
from trainer.backends.base import Batch


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

    With ``share_prompt`` (instead of packing), rollouts with the same prompt go into micro-batches of their own
    (:func:`shared_prompt_batch`): the model reads the prompt once for all of them, so a group of n costs
    P + n·R tokens instead of n·(P + R), and its budget is counted that way.
    """
    if share_prompt and not packing:
        groups = _by_prompt(index, trajectories)
        for rows in groups:
            if len(rows) > 1:
                yield from _shared_prompt(rows, trajectories, budget, pad_id)
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


def _shared_prompt(rows: list[int], trajectories: list[Trajectory], budget: int, pad_id: int
                   ) -> Iterator[tuple[Batch, list[int]]]:
    """Micro-batches of rollouts with one prompt, each costing the prompt once plus its rows' responses."""
    # The prompt's last token stays in each row's own part: it predicts the row's first response token.
    shared = len(trajectories[rows[0]].prompt_ids) - 1
    tail = {i: len(trajectories[i].response_ids) + 1 for i in rows}
    for part in _fill(rows, tail, lambda part: shared + sum(tail[j] for j in part), budget):
        yield shared_prompt_batch([trajectories[j] for j in part], shared, pad_id), part


def shared_prompt_batch(trajectories: list[Trajectory], shared: int, pad_id: int) -> Batch:
    """Rollouts whose first ``shared`` tokens are the same, as one row for the model: those tokens once, then each
    rollout's rest, with ``segments`` (0 on the shared tokens, r + 1 on rollout r's) for the attention mask that
    lets each rollout see the shared tokens and itself only; the padded (B, T) tensors for the loss besides.
    ``row_starts[r] + t`` is the position in that row of rollout r's token t (t >= ``shared``)."""
    rows = [t.prompt_ids + t.response_ids for t in trajectories]
    rests = [len(ids) - shared for ids in rows]
    return {
        **to_padded(trajectories, pad_id),
        "packed_input_ids": torch.tensor([rows[0][:shared] + [i for ids in rows for i in ids[shared:]]]),
        "position_ids": torch.tensor([list(range(shared)) + [p for ids in rows for p in range(shared, len(ids))]]),
        "segments": torch.tensor([[0] * shared + [r + 1 for r, n in enumerate(rests) for _ in range(n)]]),
        "row_starts": torch.tensor([0, *accumulate(rests)][:-1]),  # rollout r's part begins at shared + this
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
