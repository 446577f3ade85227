"""Robust z-score against a rolling median and MAD."""

from __future__ import annotations

from datetime import datetime

from loopwatch.detectors.anomaly.base import normal_surprise
from loopwatch.detectors.anomaly.rolling import RollingWindow


class RobustZScore:
    """How far a point is from the recent median, in robust sigmas (MAD-based).

    Suits spiky, heavy-tailed per-minute metrics (latency, tokens per step, cost per
    run): the median and MAD of the last ``window`` points ignore the spikes that would
    inflate a mean and standard deviation, so one outlier neither hides the next one nor
    lingers as a false baseline. Catches spikes and the first points of a level shift; it
    re-baselines by itself once a shift fills half the window. The score is the two-sided
    normal tail of ``z`` on the :func:`~loopwatch.detectors.anomaly.base.surprise` scale.

    >>> import numpy as np
    >>> rng = np.random.default_rng(7)
    >>> series = list(10 + rng.normal(0, 1, 200))
    >>> det = RobustZScore(window=100)
    >>> for x in series:
    ...     det.learn_one(x)
    >>> det.score_one(10.5) < 0.1, det.score_one(30.0) > 0.9
    (True, True)
    """

    def __init__(self, window: int = 360, min_samples: int = 30) -> None:
        self.name = "robust_z"
        self.window = RollingWindow(window)
        self.min_samples = min_samples
        self._stats: tuple[float, float] | None = None

    def stats(self) -> tuple[float, float] | None:
        """``(median, robust sigma)`` of the window; None while warming up."""
        if len(self.window) < self.min_samples:
            return None
        if self._stats is None:
            self._stats = self.window.median_scale()
        return self._stats

    def expected(self) -> float | None:
        """The rolling median (None while warming up)."""
        stats = self.stats()
        return None if stats is None else stats[0]

    def z(self, x: float) -> float:
        """The robust z of ``x`` (0 while warming up)."""
        stats = self.stats()
        return 0.0 if stats is None else (x - stats[0]) / stats[1]

    def score_one(self, x: float, t: datetime | None = None) -> float:
        return normal_surprise(self.z(x))

    def learn_one(self, x: float, t: datetime | None = None) -> None:
        self.window.append(x)
        self._stats = None
