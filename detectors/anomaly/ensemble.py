"""A voted combination of detectors: the weighted maximum of their scores."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from loopwatch.detectors.anomaly.base import AnomalyDetector


class MaxEnsemble:
    """Each member scores the point; the ensemble reports the largest weighted score.

    The simplest vote that keeps every member's strength: a residual detector sees
    spikes and shifts, a contextual one sees a pattern that never occurred, and either
    raising its hand is enough. A weight below 1 is a member's handicap, for a member
    whose scores run hotter than the others' on quiet data. Every member learns every
    point. Wrap it in :class:`~loopwatch.detectors.anomaly.refractory.Refractory` so that
    members agreeing on one episode page once.

    >>> class Last:  # distance from the last point learned, capped at 1
    ...     def __init__(self) -> None:
    ...         self.name, self.last = "last", None
    ...     def score_one(self, x: float, t: datetime | None = None) -> float:
    ...         return 0.0 if self.last is None else min(1.0, abs(x - self.last))
    ...     def learn_one(self, x: float, t: datetime | None = None) -> None:
    ...         self.last = x
    >>> from loopwatch.detectors.anomaly.base import score_series
    >>> score_series(MaxEnsemble([(Last(), 1.0), (Last(), 0.5)]), [0.0, 0.3, 2.0, 2.0])
    [0.0, 0.3, 1.0, 0.0]
    >>> score_series(MaxEnsemble([(Last(), 0.5)]), [0.0, 0.3, 2.0, 2.0])
    [0.0, 0.15, 0.5, 0.0]
    """

    def __init__(
        self, members: Sequence[tuple[AnomalyDetector, float]], name: str = "ensemble"
    ) -> None:
        if not members or any(not 0.0 <= w <= 1.0 for _, w in members):
            raise ValueError("an ensemble needs members with weights in [0, 1]")
        self.members = list(members)
        self.name = name

    def score_one(self, x: float, t: datetime | None = None) -> float:
        return max(weight * member.score_one(x, t) for member, weight in self.members)

    def learn_one(self, x: float, t: datetime | None = None) -> None:
        for member, _ in self.members:
            member.learn_one(x, t)
