"""Contextual anomaly detection (CAD OSE's method): contexts of facts, scored by novelty."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime

NEURON = 2**31
"""Facts at or above this are active contexts ("neurons"), below it quantised values."""

Facts = tuple[int, ...]


@dataclass(eq=False)
class _Semi:
    """One side of some contexts: a set of facts, and how many the last crossing matched."""

    facts: Facts
    ident: int
    matched: list[int] = field(default_factory=list)
    contexts: dict[int, int] = field(default_factory=dict)
    """Left side only: right semi-context id -> context id."""


@dataclass(eq=False)
class _Context:
    right: Facts
    zero_level: bool
    offered: int = 0
    """Facts its right side offered, summed over the steps its left side fully matched."""
    confirmed: int = 0
    """Of those, the facts that then came true."""
    active: int = 0
    """Steps on which all of its right side came true."""


@dataclass(frozen=True)
class _Verdict:
    selected: int
    active: list[tuple[int, int]]
    potential: list[tuple[Facts, Facts]]


_Raw = tuple[float, bool, _Verdict, dict[int, list[int]]]


class ContextualAnomalyDetector:
    """CAD OSE (Smirnov's Contextual Anomaly Detector, NAB's third-best published entry).

    Each value becomes a few *facts*: it is quantised into ``2 ** bits`` levels of the
    range seen so far, and each bit of the level is one fact (``2 * bit + value``). A
    *context* pairs a left side (the previous step's facts and the contexts then active)
    with a right side (facts that followed). Every step, the contexts whose left side
    fully held last step are *selected*; those whose right side now fully holds too are
    *active* and become facts of the next left side (the ``max_active`` most often active),
    so contexts chain into longer and longer learned sequences. New contexts are recorded
    from the partial overlaps, with left sides of at most ``max_left`` facts.

    The raw score, when the step's facts were not all predicted (the right sides of the
    best-confirmed contexts selected last step), is ``(1 - active / selected + new /
    candidates) / 2``: few familiar sequences held and many new contexts were needed.
    CAD OSE's own refractory then reports a score only if no raw score of the last
    ``rest`` points reached ``base_threshold`` (its first ``rest`` points are silent).

    Unlike CAD OSE under NAB, which is handed the file's minimum and maximum, the levels
    are drawn over the range seen so far (including the point being scored), so nothing
    looks ahead; contexts learned while the range was narrower keep their facts.

    Memory grows with the number of distinct contexts (tens of thousands on a long noisy
    series): the price of remembering sequences rather than a window.

    >>> from loopwatch.detectors.anomaly.base import score_series
    >>> values = [float(i % 4) for i in range(600)]        # 0 1 2 3 0 1 2 3 ...
    >>> values[500:504] = [3.0, 3.0, 0.0, 0.0]             # the sequence breaks once
    >>> scores = score_series(ContextualAnomalyDetector(rest=30), values)
    >>> max(scores[100:500]), [i for i, s in enumerate(scores) if s > 0.3]
    (0.0, [500])
    """

    def __init__(
        self,
        bits: int = 3,
        rest: int = 150,
        base_threshold: float = 0.75,
        max_left: int = 7,
        max_active: int = 15,
        warmup: int = 0,
        margin: float = 0.25,
        name: str = "cad_ose",
    ) -> None:
        if bits < 1 or rest < 1 or max_left < 1 or max_active < 0 or warmup < 0:
            raise ValueError("bits, rest and max_left must be >= 1, max_active, warmup >= 0")
        self.name = name
        self.bits, self.rest, self.base_threshold = bits, rest, base_threshold
        self.max_left, self.max_active = max_left, max_active
        self._top = 2**bits - 1
        self.warmup, self.margin = warmup, margin
        self._buffer: list[float] | None = [] if warmup else None
        self._low, self._high = math.inf, -math.inf
        self._left_group: Facts = ()
        self._predicted: frozenset[int] = frozenset()
        self._semis: tuple[dict[Facts, _Semi], dict[Facts, _Semi]] = ({}, {})
        self._by_fact: tuple[dict[int, list[_Semi]], dict[int, list[_Semi]]] = ({}, {})
        self._rights: list[_Semi] = []
        self._contexts: list[_Context] = []
        self._crossed_left: list[_Semi] = []
        self._seen_contexts = 0
        self._history: deque[float] = deque([1.0], maxlen=rest)
        self._n = 0
        self._cache: tuple[tuple[float, int], _Raw] | None = None

    # -- quantisation -------------------------------------------------------------------

    def facts(self, x: float) -> Facts:
        """The value's facts: one per bit of its level in the range seen so far (and x).

        >>> d = ContextualAnomalyDetector()
        >>> d.learn_one(0.0); d.learn_one(7.0)
        >>> d.facts(0.0), d.facts(5.0), d.facts(7.0)
        ((0, 2, 4), (1, 2, 5), (1, 3, 5))
        """
        low, high = self._low, self._high
        if self._buffer is not None or not self.warmup:
            low, high = min(low, x), max(high, x)
        span = high - low if high > low else float(self._top)
        level = min(self._top, max(0, int((x - low) / (span / self._top))))
        return tuple(2 * bit + ((level >> bit) & 1) for bit in range(self.bits))

    def _prediction_error(self, facts: Facts) -> float:
        missed = sum(2 ** (f // 2) for f in facts if f not in self._predicted)
        return missed / self._top

    # -- the step ---------------------------------------------------------------------

    def _right_matches(self, facts: Facts) -> dict[int, list[int]]:
        matches: dict[int, list[int]] = {}
        for f in facts:
            for semi in self._by_fact[1].get(f, ()):
                matches.setdefault(semi.ident, []).append(f)
        return matches

    def _zero_level(self, facts: Facts) -> tuple[bool, int | None]:
        """Whether (last left group, facts) is a new context, and its id if it exists."""
        if not self._left_group or not facts:
            return False, None
        left, right = self._semis[0].get(self._left_group), self._semis[1].get(facts)
        if left is not None and right is not None and right.ident in left.contexts:
            return False, left.contexts[right.ident]
        return True, None

    def _verdict(self, right: dict[int, list[int]], new_flag: bool) -> _Verdict:
        """What the contexts selected last step say about this step (reads only)."""
        selected, active, potential = 0, [], []
        for left in self._crossed_left:
            full = len(left.matched) == len(left.facts)
            for right_id, context_id in left.contexts.items():
                context, hit = self._contexts[context_id], right.get(right_id, ())
                if full:
                    selected += 1
                    if hit and len(hit) == len(self._rights[right_id].facts):
                        active.append((context_id, context.active + 1))
                        continue
                if hit and context.zero_level and new_flag and len(left.matched) <= self.max_left:
                    potential.append((tuple(left.matched), tuple(hit)))
        return _Verdict(selected, active, potential)

    def _exists(self, left: Facts, right: Facts) -> bool:
        semi, other = self._semis[0].get(left), self._semis[1].get(right)
        return semi is not None and other is not None and other.ident in semi.contexts

    def _raw(self, facts: Facts) -> _Raw:
        new_flag, _ = self._zero_level(facts)
        right = self._right_matches(facts)
        verdict = self._verdict(right, new_flag)
        if self._prediction_error(facts) <= 0.0:
            return 0.0, new_flag, verdict, right
        share_active = len(verdict.active) / verdict.selected if verdict.selected else 0.0
        share_new = 0.0
        if new_flag:
            zero = (self._left_group, facts)
            candidates = {zero, *verdict.potential}
            new = 1 + sum(1 for c in candidates if c != zero and not self._exists(*c))
            share_new = new / len(candidates)
        return (1.0 - share_active + share_new) / 2.0, new_flag, verdict, right

    def _evaluate(self, x: float) -> _Raw:
        key = (x, self._n)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._raw(self.facts(x)))
        return self._cache[1]

    def score_one(self, x: float, t: datetime | None = None) -> float:
        if self._buffer is not None:
            return 0.0
        raw = self._evaluate(x)[0]
        return raw if max(self._history) < self.base_threshold else 0.0

    def learn_one(self, x: float, t: datetime | None = None) -> None:
        if self._buffer is not None:
            self._buffer.append(x)
            self._low, self._high = min(self._low, x), max(self._high, x)
            if len(self._buffer) < self.warmup:
                return
            buffered, self._buffer = self._buffer, None
            pad = self.margin * (self._high - self._low)
            self._low, self._high = self._low - pad, self._high + pad
            for value in buffered:
                self._learn(value)
            return
        self._learn(x)

    def _learn(self, x: float) -> None:
        facts = self.facts(x)
        raw, _, verdict, right = self._evaluate(x)
        if self._left_group and facts:
            zero = self._add(self._left_group, facts, zero_level=True)
            self._contexts[zero].zero_level = True
        self._commit(verdict, right)
        for left, matched in verdict.potential:
            if not self._exists(left, matched):
                self._add(left, matched, zero_level=False)
        ranked = sorted(verdict.active, key=lambda a: (a[1], a[0]))[-self.max_active :]
        neurons = {NEURON + context_id for context_id, _ in ranked} if self.max_active else set()
        self._left_group = tuple(sorted({*facts, *neurons}))
        self._predicted = self._cross_left()
        self._history.append(raw)
        if not self.warmup:
            self._low, self._high = min(self._low, x), max(self._high, x)
        self._n += 1
        self._cache = None

    def _commit(self, verdict: _Verdict, right: dict[int, list[int]]) -> None:
        """The selected contexts' statistics (what :meth:`_verdict` read), updated."""
        active = {context_id for context_id, _ in verdict.active}
        for left in self._crossed_left:
            if len(left.matched) != len(left.facts):
                continue
            for right_id, context_id in left.contexts.items():
                if context_id >= self._seen_contexts:  # recorded this step
                    continue
                context = self._contexts[context_id]
                context.offered += len(self._rights[right_id].facts)
                context.confirmed += len(right.get(right_id, ()))
                if context_id in active:
                    context.active += 1

    def _add(self, left: Facts, right: Facts, zero_level: bool) -> int:
        semi = self._semi(0, left)
        other = self._semi(1, right)
        if other.ident not in semi.contexts:
            semi.contexts[other.ident] = len(self._contexts)
            self._contexts.append(_Context(right, zero_level))
        return semi.contexts[other.ident]

    def _semi(self, side: int, facts: Facts) -> _Semi:
        semi = self._semis[side].get(facts)
        if semi is None:
            semi = _Semi(facts, len(self._semis[side]))
            self._semis[side][facts] = semi
            for f in facts:
                self._by_fact[side].setdefault(f, []).append(semi)
            if side == 1:
                self._rights.append(semi)
        return semi

    def _cross_left(self) -> frozenset[int]:
        """Match every left side against the new left group; predict the right sides of
        the best-confirmed contexts among those fully matched."""
        for semi in self._crossed_left:
            semi.matched = []
        crossed: dict[int, _Semi] = {}
        for f in self._left_group:
            for semi in self._by_fact[0].get(f, ()):
                semi.matched.append(f)
                crossed[semi.ident] = semi
        self._crossed_left = list(crossed.values())
        self._seen_contexts = len(self._contexts)
        best, predicted = 0.0, []
        for semi in self._crossed_left:
            if len(semi.matched) != len(semi.facts):
                continue
            for context_id in semi.contexts.values():
                context = self._contexts[context_id]
                weight = context.confirmed / context.offered if context.offered else 0.0
                if weight > best:
                    best, predicted = weight, [context]
                elif weight == best:
                    predicted.append(context)
        return frozenset(f for context in predicted for f in context.right)
