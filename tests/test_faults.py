"""``make faults`` (tests/faults.py) fails on any outcome but the expected one: a fault the run should survive that
stopped it, one it should stop on that it carried through, a resume that failed or started elsewhere than after the
last checkpoint, detection past its bound, or anything left behind."""

from __future__ import annotations

from typing import Any

import pytest
from faults import problems

SURVIVED = {"fault": "env_server_stopped", "carries_on": True, "detect_s": 12.0, "bound_s": 60.0,
            "error": "step 3: 2 of 8 rollouts failed ...", "exit": 0, "outcome": "carried on", "left": []}
RESUMED = {"fault": "node_killed", "carries_on": False, "detect_s": 20.0, "bound_s": 60.0,
           "error": "step 2: env worker ... worker2", "exit": 1, "resume_exit": 0, "resumed_from": "step-000002",
           "resumed_at": 3, "outcome": "stopped (exit 1); resumed from step-000002 (its first step: 3), exit 0",
           "left": []}


def test_the_expected_outcomes_pass() -> None:
    assert problems(SURVIVED) == [] and problems(RESUMED) == []


@pytest.mark.parametrize(("row", "why"), [
    ({**SURVIVED, "exit": 1, "outcome": "stopped (exit 1)"}, "should have carried on, and stopped"),
    ({**RESUMED, "exit": 0, "outcome": "carried on"}, "should have stopped on it, and carried on"),
    ({**RESUMED, "resume_exit": 1}, "the resume did not run to the end"),
    ({**RESUMED, "resumed_at": 1}, "from the step after its last checkpoint"),
    ({**RESUMED, "resumed_at": None}, "the resume did not run to the end"),
    ({**SURVIVED, "detect_s": None, "error": None}, "not detected"),
    ({**SURVIVED, "detect_s": 75.0}, "past its 60 s bound"),
    ({**SURVIVED, "left": ["container envkit-sbx-1"]}, "left behind: container envkit-sbx-1"),
    ({**SURVIVED, "error": "harness: KeyError: 'x'"}, "the harness failed"),
])
def test_a_wrong_outcome_is_named_and_fails_the_run(row: dict[str, Any], why: str) -> None:
    found = problems(row)
    assert found and any(why in p for p in found), found
