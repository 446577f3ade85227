"""Running the advisors: every advisor in order, findings sorted by saving.

Each advisor (one module each) reads stored events over a window of event time and
yields :class:`~loopwatch.detectors.advisors.base.Finding` s; :func:`advise` runs them all, in
the order of :data:`ADVISORS`, and sorts the findings by saving. docs/advisors.md has
the formulas, thresholds and test vectors.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from loopwatch.core.config import AdvisorSettings
from loopwatch.detectors.advisors.base import Advisor, Context, Finding, Scope, sort_findings
from loopwatch.detectors.advisors.cache import CacheAdvisor
from loopwatch.detectors.advisors.judge import JudgeAdvisor
from loopwatch.detectors.advisors.pipeline import PipelineAdvisor
from loopwatch.detectors.advisors.quadratic import QuadraticAdvisor
from loopwatch.detectors.advisors.retry import RetryAdvisor
from loopwatch.detectors.advisors.timeout import TimeoutAdvisor
from loopwatch.store.reader import Reader

log = logging.getLogger(__name__)

ADVISORS: tuple[Advisor, ...] = (TimeoutAdvisor(), RetryAdvisor(), CacheAdvisor(),
                                 QuadraticAdvisor(), JudgeAdvisor(), PipelineAdvisor())


def advise(reader: Reader, scope: Scope, settings: AdvisorSettings,
           advisors: tuple[Advisor, ...] = ADVISORS) -> list[Finding]:
    """Every advisor's findings over ``scope``, largest saving first. An advisor whose
    query fails raises: a partial answer would read as "nothing to change"."""
    context = Context(reader, scope, settings)
    found: list[Finding] = []
    for advisor in advisors:
        found.extend(advisor.findings(context))
    return sort_findings(found)


def advise_now(reader: Reader, settings: AdvisorSettings, agent: str = "",
               max_clock_skew: timedelta = timedelta(minutes=5)) -> list[Finding]:
    """:func:`advise` over the window ending at the newest stored event."""
    from loopwatch.detectors.advisors.base import window_ending_now

    scope = window_ending_now(reader, settings, agent, datetime.now(UTC), max_clock_skew)
    return [] if scope is None else advise(reader, scope, settings)


__all__ = ["ADVISORS", "Advisor", "Context", "Finding", "Scope", "advise", "advise_now"]
