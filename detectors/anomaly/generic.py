"""The generic detector for per-minute metric series: residual -> likelihood -> alerts."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime

from loopwatch.detectors.anomaly.base import normal_surprise, surprise, surprise_from_log10
from loopwatch.detectors.anomaly.likelihood import AnomalyLikelihood
from loopwatch.detectors.anomaly.robust_z import RobustZScore
from loopwatch.detectors.anomaly.seasonal import SeasonalBaseline

MODELS = ("robust", "seasonal", "hybrid")


@dataclass(frozen=True)
class GenericConfig:
    """Knobs of :class:`GenericDetector`; defaults are the registered ``generic``."""

    model: str = "hybrid"
    """``robust`` (rolling median), ``seasonal`` (hour-of-week/day buckets) or ``hybrid``
    (whichever of the two has had the smaller recent absolute error)."""
    window: int = 360
    """Points in the rolling median/MAD window."""
    select_alpha: float = 0.01
    """Forgetting rate of the hybrid's running absolute errors."""
    bucket_seconds: int = 3600
    seasonal_history: int = 48
    """Seasonal buckets: their width and how many past values each keeps."""
    raw: str = "surprise"
    """Raw score fed to the likelihood: ``surprise`` of the residual's two-sided p
    (``L / (L + 5)``, keeps growing with the size of the residual) or ``erf``
    (``1 - p``, Numenta-like, saturates near 4 sigma)."""
    average: int = 10
    history: int = 8640
    learning: int = 388
    """Anomaly-likelihood settings (Numenta's defaults)."""
    spatial_tolerance: float | None = 0.05
    """Flag values beyond the range seen so far by this fraction of it (None: off)..."""
    spatial_min_z: float = 4.0
    """...when their residual is also at least this many sigmas..."""
    spatial_warmup: int = 0
    """...and, once the likelihood has learned (``learning`` points), only after the range
    has been seen for this many points: while the likelihood learns, the range check is
    the only voice and stays on (0: always on)."""
    settled_tolerance: float | None = None
    settled_min_z: float | None = None
    """The range check's tolerance and sigmas once the range is *settled*: seen for
    ``max(learning, spatial_warmup)`` points (None: ``spatial_tolerance`` and
    ``spatial_min_z``). A young range is still being explored and ordinary traffic breaks
    it, so it needs the wide margin; a range that has held for days is broken by little
    but an incident, so a record by a smaller margin is already news."""
    red: float = surprise(1e-5)
    yellow: float | None = surprise(1e-3)
    """After a point at ``red`` or above, further ones are capped at ``yellow`` until the
    score drops below ``red`` (None: no cap)."""


@dataclass(frozen=True)
class _Evaluation:
    key: tuple[float, datetime | None, int]
    z: float
    raw: float
    score: float


