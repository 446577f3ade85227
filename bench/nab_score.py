"""Score the registered anomaly detectors on the NAB subset, the way NAB scores them.

    python -m loopwatch.bench.nab_score                      # every registered detector, a table
    python -m loopwatch.bench.nab_score --detector generic   # one detector
    python -m loopwatch.bench.nab_score --json               # {detector: {profile: score}}
    python -m loopwatch.bench.nab_score --category artificial --per-file

The method is NAB's (numenta/NAB, ``nab/sweeper.py`` and ``nab/runner.py``):

* Each series is scored online, row by row (``score_one`` then ``learn_one``).
* The probationary period, ``min(floor(0.15 * rows), 0.15 * 5000)`` rows, is not scored
  (NAB caps it at 750 rows for long files).
* Inside a labelled window ``[L, R]`` (width ``W``) a detection at row ``i`` is worth
  ``tpWeight * S(-(R - i + 1) / W) / S(-1)`` where ``S(x) = 2 / (1 + exp(5x)) - 1`` is
  NAB's scaled sigmoid (and ``S(x) = -1`` for ``x > 3``); only the earliest detection in
  a window counts (later ones add nothing); a window without one costs ``fnWeight``.
* A detection outside every window costs ``fpWeight`` if no window precedes it, else
  ``fpWeight * S(|R' - i| / (W' - 1))`` (a negative number) where ``R'`` and ``W'`` are the
  right edge and width of the preceding window: cheap right after a window, a full
  ``fpWeight`` well past it.
* One threshold per profile for the whole corpus: every distinct anomaly score is tried
  (a row is a detection when its score is ``>=`` the threshold) and the best is kept.
* The corpus total is normalised per profile to ``100 * (raw - null) / (perfect - null)``
  where ``null`` is the raw score of a detector that never fires (``-fnWeight`` per
  window) and ``perfect`` is ``tpWeight`` times the number of windows.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import numpy.typing as npt

from loopwatch.detectors.anomaly.base import AnomalyDetector
from loopwatch.detectors.anomaly.generic import CANDIDATES, GenericDetector
from loopwatch.detectors.anomaly.registry import DEFAULT_DETECTOR, DETECTORS

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

PROBATION_PERCENT = 0.15
OUTSIDE = -1
"""Window id of a scorable row outside every window."""
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "nab"


@dataclass(frozen=True)
class Profile:
    name: str
    tp_weight: float
    fp_weight: float
    fn_weight: float


@dataclass(frozen=True)
class LabelledSeries:
    """One NAB data file: its rows and its anomaly windows as inclusive row indices."""

    name: str
    timestamps: tuple[datetime, ...]
    values: tuple[float, ...]
    windows: tuple[tuple[int, int], ...]

    def __len__(self) -> int:
        return len(self.values)


@dataclass(frozen=True)
class SweepRows:
    """The scorable rows of one file (probation dropped) with their NAB weights."""

    file: str
    rows: IntArray
    window: IntArray
    """Corpus-wide window id of each row, or ``OUTSIDE``."""
    weight: FloatArray
    """What a detection on the row adds: a TP weight inside a window, an FP cost outside."""


@dataclass(frozen=True)
class ThresholdResult:
    threshold: float
    raw: float
    null: float
    perfect: float

    @property
    def normalized(self) -> float:
        return 100.0 * (self.raw - self.null) / (self.perfect - self.null)


# ----------------------------------------------------------------------------- NAB maths


def scaled_sigmoid(position: float) -> float:
    """NAB's ``scaledSigmoid``: 0.98661 at -1 (window start), 0 at the window end.

    >>> round(scaled_sigmoid(-1.0), 5), scaled_sigmoid(0.0), round(scaled_sigmoid(1.0), 5)
    (0.98661, 0.0, -0.98661)
    >>> scaled_sigmoid(3.5)
    -1.0
    """
    if position > 3.0:
        return -1.0
    return 2.0 / (1.0 + math.exp(5.0 * position)) - 1.0


def probationary_length(rows: int, percent: float = PROBATION_PERCENT) -> int:
    """NAB's ``getProbationPeriod``: 15 % of the file, at most 750 rows.

    >>> probationary_length(4032), probationary_length(22695)
    (604, 750)
    """
    return int(min(math.floor(percent * rows), percent * 5000))


def sweep_rows(
    series: LabelledSeries, profile: Profile, first_window_id: int = 0
) -> SweepRows:
    """NAB's ``Sweeper.calcSweepScore`` for one file, minus the probationary rows."""
    n = len(series)
    max_tp = scaled_sigmoid(-1.0)
    window = np.full(n, OUTSIDE, dtype=np.int64)
    weight = np.empty(n, dtype=np.float64)
    prev_right: int | None = None
    prev_width = 0
    cursor = 0
    for k, (left, right) in enumerate(series.windows):
        _fill_outside(weight, cursor, left, prev_right, prev_width, profile)
        width = right - left + 1
        position = -(right - np.arange(left, right + 1) + 1) / width
        sigmoid = 2.0 / (1.0 + np.exp(5.0 * position)) - 1.0
        weight[left : right + 1] = sigmoid * profile.tp_weight / max_tp
        window[left : right + 1] = first_window_id + k
        prev_right, prev_width, cursor = right, width, right + 1
    _fill_outside(weight, cursor, n, prev_right, prev_width, profile)
    start = probationary_length(n)
    rows = np.arange(start, n, dtype=np.int64)
    return SweepRows(series.name, rows, window[start:], weight[start:])


