"""Adaptive resonance over windows of recent values (after ARTime): a novel shape pages."""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from datetime import datetime

import numpy as np
import numpy.typing as npt

from loopwatch.detectors.anomaly.base import clip01

FloatArray = npt.NDArray[np.float64]

NEW_CLUSTER = -1
"""What :meth:`Resonance.classify` returns for a sample no category resonates with."""


def haar(values: FloatArray) -> FloatArray:
    """The full orthonormal Haar transform of a power-of-two-long vector.

    Coarsest approximation first, then the details from coarse to fine.

    >>> haar(np.array([1.0, 1.0, 1.0, 1.0])).round(6).tolist()
    [2.0, 0.0, 0.0, 0.0]
    >>> haar(np.array([0.0, 1.0])).round(6).tolist()
    [0.707107, -0.707107]
    """
    out = values.astype(np.float64, copy=True)
    n = len(out)
    while n > 1:
        pairs = out[:n].reshape(-1, 2)
        approx = (pairs[:, 0] + pairs[:, 1]) / math.sqrt(2.0)
        detail = (pairs[:, 0] - pairs[:, 1]) / math.sqrt(2.0)
        out[: n // 2], out[n // 2 : n] = approx, detail
        n //= 2
    return out


def unit_range(values: FloatArray) -> FloatArray:
    """Shift to a minimum of 0 and scale to a maximum of 1 (a constant vector becomes 0)."""
    shifted = values - values.min()
    top = shifted.max()
    return shifted / top if top > 0 else shifted


@dataclass(frozen=True)
class Match:
    """How one complement-coded sample resonates with every category (nothing learned)."""

    sample: FloatArray
    fuzzy: FloatArray
    """``min(sample, W_j)`` per category: what a category becomes if it learns the sample."""
    match: FloatArray
    """``feature_similarity ** 3 * energy_similarity ** 2`` per category."""
    energy: FloatArray
    best: float
    """The largest match (0 with no categories): the sample's similarity to what is known."""
    best_energy: float


class Resonance:
    """Fuzzy ART with two vigilances (distributed dual-vigilance fuzzy ART, as in ARTime).

    Samples in ``[0, 1]`` are complement coded (``[x, 1 - x]``) and matched against every
    category ``W`` by ``|min(x, W)| / |W|`` (a category is a box; inside it, 1), cubed,
    times the square of the same ratio over two *energy* components (the latest value and
    its complement), so a window whose shape is familiar but whose level is new matches
    badly. Categories matching at ``rho_ub`` or more learn the sample (their box grows to
    hold it); if none does, a sample matching some category at ``rho_lb`` or more founds a
    new category of that cluster, and one below ``rho_lb`` everywhere founds a new
    cluster: :data:`NEW_CLUSTER`, the anomaly. The first sample ever founds a blank
    category (all ones) and learns nothing.

    >>> art = Resonance(dim=2, rho_lb=0.9, rho_ub=0.9)
    >>> art.learn(np.array([0.1, 0.1]))     # the blank category
    1
    >>> art.learn(np.array([0.1, 0.1])), art.learn(np.array([0.12, 0.1]))
    (-1, 2)
    >>> art.learn(np.array([0.9, 0.9])), len(art)
    (-1, 3)
    """

    def __init__(self, dim: int, rho_lb: float, rho_ub: float) -> None:
        self.dim = dim
        self.rho_lb, self.rho_ub = rho_lb, rho_ub
        self._w = np.empty((0, 2 * dim))
        self._wsum = np.empty(0)
        self._n = 0
        self._clusters = 0
        self._labels: list[int] = []

    def __len__(self) -> int:
        return self._n

    def nbytes(self) -> int:
        return int(self._w.nbytes + self._wsum.nbytes) + 8 * len(self._labels)

    def match(self, features: FloatArray) -> Match:
        sample = np.concatenate([features, 1.0 - features])
        if self._n == 0:
            empty = np.empty(0)
            return Match(sample, np.empty((0, 2 * self.dim)), empty, empty, 0.0, 0.0)
        w = self._w[: self._n]
        fuzzy = np.minimum(sample, w)
        feature = fuzzy.sum(axis=1) / np.maximum(self._wsum[: self._n], 0.001)
        e = (self.dim - 1, 2 * self.dim - 1)
        w_energy = w[:, e[0]] + w[:, e[1]]
        energy = np.where(w_energy > 0, (fuzzy[:, e[0]] + fuzzy[:, e[1]])
                          / np.where(w_energy > 0, w_energy, 1.0), 1.0)
        match = feature**3 * energy**2
        best = int(np.argmax(match))
        return Match(sample, fuzzy, match, energy, float(match[best]), float(energy[best]))

    def classify(self, m: Match) -> int:
        """The label learning ``m`` would give, without learning it."""
        if self._n == 0:
            return 1
        best = int(np.argmax(m.match))
        if m.best >= self.rho_ub or m.best >= self.rho_lb:
            return self._labels[best]
        return NEW_CLUSTER

    def learn(self, features: FloatArray, m: Match | None = None) -> int:
        """Learn one sample (``m``: its :meth:`match`, if already computed); its label."""
        m = m if m is not None else self.match(features)
        label = self.classify(m)
        if self._n == 0:
            self._append(np.ones(2 * self.dim), 1)
            self._clusters = 1
            return label
        resonant = np.flatnonzero(m.match >= self.rho_ub)
        if len(resonant):
            self._w[resonant] = m.fuzzy[resonant]
            self._wsum[resonant] = m.fuzzy[resonant].sum(axis=1)
        elif label == NEW_CLUSTER:
            self._clusters += 1
            self._append(m.sample, self._clusters)
        else:
            self._append(m.sample, label)
        return label

    def _append(self, sample: FloatArray, label: int) -> None:
        if self._n == len(self._w):
            grown = max(8, 2 * self._n)
            self._w = np.resize(self._w, (grown, 2 * self.dim))
            self._wsum = np.resize(self._wsum, grown)
        self._w[self._n], self._wsum[self._n] = sample, sample.sum()
        self._labels.append(label)
        self._n += 1


def cosine(a: FloatArray, b: FloatArray) -> float:
    """Cosine similarity; against a zero vector, one minus the other's norm (ARTime's)."""
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 1.0 - (nb if na == 0.0 else na)
    return float(a @ b) / (na * nb)


@dataclass
class _Pending:
    """Everything learning the current point changes, computed by ``score_one``."""

    key: tuple[float, datetime | None, int]
    score: float
    downsampled: float | None = None
    average: float = 0.0
    features: FloatArray | None = None
    match: Match | None = None
    label: int = 0


class ResonanceDetector:
    """Adaptive resonance over the shapes of recent windows, after ARTime (NAB's leader).

    1. *Downsample.* Every ``step`` points, the last ``step`` values become one: their
       maximum or minimum, whichever lies farther from a running average (a spike survives
       downsampling), or their mean when that extreme is within 10 % of it.
    2. *Levelise.* Scaled to a range (the warm-up's, widened by ``margin`` of it on
       either side, and stretched by any later value beyond it), rounded to one of
       ``levels`` levels, and snapped to the running median when within ``chomp`` of it
       (noise around the usual level becomes the usual level).
    3. *Features.* The last ``window`` levels, and the Haar transform of the same window
       scaled to ``[0, 1]``: the level and the shape.
    4. *Resonance.* :class:`Resonance` (fuzzy ART, two vigilances). A window that founds a
       new cluster is the anomaly, scored by how far below the vigilances it matched and
       how new its latest level is (``confidence``).
    5. *Adapting vigilance.* The first ``warmup`` points are learned in a batch at its
       end, with the vigilance set so that a typical warm-up window resonates. After that
       the upper vigilance follows the mean similarity, the lower one climbs toward the
       least similarity of the last half warm-up and falls after anomalies. After a new
       cluster, or a vigilance change, anomalies are masked until a ``1.5 * window`` run
       of windows that found none, unless the new one matches far worse than the last
       anomaly did: one page per episode.

    Unlike ARTime, which reads the file's minimum, maximum and length before starting
    (NAB hands them to every detector), the range here is the one seen so far and the
    warm-up a fixed number of points, so nothing looks ahead. The margin stands in for
    what the file's range gives ARTime: room above and below the usual values, so the
    usual values do not spread over every level and the first excursion does not
    re-scale everything learned (on NAB: 0 gives 45.5 / 33.1 alone, 0.25 gives 50.2 /
    33.5, 0.5 gives 48.0 / 34.1; docs/detectors.md). Scores are 0 between
    downsampled points and during the warm-up.

    Memory: the categories (``4 * window`` floats each; a few hundred on a day-long
    series), the warm-up's samples until its end, and ``median`` downsampled values.

    >>> from loopwatch.detectors.anomaly.base import score_series
    >>> values = [10.0 + (i % 24) / 4 for i in range(1500)]  # a daily sawtooth
    >>> values[1300:1320] = [40.0] * 20                       # a plateau never seen
    >>> scores = score_series(ResonanceDetector(warmup=600), values)
    >>> [i for i, s in enumerate(scores) if s > 0]                # its start and its end
    [1304, 1324]
    """

    def __init__(
        self,
        warmup: int = 750,
        window: int = 8,
        windows_per_warmup: int = 13,
        levels: int = 80,
        chomp: float = 0.075,
        initial_rho: float = 0.8,
        median: int = 2000,
        margin: float = 0.5,
        name: str = "resonance",
    ) -> None:
        if window < 2 or window & (window - 1):
            raise ValueError("window must be a power of two >= 2")
        if warmup < window * windows_per_warmup or levels < 1 or median < 1:
            raise ValueError("warmup must hold windows_per_warmup windows; levels, median >= 1")
        self.name = name
        self.window, self.levels, self.chomp, self.initial_rho = window, levels, chomp, initial_rho
        self.step = max(1, warmup // (window * windows_per_warmup))
        self.trend = warmup // self.step
        """Downsampled points in the warm-up."""
        self.mask = int(window * 1.5)
        self.margin = margin
        self.art = Resonance(2 * window, 0.0, 0.0)
        self._n = 0
        self._low, self._high = math.inf, -math.inf
        self._recent: deque[float] = deque(maxlen=self.step)
        self._average = 0.0
        self._dsi = 0
        self._sorted: list[float] = []
        self._order: deque[float] = deque(maxlen=median)
        self._levels: deque[float] = deque(maxlen=window)
        self._warm: list[float] = []
        self._sim: deque[float] = deque([1.0] * (self.trend // 2 + 1), maxlen=self.trend // 2 + 1)
        self._sim_diff: deque[float] = deque([0.0] * (self.trend + 1), maxlen=self.trend + 1)
        self._sim_total, self._sim_count = 0.0, 0
        self._anomaly_sims: list[float] = []
        self._last_anomaly_i, self._last_anomaly_sim = 0, 0.0
        self._last_rho_i = 0
        self._mask_after_new = False
        self._calm = 0
        self._pending: _Pending | None = None

    # -- the per-point pipeline ------------------------------------------------------

    def _downsample(self, x: float) -> tuple[float, float]:
        recent = [*self._recent, x][-self.step :]
        mean = sum(recent) / len(recent)
        average = mean if self._dsi == 0 else (self._average + mean) / 2.0
        top, bottom = max(recent), min(recent)
        value = bottom if abs(top - average) < abs(bottom - average) else top
        if abs(value - mean) < 0.1 * abs(mean):
            value = mean
        return value, average

    def _level(self, value: float, low: float, high: float) -> float:
        scaled = (value - low) / (high - low) if high > low else value - low
        return round(min(1.0, max(0.0, scaled)) * self.levels) / self.levels

    def _median(self, extra: float | None) -> float:
        ordered = self._sorted
        if extra is not None:
            ordered = ordered.copy()
            _insort(ordered, extra)
        return ordered[(len(ordered) - 1) // 2]

    def _features(self, level: float, levels: deque[float] | list[float]) -> FloatArray:
        window = np.array([*levels, level][-self.window :])
        if len(window) < self.window:
            return np.zeros(2 * self.window)
        return np.concatenate([unit_range(haar(unit_range(window))), window])

    def _snap(self, value: float, low: float, high: float, median: float) -> float:
        level, centre = self._level(value, low, high), self._level(median, low, high)
        return centre if abs(level - centre) < self.chomp else level

    def _evaluate(self, x: float, t: datetime | None) -> _Pending:
        key = (x, t, self._n)
        if self._pending is not None and self._pending.key == key:
            return self._pending
        pending = _Pending(key, 0.0)
        if (self._n + 1) % self.step == 0:
            value, pending.average = self._downsample(x)
            pending.downsampled = value
            if self._dsi >= self.trend:
                low, high = min(self._low, x), max(self._high, x)
                level = self._snap(value, low, high, self._median(value))
                pending.features = self._features(level, self._levels)
                pending.match = self.art.match(pending.features)
                pending.label = self.art.classify(pending.match)
                pending.score = self._anomaly(self._dsi + 1, pending.match, pending.label)
        self._pending = pending
        return pending

    def score_one(self, x: float, t: datetime | None = None) -> float:
        return self._evaluate(x, t).score

    def learn_one(self, x: float, t: datetime | None = None) -> None:
        pending = self._evaluate(x, t)
        self._pending = None
        self._recent.append(x)
        self._low, self._high = min(self._low, x), max(self._high, x)
        self._n += 1
        if pending.downsampled is None:
            return
        value = pending.downsampled
        self._average = pending.average
        if len(self._order) == self._order.maxlen:
            self._sorted.pop(_index(self._sorted, self._order[0]))
        self._order.append(value)
        _insort(self._sorted, value)
        self._dsi += 1
        if self._dsi <= self.trend:
            self._warm.append(value)
            if self._dsi == self.trend:
                self._learn_warmup()
            return
        assert pending.features is not None and pending.match is not None
        self._levels.append(pending.features[-1])
        self._detect(self._dsi, pending.features, pending.match)

    # -- ARTime's classification state ------------------------------------------------

    def _masks(self, i: int) -> tuple[bool, bool]:
        since = i - self._last_anomaly_i
        mask_after_new = self._mask_after_new
        if i > self.trend + self.mask and mask_after_new and self._calm >= self.mask:
            mask_after_new = False
        return mask_after_new, since <= self.mask

    def _anomaly(self, i: int, m: Match, label: int) -> float:
        if i <= self.trend or i < self.window or label != NEW_CLUSTER:
            return 0.0
        mask_after_new, mask_after_anomaly = self._masks(i)
        scale = 0.90 if mask_after_anomaly else 0.70
        if (mask_after_new or mask_after_anomaly) and not (
                m.best < self._last_anomaly_sim * scale):
            return 0.0
        return self.confidence(m.best, m.best_energy)

    def confidence(self, similarity: float, energy: float) -> float:
        """ARTime's score: how far below each vigilance the window matched, and how new
        its latest level is (energy similarity 1: a level already in the category)."""
        similarity = min(0.999, similarity)
        upper = (self.art.rho_ub - similarity) / (1.0 - similarity)
        lower = (self.art.rho_lb - similarity) / (1.0 - similarity)
        return clip01(round(0.35 * upper + 0.65 * lower + 1.5 * (1.0 - energy), 6))

    def _detect(self, i: int, features: FloatArray, m: Match) -> None:
        after_anomaly = i - self._last_anomaly_i == self.mask
        for_trend = i - self._last_rho_i >= self.trend // 2
        score = self._anomaly(i, m, self.art.classify(m))
        self._mask_after_new = self._masks(i)[0]
        if i < self.window:
            label = NEW_CLUSTER
            if not len(self.art):
                self.art.learn(features, m)
        else:
            label = self.art.learn(features, m)
        self._calm = 0 if label == NEW_CLUSTER else self._calm + 1
        self._sim_total += m.best
        self._sim_count += 1
        self._sim.append(m.best)
        self._sim_diff.append(self.art.rho_ub - m.best)
        if i - self._last_anomaly_i < self.mask and self._anomaly_sims:
            self._anomaly_sims[-1] = min(self._anomaly_sims[-1], m.best)
        if score > 0.0:
            self._anomaly_sims.append(m.best)
            self._last_anomaly_sim, self._last_anomaly_i = m.best, i
        self._mask_after_new = self._mask_after_new or label == NEW_CLUSTER
        if i > self.trend and (after_anomaly or for_trend):
            self._adapt(i)

    def _adapt(self, i: int) -> None:
        least = min(self._sim)
        upper = min(0.97, self._sim_total / self._sim_count)
        lower = self.art.rho_lb
        if lower <= least:
            lower += (least - lower) * 0.19
        else:
            fall = 0.0
            if i > 2 * self.trend:
                below = [min(0.37, d) for d in self._sim_diff if d > 0.05]
                fall = sum(below) / len(below) if below else 0.0
            lower -= max(0.01, fall) / 2.0
            if self._anomaly_sims:
                lower = max(sum(self._anomaly_sims) / len(self._anomaly_sims), lower)
        self.art.rho_lb, self.art.rho_ub = min(upper, lower), upper
        self._last_rho_i = i
        self._mask_after_new = True

    def _learn_warmup(self) -> None:
        """The warm-up in one batch: range and median as of its end, vigilance fitted."""
        low, high = self._low, self._high
        self._low -= self.margin * (high - low)
        self._high += self.margin * (high - low)
        ordered: list[float] = []
        levels: list[float] = []
        samples = []
        for value in self._warm:
            _insort(ordered, value)
            level = self._snap(value, low, high, ordered[(len(ordered) - 1) // 2])
            samples.append(self._features(level, levels))
            levels = [*levels, level][-self.window :]
        self._warm = []
        self._levels.extend(levels)
        rho = self._initial_rho(samples[self.window - 1 :])
        self.art.rho_lb = self.art.rho_ub = rho
        for i, features in enumerate(samples, 1):
            self._detect(i, features, self.art.match(features))

    def _initial_rho(self, samples: list[FloatArray]) -> float:
        """The mean similarity, in the warm-up's second half, of a fuzzy ART at vigilance
        ``initial_rho`` fed the warm-up's windows from the least typical to the most."""
        n = len(samples)
        sim = np.ones((n, n))
        for a in range(n):
            for b in range(a):
                sim[a, b] = sim[b, a] = cosine(samples[a], samples[b])
        art = Resonance(2 * self.window, self.initial_rho, self.initial_rho)
        best = []
        for k in np.argsort(sim.sum(axis=0), kind="stable"):
            m = art.match(samples[k])
            best.append(m.best)
            art.learn(samples[k], m)
        tail = best[self.trend // 2 - 1 :] or best
        return float(np.mean(tail))


def _index(ordered: list[float], value: float) -> int:
    return bisect.bisect_left(ordered, value)


def _insort(ordered: list[float], value: float) -> None:
    bisect.insort(ordered, value)
