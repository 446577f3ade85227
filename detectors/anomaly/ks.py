"""Distribution shift: two-sample Kolmogorov-Smirnov, reference window vs recent window."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from datetime import datetime
from functools import cache
from typing import Any

import numpy as np

from loopwatch.detectors.anomaly.base import surprise


@cache
def _ks_2samp() -> Callable[..., Any]:
    """``ks_2samp`` without scipy's axis/NaN-policy wrapper, which costs ~3/4 of a 300 x
    60 test (0.78 ms against 0.17 on the reference machine) and does nothing for the two
    finite 1-D arrays given here: the same statistic and p-value (tests/test_anomaly.py).
    Imported at the first test, not with the module: ``scipy.stats`` is ~0.4 s of import
    beyond ``scipy.special``, which every process that loads the rules would pay (the
    CLI's ``playbook``, ``ruletable``, a test's children) though few run this detector."""
    from scipy.stats import ks_2samp

    return getattr(ks_2samp, "__wrapped__", ks_2samp)


#: scipy's ``MAX_AUTO_N``: up to this many values in each sample, ``method="auto"``
#: is exact
EXACT_MAX_N = 10_000


#: exact p-values by (reference size, recent size, statistic as an integer count): see
#: :func:`ks_p_value`. A warmed-up detector's pair of sizes has at most lcm(n1, n2) + 1
#: statistic values (301 for the defaults), but each warm-up (a new series, its
#: reference growing point by point) adds a key per point, so the memo is emptied
#: once it holds :data:`MEMO_MAX` (~5 MB).
_P_BY_STATISTIC: dict[tuple[int, int, int], float] = {}
MEMO_MAX = 50_000


def ks_statistic_steps(reference: np.ndarray, recent: np.ndarray) -> int:
    """The two-sided KS statistic of two samples as a whole number of 1/lcm(n1, n2)
    steps: the largest gap between their empirical CDFs, computed as scipy's
    ``ks_2samp`` computes it (``searchsorted`` of the pooled values, so ties count
    alike), then rounded to the grid on which its exact method puts it.

    >>> ks_statistic_steps(np.array([1.0, 2.0, 3.0]), np.array([2.5, 4.0]))  # 2/3 at 2.0
    4
    """
    first, second = np.sort(reference), np.sort(recent)
    n1, n2 = first.shape[0], second.shape[0]
    pooled = np.concatenate([first, second])
    gaps = (np.searchsorted(first, pooled, side="right") / n1
            - np.searchsorted(second, pooled, side="right") / n2)
    below, above = np.clip(-gaps.min(), 0, 1), gaps.max()
    statistic = below if below > above else above
    return int(np.round(statistic * (n1 // math.gcd(n1, n2)) * n2))


def ks_p_value(reference: np.ndarray, recent: np.ndarray) -> float:
    """scipy's two-sided ``ks_2samp`` p-value, computed once per statistic value.

    For samples of up to 10,000 values scipy's p-value is exact and depends on the two
    sizes and the statistic alone, which lies on a grid of lcm(n1, n2) + 1 values; the
    detector asks for it at every point it scores (4,000 points of the default
    detector: 67 µs a point without the memo, 43 with it). tests/test_anomaly.py
    compares this with scipy's own on windows with ties and shifts, to the last bit.
    Larger samples go to scipy as is.
    """
    n1, n2 = reference.shape[0], recent.shape[0]
    if max(n1, n2) > EXACT_MAX_N:
        return float(_ks_2samp()(reference, recent).pvalue)
    key = (n1, n2, ks_statistic_steps(reference, recent))
    known = _P_BY_STATISTIC.get(key)
    if known is None:
        if len(_P_BY_STATISTIC) >= MEMO_MAX:
            _P_BY_STATISTIC.clear()
        known = _P_BY_STATISTIC[key] = float(_ks_2samp()(reference, recent).pvalue)
    return known


class KSShift:
    """KS test between the ``reference`` points before the recent ones and the ``recent``.

    Suits per-call distributions whose *shape* matters more than any single value:
    completion-token lengths, tool-call counts per step, latency of one model. A silent
    model update (shorter answers, a new refusal mode, a bimodal length) moves the
    distribution long before any one value is extreme, and the KS test sees a change in
    location, spread or shape alike. The recent window includes the point being scored;
    the reference is the ``reference`` points just before it, so the detector
    re-baselines once a change has aged out of the recent window. Score: the KS
    p-value on the :func:`~loopwatch.detectors.anomaly.base.surprise` scale. Assumes roughly
    independent values; on strongly autocorrelated series it over-reports.

    >>> import numpy as np
    >>> from loopwatch.detectors.anomaly.base import score_series
    >>> rng = np.random.default_rng(5)
    >>> det = KSShift(reference=200, recent=50)
    >>> before = score_series(det, rng.gamma(4.0, 100.0, 400))  # completion lengths
    >>> after = score_series(det, rng.gamma(4.0, 60.0, 60))     # answers 40 % shorter
    >>> max(before) < 0.25, after[10] < 0.25, after[-1] > 0.5   # p < 1e-5 after 60
    (True, True, True)
    """

    def __init__(self, reference: int = 300, recent: int = 60, min_reference: int = 60) -> None:
        if recent < 2 or min_reference < 2:
            raise ValueError("need at least 2 points on each side")
        self.name = "ks"
        self.reference = reference
        self.recent = recent
        self.min_reference = min_reference
        self._held: deque[float] = deque(maxlen=reference + recent - 1)

    def p_value(self, x: float) -> float:
        """KS p-value of (recent incl. ``x``) vs reference; 1.0 while warming up."""
        held = len(self._held)
        if held < self.min_reference + self.recent - 1:
            return 1.0
        values = np.fromiter(self._held, dtype=np.float64, count=held)
        split = held - (self.recent - 1)
        recent = np.append(values[split:], x)
        return ks_p_value(values[:split], recent)

    def score_one(self, x: float, t: datetime | None = None) -> float:
        return surprise(self.p_value(x))

    def learn_one(self, x: float, t: datetime | None = None) -> None:
        self._held.append(x)