def _fill_outside(
    weight: FloatArray,
    start: int,
    stop: int,
    prev_right: int | None,
    prev_width: int,
    profile: Profile,
) -> None:
    if stop <= start:
        return
    if prev_right is None:
        weight[start:stop] = -1.0 * profile.fp_weight
        return
    # NAB divides by (width - 1); a one-row window would divide by zero there.
    position = np.abs(prev_right - np.arange(start, stop)) / max(prev_width - 1, 1)
    sigmoid = 2.0 / (1.0 + np.exp(5.0 * np.minimum(position, 3.0))) - 1.0
    weight[start:stop] = np.where(position > 3.0, -1.0, sigmoid) * profile.fp_weight


def sweep_thresholds(
    scores: FloatArray, sweep: SweepRows | Sequence[SweepRows], fn_weight: float
) -> tuple[FloatArray, FloatArray]:
    """NAB's ``Sweeper.calcScoreByThreshold``: the raw score at every candidate threshold.

    ``scores`` are the anomaly scores of the sweep's rows (concatenated, in the same order
    when several files are swept together). Returns ``(thresholds, raw)``, thresholds
    decreasing from 1.1 (nothing fires: the null score); ``raw[j]`` is the corpus score
    when every row scoring ``>= thresholds[j]`` is a detection.
    """
    parts = [sweep] if isinstance(sweep, SweepRows) else list(sweep)
    window = np.concatenate([p.window for p in parts]) if parts else np.zeros(0, np.int64)
    weight = np.concatenate([p.weight for p in parts]) if parts else np.zeros(0)
    if len(scores) != len(window):
        raise ValueError(f"{len(scores)} scores for {len(window)} scorable rows")
    window_ids = np.unique(window[window != OUTSIDE])
    null = -fn_weight * len(window_ids)
    order = np.argsort(-scores, kind="stable")
    s_sorted, w_sorted, g_sorted = scores[order], weight[order], window[order]
    delta = np.where(g_sorted == OUTSIDE, w_sorted, 0.0)
    # A window's part is -fnWeight until its first detection, then the best (earliest)
    # detection's weight: add the increments of its running maximum where they happen.
    inside = np.flatnonzero(g_sorted != OUTSIDE)
    if len(inside):
        by_window = inside[np.argsort(g_sorted[inside], kind="stable")]
        ids = g_sorted[by_window]
        starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
        for begin, end in zip(starts, np.r_[starts[1:], len(by_window)], strict=True):
            positions = by_window[begin:end]  # ranks of this window's rows, ascending
            running = np.maximum.accumulate(np.r_[-fn_weight, w_sorted[positions]])
            delta[positions] += np.diff(running)
    totals = null + np.cumsum(delta)
    # Score after the last row of each group of equal scores.
    last_of_group = np.flatnonzero(np.r_[s_sorted[1:] != s_sorted[:-1], True])
    thresholds = np.r_[1.1, s_sorted[last_of_group]]
    raw = np.r_[null, totals[last_of_group]]
    return thresholds, raw


