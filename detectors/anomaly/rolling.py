"""A fixed-size window of the latest values, with robust location and scale.

>>> w = RollingWindow(4)
>>> for x in [1.0, 2.0, 3.0, 100.0, 4.0]:
...     w.append(x)
>>> len(w), w.chronological().tolist()
(4, [2.0, 3.0, 100.0, 4.0])
>>> w.median(), round(robust_scale(w.values(), w.median()), 4)
(3.5, 1.4826)
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

MAD_TO_SIGMA = 1.4826
"""MAD times this estimates sigma for normal data."""
MEAN_AD_TO_SIGMA = 1.2533
"""Mean absolute deviation times this estimates sigma for normal data."""
TINY_SCALE = 1e-9

FloatArray = npt.NDArray[np.float64]


def robust_scale(values: FloatArray, center: float) -> float:
    """Sigma from the MAD; from the mean absolute deviation when over half the values tie.

    Never 0: a window of identical values gets a tiny scale relative to its level, so any
    different value is very surprising and the same value is not at all.
    """
    deviations = np.abs(values - center)
    mad = float(np.median(deviations))
    if mad > 0.0:
        return MAD_TO_SIGMA * mad
    mean_ad = float(np.mean(deviations))
    if mean_ad > 0.0:
        return MEAN_AD_TO_SIGMA * mean_ad
    return max(TINY_SCALE, TINY_SCALE * abs(center))


class RollingWindow:
    """The last ``size`` values in a ring buffer (O(1) append, numpy views for stats)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"window size must be >= 1, got {size}")
        self.size = size
        self._buf: FloatArray = np.zeros(size, dtype=np.float64)
        self._count = 0
        self._next = 0

    def __len__(self) -> int:
        return self._count

    def append(self, x: float) -> None:
        self._buf[self._next] = x
        self._next = (self._next + 1) % self.size
        self._count = min(self._count + 1, self.size)

    def values(self) -> FloatArray:
        """The held values in buffer order (a view: do not keep it across appends)."""
        return self._buf[: self._count]

    def chronological(self) -> FloatArray:
        """The held values, oldest first (a copy)."""
        if self._count < self.size:
            return self._buf[: self._count].copy()
        return np.concatenate((self._buf[self._next :], self._buf[: self._next]))

    def median(self) -> float:
        return float(np.median(self.values()))

    def median_scale(self) -> tuple[float, float]:
        """``(median, robust sigma)`` of the held values; the window must not be empty."""
        values = self.values()
        center = float(np.median(values))
        return center, robust_scale(values, center)
