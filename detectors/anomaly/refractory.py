"""One alert per episode: a rest period after a detection, around any detector."""

from __future__ import annotations

from collections import deque
from datetime import datetime

from loopwatch.detectors.anomaly.base import AnomalyDetector


class Refractory:
    """Passes an inner detector's score through only where it opens a new episode.

    A page per minute of one incident is noise to whoever is on call, and NAB counts it
    the same way: only the first detection inside an anomaly window earns anything, and
    every later one outside it costs a false positive. Two rules, both online:

    * *Record.* A score is passed only if it beats every inner score of the last
      ``rest`` points (CAD OSE's rule); otherwise the output is 0. A long anomalous
      stretch therefore reports its first and its worst moments, not each point.
    * *Quiet.* After an output at ``level`` or above, the next ``rest`` outputs are 0
      (a refractory period), however high the inner score climbs. ``level=None`` turns
      this off. ``level`` sits a little below where alerts are usually drawn, so a point
      that nearly alerted also opens a quiet period and its episode pages at most once.

    The inner detector still learns every point, so it re-baselines during the quiet
    period exactly as it would without the wrapper.

    >>> class Fixed:
    ...     name = "fixed"
    ...     def __init__(self, scores: list[float]) -> None:
    ...         self.scores, self.i = scores, 0
    ...     def score_one(self, x: float, t: datetime | None = None) -> float:
    ...         return self.scores[self.i]
    ...     def learn_one(self, x: float, t: datetime | None = None) -> None:
    ...         self.i += 1
    >>> from loopwatch.detectors.anomaly.base import score_series
    >>> inner = [0.1, 0.2, 0.9, 0.95, 0.99, 0.1, 0.1, 0.3, 0.8, 0.1]
    >>> score_series(Refractory(Fixed(inner), rest=3, level=0.5), [0.0] * 10)
    [0.1, 0.2, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.8, 0.0]
    >>> score_series(Refractory(Fixed(inner), rest=3, level=None), [0.0] * 10)
    [0.1, 0.2, 0.9, 0.95, 0.99, 0.0, 0.0, 0.0, 0.8, 0.0]
    """

    def __init__(
        self, inner: AnomalyDetector, rest: int = 150, level: float | None = 0.45,
        name: str | None = None,
    ) -> None:
        if rest < 1:
            raise ValueError("rest must be >= 1")
        self.inner = inner
        self.rest = rest
        self.level = level
        self.name = name or f"{inner.name}+refractory"
        self._recent: deque[float] = deque(maxlen=rest)
        self._quiet = 0

    def _output(self, inner: float) -> float:
        if self._quiet > 0 or (self._recent and inner <= max(self._recent)):
            return 0.0
        return inner

    def score_one(self, x: float, t: datetime | None = None) -> float:
        return self._output(self.inner.score_one(x, t))

    def learn_one(self, x: float, t: datetime | None = None) -> None:
        inner = self.inner.score_one(x, t)
        output = self._output(inner)
        self.inner.learn_one(x, t)
        self._quiet = max(0, self._quiet - 1)
        if self.level is not None and output >= self.level:
            self._quiet = self.rest
        self._recent.append(inner)