def corpus_sweeps(corpus: Sequence[LabelledSeries], profile: Profile) -> list[SweepRows]:
    """Every file's sweep rows, with window ids unique across the corpus."""
    sweeps, next_id = [], 0
    for series in corpus:
        sweeps.append(sweep_rows(series, profile, next_id))
        next_id += len(series.windows)
    return sweeps


def optimise(
    scorable: Sequence[FloatArray],
    sweeps: Sequence[SweepRows],
    profile: Profile,
    windows: int,
    null: float | None = None,
) -> ThresholdResult:
    """The best threshold for these files' scorable rows, with its raw and normalised score.

    ``null`` is the score of never firing (computed unless given); ``perfect`` is
    ``tpWeight`` for each of the ``windows``.
    """
    thresholds, raw = sweep_thresholds(np.concatenate(scorable), sweeps, profile.fn_weight)
    best = int(np.argmax(raw))  # first maximum: the highest threshold among ties
    if null is None:
        null = null_score(sweeps, profile)
    return ThresholdResult(
        float(thresholds[best]), float(raw[best]), null, profile.tp_weight * windows
    )


def null_score(sweeps: Sequence[SweepRows], profile: Profile) -> float:
    """The raw score of a detector that never fires: ``-fnWeight`` per scorable window.

    (NAB runs a constant-score "null" detector through the optimiser for this; on any
    realistic corpus its best threshold is the one where nothing fires.)
    """
    windows = {int(w) for s in sweeps for w in np.unique(s.window) if w != OUTSIDE}
    return -profile.fn_weight * len(windows)


def best_threshold(
    scores_by_file: dict[str, FloatArray],
    corpus: Sequence[LabelledSeries],
    profile: Profile,
) -> ThresholdResult:
    """Optimise one threshold for the corpus (NAB's optimizer), and normalise."""
    sweeps = corpus_sweeps(corpus, profile)
    scorable = [np.asarray(scores_by_file[s.file], dtype=np.float64)[s.rows] for s in sweeps]
    return optimise(scorable, sweeps, profile, sum(len(s.windows) for s in corpus))


def file_raw_score(
    scores: FloatArray, series: LabelledSeries, profile: Profile, threshold: float
) -> float:
    """One file's raw NAB score at a fixed threshold (NAB's ``scoreDataSet``)."""
    sweep = sweep_rows(series, profile)
    thresholds, raw = sweep_thresholds(np.asarray(scores)[sweep.rows], sweep, profile.fn_weight)
    return float(raw[thresholds >= threshold][-1])


# ----------------------------------------------------------------------------- data


def parse_timestamp(text: str) -> datetime:
    """NAB (``2014-04-01 00:00:00``, ``.000000``) and ISO-8601 timestamps."""
    return datetime.fromisoformat(text.strip())


def load_profiles(root: Path) -> list[Profile]:
    data = json.loads((root / "profiles.json").read_text())
    return [
        Profile(
            name,
            float(p["CostMatrix"]["tpWeight"]),
            float(p["CostMatrix"]["fpWeight"]),
            float(p["CostMatrix"]["fnWeight"]),
        )
        for name, p in data.items()
    ]


