"""Proportions from small counts: a beta-binomial tail test (errors out of runs, etc.)."""

from __future__ import annotations

import math
from datetime import datetime

import numpy as np
from scipy.special import betaln, gammaln

from loopwatch.detectors.anomaly.base import surprise


def beta_binomial_tails(k: int, n: int, a: float, b: float) -> tuple[float, float]:
    """``(P(K <= k), P(K >= k))`` for ``K ~ BetaBinomial(n, a, b)``.

    >>> lower, upper = beta_binomial_tails(3, 10, 1.0, 1.0)  # uniform over 0..10
    >>> round(lower, 6), round(upper, 6)
    (0.363636, 0.727273)
    """
    j = np.arange(n + 1, dtype=np.float64)
    log_pmf = (
        gammaln(n + 1.0)
        - gammaln(j + 1.0)
        - gammaln(n - j + 1.0)
        + betaln(j + a, n - j + b)
        - betaln(a, b)
    )
    pmf = np.exp(log_pmf)
    return min(1.0, float(pmf[: k + 1].sum())), min(1.0, float(pmf[k:].sum()))


class ProportionDetector:
    """Is ``k`` successes out of ``n`` trials unusual given the recent rate?

    Suits rates built from small counts per interval: failed runs out of runs this
    minute, tool errors out of tool calls, refusals out of completions, guardrail hits.
    With 3 runs a minute a z-score on the ratio is meaningless (0/3, 1/3, 3/3 are all
    routine), while 12 failures out of 40 after a 5 % baseline is a page. The recent rate
    is a Beta posterior (Jeffreys prior) over exponentially forgotten counts
    (``forget`` per observation); the new count is scored by its tail probability under
    the posterior predictive beta-binomial, which is wide when little has been seen and
    when ``n`` is small. ``side`` picks rises (``"upper"``), drops (``"lower"``) or both.

    The plain :class:`~loopwatch.detectors.anomaly.base.AnomalyDetector` interface takes the ratio
    ``x = k / n`` with ``n = trials``; prefer ``score_counts``/``learn_counts``.

    >>> det = ProportionDetector(side="upper")
    >>> for _ in range(60):
    ...     det.learn_counts(1, 20)       # 5 % errors, 20 calls a minute
    >>> round(det.rate, 3)
    0.05
    >>> det.score_counts(2, 20) < 0.15    # 2/20: routine (p = 0.3)
    True
    >>> det.score_counts(9, 20) > 0.5     # 9/20: a jump (p < 1e-5)
    True
    >>> det.score_counts(1, 2) < 0.2      # 1/2: too few calls to say (p = 0.1)
    True
    """

    def __init__(
        self,
        forget: float = 0.99,
        side: str = "two-sided",
        trials: int = 100,
        min_trials: float = 20.0,
        prior: tuple[float, float] = (0.5, 0.5),
    ) -> None:
        if side not in ("upper", "lower", "two-sided"):
            raise ValueError(f"side must be upper, lower or two-sided, not {side!r}")
        if not 0.0 < forget <= 1.0:
            raise ValueError("forget must be in (0, 1]")
        self.name = "proportion"
        self.forget = forget
        self.side = side
        self.trials = trials
        self.min_trials = min_trials
        self.prior = prior
        self._successes = 0.0
        self._trials = 0.0

    @property
    def rate(self) -> float:
        """The posterior mean of the recent rate."""
        a, b = self.prior
        return (a + self._successes) / (a + b + self._trials)

    def p_value(self, k: int, n: int) -> float:
        """Tail probability of ``k`` out of ``n``; 1.0 while fewer than ``min_trials``."""
        _check_counts(k, n)
        if n == 0 or self._trials < self.min_trials:
            return 1.0
        a = self.prior[0] + self._successes
        b = self.prior[1] + self._trials - self._successes
        lower, upper = beta_binomial_tails(k, n, a, b)
        if self.side == "upper":
            return upper
        if self.side == "lower":
            return lower
        return min(1.0, 2.0 * min(lower, upper))

    def score_counts(self, k: int, n: int) -> float:
        return surprise(self.p_value(k, n))

    def learn_counts(self, k: int, n: int) -> None:
        _check_counts(k, n)
        self._successes = self.forget * self._successes + k
        self._trials = self.forget * self._trials + n

    def _counts(self, x: float) -> tuple[int, int]:
        ratio = min(1.0, max(0.0, x)) if math.isfinite(x) else 0.0
        return round(ratio * self.trials), self.trials

    def score_one(self, x: float, t: datetime | None = None) -> float:
        """Score a ratio in ``[0, 1]`` (clamped) as ``round(x * trials)`` of ``trials``."""
        return self.score_counts(*self._counts(x))

    def learn_one(self, x: float, t: datetime | None = None) -> None:
        self.learn_counts(*self._counts(x))


def _check_counts(k: int, n: int) -> None:
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
