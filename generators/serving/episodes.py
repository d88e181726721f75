"""Stored calls back into training data: one conversation's calls as one :class:`~generators.trajectory.Trajectory`
(its token sequences rebuilt exactly as the gateway linked them), and the reward it earned from late feedback or,
past a deadline, from the rubric."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

from generators.serving.store import CallStore, StoredCall
from generators.trajectory import Trajectory, mark_version


@dataclass(frozen=True)
class RewardRule:
    """When a stored conversation has earned its reward, and what it is."""

    settle_s: float = 60.0
    """Feedback counts once the conversation has been quiet this long (a later call would continue it)."""
    deadline_s: float = 600.0
    """A conversation with no client feedback this long after its last call takes the rubric's score alone."""

    def reward(self, age_s: float, feedback: list[float], rubric: list[float]) -> float | None:
        """The reward of a conversation whose last call is ``age_s`` old, given the latest client score of each of
        its scored calls and the rubric's; None while it is not due (or where nothing scored it)."""
        if feedback and age_s >= self.settle_s:
            return sum(feedback) / len(feedback)
        if rubric and age_s >= self.deadline_s:
            return sum(rubric) / len(rubric)
        return None


def assemble(calls: Iterable[StoredCall]) -> Trajectory:
    """One conversation's calls (in the order they were stored) as a trajectory: each segment's calls in one token
    sequence, the model's replies with loss mask 1 and their logprobs, everything between them mask 0. A call
    whose context does not extend the sequence before it (its redaction changed earlier text) starts a sequence of
    its own; a reply whose tokens were not kept (redacted) ends one."""
    sequences: list[Trajectory] = []
    open_by_segment: dict[int, Trajectory] = {}
    calls = list(calls)
    for call in calls:
        current = open_by_segment.get(call.segment)
        if current is None or (current.prompt_ids + current.response_ids) != call.context_ids[:len(
                current.prompt_ids) + len(current.response_ids)]:
            current = Trajectory(prompt_ids=list(call.context_ids), policy_version=call.model_version)
            sequences.append(current)
        else:
            observation = call.context_ids[len(current.prompt_ids) + len(current.response_ids):]
            current.response_ids += observation
            current.loss_mask += [0] * len(observation)
            current.rollout_logprobs += [0.0] * len(observation)
        if not call.reply_ids:  # its text was redacted: nothing the model sampled here is known
            open_by_segment.pop(call.segment, None)
            continue
        for offset, version in call.version_spans:
            mark_version(current.version_spans, len(current.response_ids) + offset, version)
        current.response_ids += call.reply_ids
        current.loss_mask += [1] * len(call.reply_ids)
        current.rollout_logprobs += call.logprobs
        current.num_turns += 1
        open_by_segment[call.segment] = current
    trained = [s for s in sequences if any(s.loss_mask)]
    head, *rest = trained or [Trajectory()]
    last = calls[-1] if calls else None
    return Trajectory(
        prompt_ids=head.prompt_ids, response_ids=head.response_ids, loss_mask=head.loss_mask,
        rollout_logprobs=head.rollout_logprobs, version_spans=head.version_spans,
        policy_version=min((s.policy_version for s in trained), default=0), num_turns=len(calls),
        stop_reason="done" if trained else "error", error=None if trained else "no reply of it was kept as tokens",
        messages=[*last.messages, last.reply] if last else [], env_name="serving",
        task_id=last.episode if last else None, group_id=last.episode if last else "",
        segments=[{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "loss_mask": s.loss_mask,
                   "rollout_logprobs": s.rollout_logprobs, "version_spans": s.version_spans} for s in rest])


def due(store: CallStore, rule: RewardRule, *, now: float | None = None) -> tuple[list[Trajectory], list[str]]:
    """The conversations in ``store`` not yet taken whose reward is due under ``rule``, as trajectories with that
    reward; and the keys of those past the rule's deadline that nothing scored (to be taken as dropped)."""
    now = time.time() if now is None else now
    scores = store.scores()
    ready, dropped = [], []
    conversations: dict[str, list[StoredCall]] = {}
    for call in store.calls(untaken=True):  # one read: this is polled while a round waits
        conversations.setdefault(call.episode, []).append(call)
    for episode, calls in conversations.items():
        last = max(c.created for c in calls)
        feedback = [scores[("client", c.response_id)] for c in calls if ("client", c.response_id) in scores]
        rubric = [scores[("rubric", c.response_id)] for c in calls if ("rubric", c.response_id) in scores]
        reward = rule.reward(now - last, feedback, rubric)
        if reward is not None:
            ready.append(replace(assemble(calls), reward=reward))
        elif now - last >= max(rule.deadline_s, rule.settle_s):
            dropped.append(episode)
    return ready, dropped
