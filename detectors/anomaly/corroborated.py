"""One detector's episodes, raised where a second, different detector has just fired."""

from __future__ import annotations

from collections import deque
from datetime import datetime

from loopwatch.detectors.anomaly.base import AnomalyDetector, clip01


class Corroborated:
    """``primary``'s score, plus ``weight`` times ``witness``'s highest recent score.

    Two detectors that see different things (a residual's likelihood, the novelty of a
    window's shape) rarely fire together on noise, and often do on an incident. Where
    ``primary`` reports something (a score above 0: with
    :class:`~loopwatch.detectors.anomaly.refractory.Refractory`, the opening of an
    episode), ``weight`` times the largest score ``witness`` gave over this point and the
    ``memory`` points before it is added. An episode the residual alone rated just below
    the alerting line crosses it when the shape of the series also changed; anything
    ``primary`` leaves at 0 stays 0, so the witness never pages alone and the one-page-per-
    episode behaviour of ``primary`` is kept. Both detectors learn every point.

    >>> class Fixed:
    ...     def __init__(self, scores: list[float]) -> None:
    ...         self.name, self.scores, self.i = "fixed", scores, 0
    ...     def score_one(self, x: float, t: datetime | None = None) -> float:
    ...         return self.scores[self.i]
    ...     def learn_one(self, x: float, t: datetime | None = None) -> None:
    ...         self.i += 1
    >>> from loopwatch.detectors.anomaly.base import score_series
    >>> primary = [0.0, 0.25, 0.0, 0.0, 0.25, 0.0, 0.0, 0.0, 0.25, 0.875]
    >>> witness = [0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.75]
    >>> score_series(Corroborated(Fixed(primary), Fixed(witness), 0.5, 3), [0.0] * 10)
    [0.0, 0.25, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.25, 1.0]
    """

    def __init__(
        self, primary: AnomalyDetector, witness: AnomalyDetector, weight: float = 0.3,
        memory: int = 25, name: str | None = None,
    ) -> None:
        if not 0.0 <= weight <= 1.0 or memory < 0:
            raise ValueError("weight must be in [0, 1] and memory >= 0")
        self.primary, self.witness = primary, witness
        self.weight, self.memory = weight, memory
        self.name = name or f"{primary.name}+{witness.name}"
        self._recent: deque[float] = deque(maxlen=max(memory, 1))

    def _combine(self, primary: float, witness: float) -> float:
        if primary <= 0.0:
            return 0.0
        recent = max(self._recent, default=0.0) if self.memory else 0.0
        return clip01(primary + self.weight * max(witness, recent))

    def score_one(self, x: float, t: datetime | None = None) -> float:
        return self._combine(self.primary.score_one(x, t), self.witness.score_one(x, t))

    def learn_one(self, x: float, t: datetime | None = None) -> None:
        witness = self.witness.score_one(x, t)
        self.primary.learn_one(x, t)
        self.witness.learn_one(x, t)
        self._recent.append(witness)
