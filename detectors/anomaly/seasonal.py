"""Seasonal baseline: compare a point with the same hour of the week (or of the day)."""

from __future__ import annotations

from collections import deque
from datetime import datetime, timedelta
from typing import NamedTuple

import numpy as np
from scipy.special import stdtr

from loopwatch.detectors.anomaly.base import surprise
from loopwatch.detectors.anomaly.rolling import MEAN_AD_TO_SIGMA, median, robust_scale

WEEK_SECONDS = 7 * 86400
DAY_SECONDS = 86400


class BucketStats(NamedTuple):
    center: float
    scale: float
    size: int


def seconds_into_week(t: datetime) -> int:
    """Seconds since Monday 00:00 in ``t``'s own clock (its timezone, if any).

    >>> seconds_into_week(datetime(2024, 1, 2, 1, 0, 30))  # a Tuesday
    90030
    """
    return t.weekday() * DAY_SECONDS + t.hour * 3600 + t.minute * 60 + t.second


class SeasonalBaseline:
    """Robust z of a point against past points in the same hour-of-week bucket.

    Suits traffic-shaped metrics: runs started per minute, tokens per minute, spend per
    hour. They swing by design between night and day and between weekdays and weekends,
    so a global threshold either fires every morning or sleeps through a dead Tuesday
    afternoon. Each bucket keeps its last ``history`` values; a point is scored by its
    robust z (median, MAD) against its hour-of-week bucket, or, while that bucket has
    fewer than ``min_count`` values or has seen only one week, against its hour-of-day
    bucket.
    The scale is floored at ``scale_floor`` times the series' overall spread so that a
    bucket which happened to be constant does not make every small wiggle an alarm, and
    the tail probability is Student's t with the bucket's degrees of freedom.
    Without timestamps, points are taken to be ``step`` apart from a Monday midnight.

    >>> det = SeasonalBaseline()
    >>> start = datetime(2024, 1, 1)
    >>> for hour in range(24 * 14):  # two weeks: busy days, quiet nights
    ...     t = start + timedelta(hours=hour)
    ...     det.learn_one(100.0 + hour % 3 if 8 <= t.hour < 20 else 10.0 + hour % 3, t)
    >>> noon, night = datetime(2024, 1, 15, 12), datetime(2024, 1, 15, 2)
    >>> det.score_one(101.0, noon) < 0.1, det.score_one(101.0, night) > 0.7
    (True, True)
    >>> det.score_one(10.0, noon) > 0.7    # a dead daytime hour
    True
    """

    def __init__(
        self,
        bucket_seconds: int = 3600,
        history: int = 48,
        min_count: int = 8,
        scale_floor: float = 0.05,
        spread_alpha: float = 0.002,
        step: timedelta = timedelta(minutes=1),
    ) -> None:
        if DAY_SECONDS % bucket_seconds:
            raise ValueError("bucket_seconds must divide a day")
        self.name = "seasonal"
        self.bucket_seconds = bucket_seconds
        self.history = history
        self.min_count = min_count
        self.scale_floor = scale_floor
        self.spread_alpha = spread_alpha
        self.step = step
        per_day = DAY_SECONDS // bucket_seconds
        self._week: list[deque[float]] = [deque(maxlen=history) for _ in range(7 * per_day)]
        self._day: list[deque[float]] = [deque(maxlen=history) for _ in range(per_day)]
        self._per_day = per_day
        self._n = 0
        self._level = 0.0
        self._spread = 0.0
        self._clock = datetime(2024, 1, 1)  # a Monday
        self._weeks_seen = [0] * (7 * per_day)
        self._last_week = [-1] * (7 * per_day)
        self._cache: tuple[tuple[int, int], BucketStats | None] | None = None

    def _when(self, t: datetime | None) -> datetime:
        return t if t is not None else self._clock + self.step * self._n

    def _buckets(self, t: datetime) -> tuple[int, int]:
        week_bucket = seconds_into_week(t) // self.bucket_seconds
        return week_bucket, week_bucket % self._per_day

    def stats(self, t: datetime | None = None) -> BucketStats | None:
        """Median, robust sigma and size of the bucket for ``t``; None while too few points.

        The hour-of-week bucket is used once it holds ``min_count`` values from at least
        two different weeks, the hour-of-day bucket before that.
        """
        when = self._when(t)
        week_bucket, day_bucket = self._buckets(when)
        key = (week_bucket, self._n)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        past = self._week[week_bucket]
        if len(past) < self.min_count or self._weeks_seen[week_bucket] < 2:
            past = self._day[day_bucket]
        result: BucketStats | None = None
        if len(past) >= self.min_count:
            values = np.fromiter(past, dtype=np.float64, count=len(past))
            center = median(values)
            floor = self.scale_floor * MEAN_AD_TO_SIGMA * self._spread
            result = BucketStats(center, max(robust_scale(values, center), floor), len(past))
        self._cache = key, result
        return result

    def expected(self, t: datetime | None = None) -> float | None:
        """The bucket median for ``t`` (None while warming up)."""
        stats = self.stats(t)
        return None if stats is None else stats.center

    def z(self, x: float, t: datetime | None = None) -> float:
        """Robust z against the point's bucket (0 while warming up)."""
        stats = self.stats(t)
        return 0.0 if stats is None else (x - stats.center) / stats.scale

    def score_one(self, x: float, t: datetime | None = None) -> float:
        stats = self.stats(t)
        if stats is None:
            return 0.0
        # Student's t with the bucket's degrees of freedom: a bucket of 8 values pins its
        # median and spread down far less than a rolling window of hundreds does.
        z = (x - stats.center) / stats.scale
        return surprise(2.0 * float(stdtr(stats.size - 1, -abs(z))))

    def learn_one(self, x: float, t: datetime | None = None) -> None:
        when = self._when(t)
        week_bucket, day_bucket = self._buckets(when)
        self._week[week_bucket].append(x)
        self._day[day_bucket].append(x)
        week = (when.toordinal() - 1) // 7  # ordinal 1 (0001-01-01) is a Monday
        if self._last_week[week_bucket] != week:
            self._last_week[week_bucket] = week
            self._weeks_seen[week_bucket] += 1
        self._n += 1
        self._cache = None
        alpha = max(self.spread_alpha, 1.0 / self._n)
        self._spread += alpha * (abs(x - self._level) - self._spread)
        self._level += alpha * (x - self._level)
