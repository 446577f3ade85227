"""Anomaly likelihood: how unusual is the recent *level of anomaly* for this series."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
from scipy.special import log_ndtr

_LN10 = math.log(10.0)


class AnomalyLikelihood:
    """Numenta's anomaly likelihood over a stream of raw anomaly scores in ``[0, 1]``.

    Raw scores (here: one minus the p-value of a residual) are noisy and their typical
    level differs from series to series: a jittery metric makes many 3-sigma points, a
    smooth one almost none. The likelihood compares the mean of the last ``average`` raw
    scores with the distribution (normal fit, re-estimated every ``reestimate`` points)
    of that same mean over the last ``history`` points, and reports the upper tail
    probability. A series is thereby judged against its own normal amount of noise, and
    a burst of moderately odd points (denser spikes, a wobble) counts as well as one wild
    point. Defaults are Numenta's (``nupic.algorithms.anomaly_likelihood``): 10, 8640,
    100, and no estimate before ``learning`` = 288 + 100 points.

    >>> lik = AnomalyLikelihood(learning=50, reestimate=10)
    >>> for i in range(200):
    ...     lik.learn(0.2 + 0.1 * (i % 3))
    >>> lik.log10_tail(0.3) > -1.0, lik.log10_tail(1.0) < -4.0
    (True, True)
    """

    def __init__(
        self,
        average: int = 10,
        history: int = 8640,
        reestimate: int = 100,
        learning: int = 388,
        min_std: float = 0.0173,
    ) -> None:
        if average < 1:
            raise ValueError("average must be >= 1")
        self.average = average
        self.reestimate = reestimate
        self.learning = learning
        self.min_std = min_std
        self._recent: deque[float] = deque(maxlen=max(average - 1, 1))
        self._averages: deque[float] = deque(maxlen=history)
        self._n = 0
        self._mean: float | None = None
        self._std = 1.0

    def moving_average(self, raw: float) -> float:
        """Mean of the last ``average - 1`` learned raw scores and ``raw``."""
        if self.average == 1:
            return raw
        return (sum(self._recent) + raw) / (len(self._recent) + 1)

    def log10_tail(self, raw: float) -> float:
        """``log10 P(mean >= observed)`` if ``raw`` came next; 0 while learning."""
        if self._mean is None:
            return 0.0
        z = (self.moving_average(raw) - self._mean) / self._std
        return float(log_ndtr(-z)) / _LN10

    def learn(self, raw: float) -> None:
        self._averages.append(self.moving_average(raw))
        self._recent.append(raw)
        self._n += 1
        if self._n >= self.learning and (
            self._mean is None or self._n % self.reestimate == 0
        ):
            averages = np.fromiter(self._averages, dtype=np.float64, count=len(self._averages))
            self._mean = float(averages.mean())
            self._std = max(float(averages.std()), self.min_std)
