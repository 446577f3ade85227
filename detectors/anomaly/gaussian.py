"""NAB's "windowed Gaussian" baseline, ported as published (for comparison only)."""

from __future__ import annotations

import math
from datetime import datetime

import numpy as np

from loopwatch.detectors.anomaly.rolling import FloatArray


def normal_upper_tail(x: float, mean: float, std: float) -> float:
    """NAB's ``normalProbability``: the Q-function of ``|x - mean| / std``."""
    z = abs(x - mean) / std
    return 0.5 * math.erfc(z / math.sqrt(2.0))


class WindowedGaussian:
    """Gaussian tail of a point against the mean and std of a long trailing window.

    A reference point, not a production detector: it is NAB's ``windowedGaussian``
    (window of 6400 points moved in steps of 100, score ``1 - Q(|z|)``; 39.6 on the full
    NAB corpus, standard profile), kept so our detectors are compared with it on the
    same data in the same run. It suits only stationary, roughly normal series.

    >>> det = WindowedGaussian()
    >>> det.score_one(5.0)  # nothing learned yet
    0.0
    >>> for x in [1.0, 2.0, 3.0]:
    ...     det.learn_one(x)
    >>> round(det.score_one(2.0), 6), round(det.score_one(2.0 + 0.8165), 4)
    (0.5, 0.8413)
    """

    def __init__(self, window: int = 6400, step: int = 100) -> None:
        self.name = "windowed_gaussian"
        self.window = window
        self.step = step
        self._data: FloatArray = np.zeros(window, dtype=np.float64)
        self._count = 0
        self._pending: list[float] = []
        self._mean = 0.0
        self._std = 1.0

    def score_one(self, x: float, t: datetime | None = None) -> float:
        if self._count == 0:
            return 0.0
        return 1.0 - normal_upper_tail(x, self._mean, self._std)

    def learn_one(self, x: float, t: datetime | None = None) -> None:
        if self._count < self.window:
            self._data[self._count] = x
            self._count += 1
            self._refresh()
            return
        self._pending.append(x)
        if len(self._pending) == self.step:
            self._data = np.concatenate((self._data[self.step :], self._pending))
            self._pending = []
            self._refresh()

    def _refresh(self) -> None:
        held = self._data[: self._count]
        self._mean = float(np.mean(held))
        self._std = float(np.std(held)) or 0.000001
