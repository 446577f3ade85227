"""The one interface every online anomaly detector implements, and the shared score scale.

Detectors are river-style: ``score_one(x)`` scores a point from what was learned *before*
it and changes nothing; ``learn_one(x)`` then folds the point in. Call them in that order
on every point (:func:`score_series` does) and no score ever looks ahead.

Scores are in ``[0, 1]``. The statistical detectors report a *surprise*: with ``p`` the
tail probability of the point under the detector's model and ``L = -log10(p)``, the score
is ``L / (L + 5)``: 0 for p = 1, 0.5 for p = 1e-5, 2/3 for p = 1e-10, 0.8 for p = 1e-20.
It never saturates, so a threshold can still tell a 10-sigma point from a 40-sigma one
(``1 - p`` rounds both to 1.0), and scores of different detectors are on one scale.

>>> surprise(1.0), surprise(1e-5), round(surprise(1e-10), 4), surprise(0.0)
(0.0, 0.5, 0.6667, 1.0)
>>> round(normal_two_sided_p(1.959964), 4)
0.05
>>> normal_surprise(40.0) > normal_surprise(30.0) > normal_surprise(10.0)
True
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Protocol, runtime_checkable

from scipy.special import log_ndtr

SURPRISE_HALF = 5.0
"""``surprise`` is 0.5 at a tail probability of ``10 ** -SURPRISE_HALF``."""
_LN10 = math.log(10.0)


@runtime_checkable
class AnomalyDetector(Protocol):
    """An online detector over one numeric series."""

    name: str

    def learn_one(self, x: float, t: datetime | None = None) -> None:
        """Fold ``x`` (observed at ``t``) into the detector's state."""
        ...

    def score_one(self, x: float, t: datetime | None = None) -> float:
        """Score ``x`` in ``[0, 1]`` from what was learned before; changes no state."""
        ...


def surprise_from_log10(log10_p: float, half: float = SURPRISE_HALF) -> float:
    """``L / (L + half)`` with ``L = -log10(p)``, given ``log10(p)`` (may be -inf)."""
    if math.isnan(log10_p):
        return 0.0
    decades = max(0.0, -log10_p)
    if math.isinf(decades):
        return 1.0
    return decades / (decades + half)


def surprise(p: float, half: float = SURPRISE_HALF) -> float:
    """Map a tail probability ``p`` to ``[0, 1]`` (see the module docstring)."""
    if not p > 0.0:
        return 0.0 if math.isnan(p) else 1.0
    return surprise_from_log10(math.log10(min(p, 1.0)), half)


def normal_two_sided_p(z: float) -> float:
    """``P(|Z| >= |z|)`` for a standard normal ``Z`` (accurate far into the tail)."""
    return math.erfc(abs(z) / math.sqrt(2.0))


def normal_surprise(z: float) -> float:
    """``surprise`` of the two-sided normal tail of ``z``, exact even where ``p`` underflows."""
    log_p = math.log(2.0) + float(log_ndtr(-abs(z)))
    return surprise_from_log10(log_p / _LN10)


def clip01(value: float) -> float:
    """Clamp to ``[0, 1]``; NaN becomes 0."""
    if not value > 0.0:
        return 0.0
    return min(1.0, value)


def score_series(
    detector: AnomalyDetector,
    values: Iterable[float],
    times: Sequence[datetime | None] | None = None,
) -> list[float]:
    """Run the online protocol over a series: score each point, then learn it.

    >>> class Last:
    ...     name = "last"
    ...     def __init__(self) -> None:
    ...         self.prev: float | None = None
    ...     def score_one(self, x: float, t: datetime | None = None) -> float:
    ...         return 0.0 if self.prev is None else clip01(abs(x - self.prev))
    ...     def learn_one(self, x: float, t: datetime | None = None) -> None:
    ...         self.prev = x
    >>> score_series(Last(), [1.0, 1.0, 1.5, 3.0])
    [0.0, 0.0, 0.5, 1.0]
    """
    scores: list[float] = []
    for i, x in enumerate(values):
        t = times[i] if times is not None else None
        scores.append(detector.score_one(x, t))
        detector.learn_one(x, t)
    return scores
