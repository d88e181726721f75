"""Rewards from parts: :mod:`envkit.rewards.rubrics` has the :class:`Rubric` parts (checks, the env's own reward,
their combinations), :class:`GroupRubric` and :class:`RubricEnv`, what ``envkit.make(..., rubric=)`` gives an env;
:mod:`envkit.rewards.judges` the LLM judges (:class:`LLMJudge`, :class:`RelativeJudge`) at an OpenAI-compatible
endpoint; :mod:`envkit.rewards.grader_talk` what finds a reply that talks to its grader, and
:mod:`envkit.rewards.judge_check` the check of a judge against sets of right and wrong answers and attacks."""

from envkit.rewards.grader_talk import redact, without_grader_talk
from envkit.rewards.judge_check import ATTACKS, SETS, Report, ScriptedJudge, check_judge
from envkit.rewards.judges import (
    JUDGE_KEY_VAR,
    JUDGE_MODEL_VAR,
    JUDGE_URL_VAR,
    JudgeEndpoint,
    LLMJudge,
    RelativeJudge,
    final_number,
)
from envkit.rewards.rubrics import (
    AllOf,
    AnyOf,
    Check,
    EnvReward,
    Episode,
    Gate,
    GroupRubric,
    HoldsRubric,
    Max,
    Rubric,
    RubricEnv,
    Score,
    WeightedSum,
    load_group_rubric,
    load_rubric,
    with_rubric,
)

__all__ = [
    "ATTACKS",
    "JUDGE_KEY_VAR",
    "JUDGE_MODEL_VAR",
    "JUDGE_URL_VAR",
    "SETS",
    "AllOf",
    "AnyOf",
    "Check",
    "EnvReward",
    "Episode",
    "Gate",
    "GroupRubric",
    "HoldsRubric",
    "JudgeEndpoint",
    "LLMJudge",
    "Max",
    "RelativeJudge",
    "Report",
    "Rubric",
    "RubricEnv",
    "Score",
    "ScriptedJudge",
    "WeightedSum",
    "check_judge",
    "final_number",
    "load_group_rubric",
    "load_rubric",
    "redact",
    "with_rubric",
    "without_grader_talk",
]