class GenericDetector:
    """A robust residual, judged by its anomaly likelihood, alerting once per episode.

    Suits the generic per-minute series the alert rules watch (runs per minute, tokens
    per minute, error counts, p95 latency, spend) when nothing more specific is known:

    1. *Residual.* The point's robust z against what the series usually does: the rolling
       median/MAD (``robust``), the same hour of the week or day (``seasonal``), or, for
       ``hybrid``, whichever of the two has recently predicted the series better (mean
       absolute error, forgetting rate ``select_alpha``), so traffic-shaped metrics get the
       seasonal baseline and flat ones the recent level, without configuration.
    2. *Likelihood.* The residual's surprise (its two-sided normal p on the
       :func:`~loopwatch.detectors.anomaly.base.surprise` scale) goes through
       :class:`AnomalyLikelihood`: the mean of the last 10 against this series' own
       history of such means. Noisy series stop alerting on routine noise, a burst of
       moderately odd points adds up, and one wild point still stands out.
    3. *Range.* A value beyond the range seen so far by more than ``spatial_tolerance`` of
       that range, and at least ``spatial_min_z`` sigmas off the baseline, scores 1.0
       (Numenta's "spatial anomaly"; the z condition keeps noise from setting records).
       Optionally it pauses once the likelihood has learned (``spatial_warmup``) and
       then judges a settled range by its own margin (``settled_tolerance``,
       ``settled_min_z``).
    4. *Once per episode.* After a score of ``red`` (p <= 1e-5) or more, the next points
       are capped at ``yellow`` (p = 1e-3) until the score falls below ``red`` again
       (Numenta's likelihood filter): one page per incident, not one per minute of it.

    The defaults (``hybrid``, surprise, range check and cap on) were chosen among the
    :data:`CANDIDATES` on NAB; ``python -m loopwatch.bench.nab_score --loo`` shows every candidate
    and the leave-one-file-out estimate of making that choice.

    >>> import numpy as np
    >>> from datetime import timedelta
    >>> from loopwatch.detectors.anomaly.base import score_series
    >>> rng = np.random.default_rng(1)
    >>> values = list(20 + rng.normal(0, 1, 1500))
    >>> values[1200:] = [v + 8 for v in values[1200:]]           # a level shift at 1200
    >>> start = datetime(2024, 1, 1)
    >>> times = [start + timedelta(minutes=i) for i in range(len(values))]
    >>> scores = score_series(GenericDetector(), values, times)
    >>> max(scores[400:1200]) < 0.5, scores[1200] >= 0.5
    (True, True)
    >>> sum(s >= 0.5 for s in scores[1200:])                       # a few alerts, not 300
    3
    """

    def __init__(self, config: GenericConfig | None = None, name: str = "generic") -> None:
        self.config = config or GenericConfig()
        if self.config.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, not {self.config.model!r}")
        if self.config.raw not in ("surprise", "erf"):
            raise ValueError(f"raw must be 'surprise' or 'erf', not {self.config.raw!r}")
        self.name = name
        cfg = self.config
        self._robust = RobustZScore(window=cfg.window) if cfg.model != "seasonal" else None
        self._seasonal = (
            SeasonalBaseline(bucket_seconds=cfg.bucket_seconds, history=cfg.seasonal_history)
            if cfg.model != "robust"
            else None
        )
        self._likelihood = AnomalyLikelihood(
            average=cfg.average, history=cfg.history, learning=cfg.learning
        )
        self._errors: dict[str, float] = {}
        self._low = math.inf
        self._high = -math.inf
        self._previous_red = False
        self._n = 0
        self._last: _Evaluation | None = None

    # -- the pipeline -------------------------------------------------------------------

    def _z(self, x: float, t: datetime | None) -> float:
        robust, seasonal = self._robust, self._seasonal
        if robust is not None and seasonal is not None:
            if seasonal.stats(t) is not None and (
                self._errors.get("seasonal", math.inf) < self._errors.get("robust", math.inf)
            ):
                return seasonal.z(x, t)
            return robust.z(x)
        if robust is not None:
            return robust.z(x)
        assert seasonal is not None
        return seasonal.z(x, t)

    def _evaluate(self, x: float, t: datetime | None) -> _Evaluation:
        key = (x, t, self._n)
        if self._last is not None and self._last.key == key:
            return self._last
        z = self._z(x, t)
        raw = math.erf(abs(z) / math.sqrt(2.0)) if self.config.raw == "erf" else normal_surprise(z)
        score = surprise_from_log10(self._likelihood.log10_tail(raw))
        check = self._range_check()
        if check is not None and self._high > self._low:
            tolerance, min_z = check
            margin = tolerance * (self._high - self._low)
            outside = x > self._high + margin or x < self._low - margin
            if outside and abs(z) >= min_z:
                score = 1.0
        self._last = _Evaluation(key, z, raw, score)
        return self._last

    def _range_check(self) -> tuple[float, float] | None:
        """The range check's (tolerance, sigmas) at this point, or None while it waits."""
        cfg = self.config
        if cfg.spatial_tolerance is None:
            return None
        if self._n < cfg.learning:
            return cfg.spatial_tolerance, cfg.spatial_min_z
        if self._n < cfg.spatial_warmup:
            return None
        return (
            cfg.spatial_tolerance if cfg.settled_tolerance is None else cfg.settled_tolerance,
            cfg.spatial_min_z if cfg.settled_min_z is None else cfg.settled_min_z,
        )

    def score_one(self, x: float, t: datetime | None = None) -> float:
        score = self._evaluate(x, t).score
        cfg = self.config
        if cfg.yellow is not None and self._previous_red and score >= cfg.red:
            return min(score, cfg.yellow)
        return score

    def learn_one(self, x: float, t: datetime | None = None) -> None:
        evaluation = self._evaluate(x, t)
        self._track_errors(x, t)
        if self._robust is not None:
            self._robust.learn_one(x, t)
        if self._seasonal is not None:
            self._seasonal.learn_one(x, t)
        self._likelihood.learn(evaluation.raw)
        self._previous_red = evaluation.score >= self.config.red
        self._low = min(self._low, x)
        self._high = max(self._high, x)
        self._n += 1

    def _track_errors(self, x: float, t: datetime | None) -> None:
        if self._robust is None or self._seasonal is None:
            return
        alpha = self.config.select_alpha
        for model, expected in (
            ("robust", self._robust.expected()),
            ("seasonal", self._seasonal.expected(t)),
        ):
            if expected is None:
                continue
            error = abs(x - expected)
            previous = self._errors.get(model)
            self._errors[model] = error if previous is None else previous + alpha * (
                error - previous
            )


CANDIDATES: dict[str, GenericConfig] = {
    f"{model}/{raw}{'+range' if spatial else ''}{'+cap' if cap else ''}": replace(
        GenericConfig(),
        model=model,
        raw=raw,
        spatial_tolerance=0.05 if spatial else None,
        yellow=surprise(1e-3) if cap else None,
    )
    for model in MODELS
    for raw in ("surprise", "erf")
    for spatial in (True, False)
    for cap in (True, False)
}
"""The configurations considered for ``generic``, fixed before looking at NAB's real
series; ``python -m loopwatch.bench.nab_score --loo`` cross-validates the choice among them."""
