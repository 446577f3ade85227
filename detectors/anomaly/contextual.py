"""Contextual novelty: has this value been seen in this context before (CAD OSE's idea)."""

from __future__ import annotations

import math
from collections import deque
from datetime import datetime
from typing import NamedTuple

Context = tuple[object, ...]


class _Evaluation(NamedTuple):
    key: tuple[float, datetime | None, int]
    score: float
    level: int
    contexts: list[tuple[Context, int]]


class ContextNovelty:
    """The share of the point's contexts in which its quantised value is new.

    After the Contextual Anomaly Detector (CAD OSE, NAB's third-best entry): a value is
    quantised into ``levels`` bins over the range learned so far (one bin more on either
    side for values outside it), and judged in a few contexts: the previous ``k`` bins
    for each ``k`` in ``orders`` (the shape of the recent past), and the hour of day
    (``time_slot`` seconds per slot; 0 turns it off). A (context, bin) pair never seen
    before is novel, and counts for ``c / (c + support)`` where ``c`` is how often the
    context itself was seen: a new value after a familiar context is surprising, one
    after a context seen twice is not yet. The score is the mean over contexts, in
    ``[0, 1]``. It catches what a residual cannot: a daily jump that does not happen, a
    pattern that has never occurred, without assuming a distribution. A series that is
    flat or exactly periodic scores 0 once learned.

    Memory is one dictionary entry per distinct (context, bin) pair: at most
    ``(levels + 2) ** (max(orders) + 1)`` plus ``slots * (levels + 2)``, a few thousand.
    Use it inside :class:`~loopwatch.detectors.anomaly.refractory.Refractory`, which reports each
    burst of novelty once.

    >>> from datetime import timedelta
    >>> from loopwatch.detectors.anomaly.base import score_series
    >>> start = datetime(2024, 1, 1)
    >>> times = [start + timedelta(hours=h) for h in range(24 * 20)]
    >>> day = [80.0 if 9 <= t.hour < 17 else 20.0 for t in times]
    >>> missing = day[: 24 * 19] + [20.0] * 24          # day 20: the jump never comes
    >>> scores = score_series(ContextNovelty(), missing, times)
    >>> max(scores[24 * 3 : 24 * 19]), round(max(scores[24 * 19 :]), 4)  # 19/(19+30)/3
    (0.0, 0.1293)
    """

    def __init__(
        self,
        levels: int = 8,
        orders: tuple[int, ...] = (1, 2),
        time_slot: int = 3600,
        support: float = 30.0,
    ) -> None:
        if levels < 1 or any(k < 1 for k in orders) or time_slot < 0 or support < 0:
            raise ValueError("levels and orders must be >= 1, time_slot and support >= 0")
        self.name = "contextual"
        self.levels = levels
        self.orders = tuple(orders)
        self.time_slot = time_slot
        self.support = support
        self._low = math.inf
        self._high = -math.inf
        self._history: deque[int] = deque(maxlen=max(self.orders, default=1))
        self._pairs: dict[tuple[Context, int], int] = {}
        self._seen: dict[Context, int] = {}
        self._n = 0
        self._last: _Evaluation | None = None

    def _level(self, x: float) -> int:
        if x > self._high:
            return self.levels
        if x < self._low:
            return -1
        if not self._high > self._low:
            return 0
        return min(self.levels - 1, math.floor(self.levels * (x - self._low)
                                               / (self._high - self._low)))

    def _evaluate(self, x: float, t: datetime | None) -> _Evaluation:
        key = (x, t, self._n)
        if self._last is not None and self._last.key == key:
            return self._last
        level = self._level(x)
        past = list(self._history)
        contexts: list[tuple[Context, int]] = [
            (("seq", *past[-k:]), level) for k in self.orders if len(past) >= k
        ]
        if self.time_slot and t is not None:
            slot = (t.hour * 3600 + t.minute * 60 + t.second) // self.time_slot
            contexts.append((("slot", slot), level))
        novelty = 0.0
        for pair in contexts:
            if pair not in self._pairs:
                seen = self._seen.get(pair[0], 0)
                novelty += seen / (seen + self.support) if seen else 0.0
        score = novelty / len(contexts) if contexts else 0.0
        self._last = _Evaluation(key, score, level, contexts)
        return self._last

    def score_one(self, x: float, t: datetime | None = None) -> float:
        return self._evaluate(x, t).score

    def learn_one(self, x: float, t: datetime | None = None) -> None:
        evaluation = self._evaluate(x, t)
        for pair in evaluation.contexts:
            self._pairs[pair] = self._pairs.get(pair, 0) + 1
            self._seen[pair[0]] = self._seen.get(pair[0], 0) + 1
        self._history.append(evaluation.level)
        self._low = min(self._low, x)
        self._high = max(self._high, x)
        self._n += 1
