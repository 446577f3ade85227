"""Two-sided CUSUM: small persistent drifts in either direction."""

from __future__ import annotations

import math
from datetime import datetime

from loopwatch.detectors.anomaly.base import surprise_from_log10
from loopwatch.detectors.anomaly.rolling import SlowBaseline


class Cusum:
    """Page's two-sided CUSUM on standardised residuals, restarting after each alarm.

    Suits slow creep that no single point reveals: cost per run inching up after a prompt
    change, tokens per step drifting as context grows, a retry rate that rises by half a
    sigma. ``S+ = max(0, S+ + z - k)`` and ``S- = max(0, S- - z - k)`` add up evidence of
    a shift larger than ``k`` sigmas; with in-control normal data the chance that the
    larger of the two exceeds ``s`` is about ``2 exp(-2 k s)``, and that tail probability
    is the score on the :func:`~loopwatch.detectors.anomaly.base.surprise` scale. When the sum
    passes ``reset_at`` the chart restarts from zero at the recent level (a fast EWMA), so
    one change raises one alarm instead of a stream of them. The baseline mean and sigma
    follow the series slowly (``alpha``) and winsorise their input at ``clip`` sigmas.

    >>> import numpy as np
    >>> from loopwatch.detectors.anomaly.base import score_series
    >>> rng = np.random.default_rng(11)
    >>> det = Cusum()
    >>> before = score_series(det, 5 + rng.normal(0, 1, 400))
    >>> after = score_series(det, 5.8 + rng.normal(0, 1, 100))  # +0.8 sigma
    >>> bool(max(before[100:]) < 0.3), bool(max(after) > 0.5)
    (True, True)
    """

    def __init__(
        self,
        k: float = 0.5,
        reset_at: float = 25.0,
        alpha: float = 0.002,
        clip: float = 4.0,
        min_samples: int = 50,
    ) -> None:
        if k <= 0.0:
            raise ValueError("k must be > 0")
        self.name = "cusum"
        self.k = k
        self.reset_at = reset_at
        self.clip = clip
        self.min_samples = min_samples
        self._n = 0
        self._baseline = SlowBaseline(alpha, clip)
        self._recent = 0.0
        self._pos = 0.0
        self._neg = 0.0

    def _z(self, x: float) -> float:
        z = (x - self._baseline.mean) / self._baseline.sigma()
        return min(max(z, -self.clip), self.clip)

    def _sums(self, x: float) -> tuple[float, float]:
        z = self._z(x)
        return max(0.0, self._pos + z - self.k), max(0.0, self._neg - z - self.k)

    def statistic(self, x: float) -> float:
        """``max(S+, S-)`` after ``x`` (0 while warming up)."""
        if self._n < self.min_samples:
            return 0.0
        return max(self._sums(x))

    def score_one(self, x: float, t: datetime | None = None) -> float:
        log_p = math.log(2.0) - 2.0 * self.k * self.statistic(x)
        return surprise_from_log10(min(0.0, log_p) / math.log(10.0))

    def learn_one(self, x: float, t: datetime | None = None) -> None:
        self._n += 1
        if self._n == 1:
            self._baseline.learn(x, 1, warm=False)
            self._recent = x
            return
        if self._n > self.min_samples:
            self._pos, self._neg = self._sums(x)
            if max(self._pos, self._neg) >= self.reset_at:
                self._pos = self._neg = 0.0
                self._baseline.mean = self._recent
        self._baseline.learn(x, self._n, warm=self._n > self.min_samples)
        self._recent += 0.1 * (x - self._recent)
