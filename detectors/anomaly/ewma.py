"""EWMA control chart for level shifts, robust to single spikes."""

from __future__ import annotations

import math
from datetime import datetime

from loopwatch.detectors.anomaly.base import normal_surprise
from loopwatch.detectors.anomaly.rolling import SlowBaseline


class EWMALevelShift:
    """A fast EWMA of the (winsorised) series against a slow baseline: sustained shifts.

    Suits level metrics that should stay flat and whose failures are *sustained* moves
    rather than blips: queue depth, steps per run, success rate per minute, a provider's
    p50 latency after a deploy. Each point is clipped to ``baseline +- clip * sigma``
    before it enters the fast average, so a lone spike moves the chart by at most
    ``lam * clip`` sigmas while a shift of a few sigmas accumulates to a large statistic
    within about ``1 / lam`` points. The statistic is the classic EWMA chart's
    ``(fast - baseline) / (sigma * sqrt(lam / (2 - lam)))``; the baseline and sigma follow
    the series slowly (``alpha``), so the detector re-baselines after a lasting change.

    >>> import numpy as np
    >>> rng = np.random.default_rng(3)
    >>> det = EWMALevelShift()
    >>> for x in 50 + rng.normal(0, 1, 300):
    ...     det.learn_one(x)
    >>> det.score_one(58.0) < 0.2           # one spike: the input is clipped
    True
    >>> scores = []
    >>> for x in 53 + rng.normal(0, 1, 30):  # a lasting +3 sigma shift
    ...     scores.append(det.score_one(x))
    ...     det.learn_one(x)
    >>> max(scores[:10]) > 0.5
    True
    """

    def __init__(
        self,
        lam: float = 0.1,
        alpha: float = 0.005,
        clip: float = 4.0,
        min_samples: int = 30,
    ) -> None:
        if not (0.0 < lam <= 1.0 and 0.0 < alpha < 1.0):
            raise ValueError("need 0 < lam <= 1 and 0 < alpha < 1")
        self.name = "ewma"
        self.lam = lam
        self.min_samples = min_samples
        self._n = 0
        self._baseline = SlowBaseline(alpha, clip)
        self._fast = 0.0
        self._chart_sd = math.sqrt(lam / (2.0 - lam))

    def statistic(self, x: float) -> float:
        """The chart statistic after ``x`` (0 while warming up)."""
        if self._n < self.min_samples:
            return 0.0
        fast = self.lam * self._baseline.clipped(x) + (1.0 - self.lam) * self._fast
        return (fast - self._baseline.mean) / (self._baseline.sigma() * self._chart_sd)

    def score_one(self, x: float, t: datetime | None = None) -> float:
        return normal_surprise(self.statistic(x))

    def learn_one(self, x: float, t: datetime | None = None) -> None:
        self._n += 1
        taken = self._baseline.learn(x, self._n, warm=self._n > self.min_samples)
        self._fast = x if self._n == 1 else self.lam * taken + (1.0 - self.lam) * self._fast