def load_corpus(root: Path, categories: Sequence[str] = ()) -> list[LabelledSeries]:
    """The data files listed in ``combined_windows.json`` (optionally by category prefix)."""
    labels: dict[str, list[list[str]]] = json.loads((root / "combined_windows.json").read_text())
    corpus = []
    for name in sorted(labels):
        if categories and not any(name.startswith(c) for c in categories):
            continue
        with (root / "data" / name).open(newline="") as f:
            reader = csv.reader(f)
            next(reader)
            rows = [(parse_timestamp(r[0]), float(r[1])) for r in reader if r]
        timestamps = tuple(t for t, _ in rows)
        index = {t: i for i, t in reversed(list(enumerate(timestamps)))}
        windows = []
        for start, end in labels[name]:
            t1, t2 = parse_timestamp(start), parse_timestamp(end)
            if t1 not in index or t2 not in index:
                raise ValueError(f"{name}: window {start} .. {end} is not on row timestamps")
            windows.append((index[t1], index[t2]))
        corpus.append(LabelledSeries(name, timestamps, tuple(v for _, v in rows), tuple(windows)))
    return corpus


# ----------------------------------------------------------------------------- running


def run_detector(detector: AnomalyDetector, series: LabelledSeries) -> FloatArray:
    """Online scores for every row (score, then learn), checked to be in ``[0, 1]``."""
    out = np.empty(len(series), dtype=np.float64)
    score, learn = detector.score_one, detector.learn_one
    for i, (t, x) in enumerate(zip(series.timestamps, series.values, strict=True)):
        out[i] = score(x, t)
        learn(x, t)
    if not (np.all(out >= 0.0) and np.all(out <= 1.0)):
        raise ValueError(f"{detector.name} scored outside [0, 1] on {series.name}")
    return out


def make_detector(name: str, candidates: bool = False) -> AnomalyDetector:
    """A registered detector, or (``candidates``) a configuration considered for generic."""
    if candidates:
        return GenericDetector(CANDIDATES[name], name=name)
    return DETECTORS[name]()


def _run_job(
    name: str, candidates: bool, series: LabelledSeries
) -> tuple[str, str, FloatArray, float]:
    started = time.process_time()
    scores = run_detector(make_detector(name, candidates), series)
    return name, series.name, scores, time.process_time() - started


def score_all(
    names: Sequence[str],
    corpus: Sequence[LabelledSeries],
    workers: int,
    progress: Callable[[str], None],
    candidates: bool = False,
) -> tuple[dict[str, dict[str, FloatArray]], dict[str, float]]:
    """Run every named detector on every file, biggest files first, across processes."""
    jobs = sorted(((n, s) for n in names for s in corpus), key=lambda job: -len(job[1]))
    scores: dict[str, dict[str, FloatArray]] = {n: {} for n in names}
    cpu: dict[str, float] = dict.fromkeys(names, 0.0)
    done = 0
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_run_job, n, candidates, s) for n, s in jobs]
        for future in as_completed(futures):
            name, file, result, seconds = future.result()
            scores[name][file] = result
            cpu[name] += seconds
            done += 1
            progress(f"[{done}/{len(jobs)}] {name} {file} ({seconds:.1f}s)")
    return scores, cpu


