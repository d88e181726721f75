"""Which of a process's threads and process groups the CPU serves first: :func:`separate` keeps one side a fixed
number of nice steps below the other, relative to the priority each was given (the online stage's training below its
serving; trainer/online.py)."""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger(__name__)

PRIORITY_GAP = 10
"""Nice steps between what serves clients and what trains, in the online stage."""


def separate(serving: list[tuple[int, int]], training: list[tuple[int, int]], gap: int = PRIORITY_GAP) -> None:
    """Put what trains ``gap`` nice steps below what serves, each from where it stands (``(which, who)`` pairs, as
    ``os.setpriority`` takes them). What trains is lowered, to nice 19 at most; where that leaves less than ``gap``
    (a run started nicer than 9), what serves is raised the rest of the way, as root may (else a warning says so).
    Never an absolute nice value: that would raise what trains in a run started nicer than it."""
    short = 0
    for which, who in training:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            before = os.getpriority(which, who)
            os.setpriority(which, who, min(19, before + gap))
            short = max(short, before + gap - 19)
    for which, who in serving if short > 0 else ():
        try:
            os.setpriority(which, who, max(-20, os.getpriority(which, who) - short))
        except ProcessLookupError:
            continue
        except PermissionError:
            log.warning("this run started at a nice value that leaves what trains less than %d steps below what "
                        "serves, and it may not raise what serves: start it at nice %d or lower", gap, 19 - gap)
            return