def leave_one_out(
    scores: dict[str, dict[str, FloatArray]],
    corpus: Sequence[LabelledSeries],
    profile: Profile,
) -> tuple[float, dict[str, str]]:
    """Leave-one-file-out estimate of picking the best of several detectors on NAB.

    For each file: choose the detector and threshold that score best on the *other*
    files, score the held-out file with them; the held-out raw scores are summed and
    normalised as usual. Returns the normalised score and the choice made for each file.
    """
    sweeps = corpus_sweeps(corpus, profile)
    scorable = {n: [by_file[s.file][s.rows] for s in sweeps] for n, by_file in scores.items()}
    windows = [len(series.windows) for series in corpus]
    total, chosen = 0.0, {}
    for held_out in range(len(corpus)):
        keep = [i for i in range(len(corpus)) if i != held_out]
        train = [sweeps[i] for i in keep]
        train_null = null_score(train, profile)
        best_name, best = "", None
        for name in scores:
            result = optimise([scorable[name][i] for i in keep], train, profile,
                              sum(windows[i] for i in keep), train_null)
            if best is None or result.normalized > best.normalized:
                best_name, best = name, result
        assert best is not None
        series = corpus[held_out]
        total += file_raw_score(scores[best_name][series.name], series, profile, best.threshold)
        chosen[series.name] = best_name
    perfect = profile.tp_weight * sum(windows)
    return ThresholdResult(math.nan, total, null_score(sweeps, profile), perfect).normalized, chosen


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loopwatch.bench.nab_score",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--detector", choices=sorted(DETECTORS), help="score only this one")
    parser.add_argument("--json", action="store_true", help="print {detector: {profile: score}}")
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("NAB_DIR", DEFAULT_DATA)),
                        help="NAB subset directory (default: $NAB_DIR or %(default)s)")
    parser.add_argument("--category", action="append", default=[],
                        help="only files under this category prefix (repeatable)")
    parser.add_argument("--per-file", action="store_true",
                        help="also print each file's raw standard-profile score")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--loo", action="store_true",
                        help="compare the configurations considered for 'generic' and "
                             "cross-validate the choice among them, leaving one file out")
    args = parser.parse_args(argv)

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    corpus = load_corpus(args.data, args.category)
    profiles = load_profiles(args.data)
    if args.loo:
        return _main_loo(args.data, args.category, args.workers, progress)
    names = [args.detector] if args.detector else list(DETECTORS)
    windows = sum(len(s.windows) for s in corpus)
    progress(f"{len(corpus)} files, {sum(map(len, corpus))} rows, {windows} windows; "
             f"{len(names)} detector(s) on {args.workers} process(es)")
    scores, cpu = score_all(names, corpus, args.workers, progress)
    results = {n: {p.name: best_threshold(scores[n], corpus, p) for p in profiles} for n in names}
    wall = time.perf_counter() - started
    progress(f"done in {wall:.1f}s wall")

    if args.json:
        print(json.dumps({n: {p: round(r.normalized, 2) for p, r in by.items()}
                          for n, by in results.items()}, indent=2))
        return 0
    header = f"{'detector':<20}" + "".join(f"{p.name:>20}" for p in profiles)
    print(header + f"{'threshold(std)':>16}{'cpu s':>8}")
    for n in names:
        marker = " *" if n == DEFAULT_DETECTOR else ""
        cells = "".join(f"{results[n][p.name].normalized:>20.1f}" for p in profiles)
        print(f"{n + marker:<20}{cells}{results[n][profiles[0].name].threshold:>16.4f}"
              f"{cpu[n]:>8.1f}")
    print(f"(* default detector; {len(corpus)} files, {windows} windows; {wall:.0f}s wall)")
    if args.per_file:
        standard = profiles[0]
        for n in names:
            threshold = results[n][standard.name].threshold
            print(f"\n{n}: raw {standard.name} score per file at threshold {threshold:.4f}")
            for series in corpus:
                raw = file_raw_score(scores[n][series.name], series, standard, threshold)
                print(f"  {series.name:<60}{raw:>9.3f}  ({len(series.windows)} windows)")
    return 0


def _main_loo(
    data: Path, categories: Sequence[str], workers: int, progress: Callable[[str], None]
) -> int:
    started = time.perf_counter()
    corpus = load_corpus(data, categories)
    profiles = load_profiles(data)
    names = list(CANDIDATES)
    progress(f"{len(names)} generic configurations on {len(corpus)} files")
    scores, _ = score_all(names, corpus, workers, progress, candidates=True)
    print(f"{'configuration':<24}" + "".join(f"{p.name:>20}" for p in profiles))
    for n in names:
        cells = "".join(f"{best_threshold(scores[n], corpus, p).normalized:>20.1f}"
                        for p in profiles)
        print(f"{n:<24}{cells}")
    print("\nleave-one-file-out (configuration and threshold chosen on the other files):")
    for p in profiles:
        score, chosen = leave_one_out(scores, corpus, p)
        picks = sorted(set(chosen.values()), key=list(chosen.values()).count, reverse=True)
        print(f"  {p.name:<20}{score:>8.1f}   picked: "
              + ", ".join(f"{c} x{list(chosen.values()).count(c)}" for c in picks))
    progress(f"done in {time.perf_counter() - started:.1f}s wall")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
