"""The detector table of docs/detectors.md: every detector on NAB, leave-one-file-out.

    python -m loopwatch.bench.nab_table                 # the table (markdown), scores cached
    python -m loopwatch.bench.nab_table --only episodic generic

For each detector: NAB's normalised score with the threshold fitted on all 18 files
(in-sample) and leave-one-file-out (threshold fitted on 17 files, the 18th scored with
it; held-out raw scores summed and normalised), for the standard and low-FP profiles;
CPU microseconds per point; and the memory one detector holds after a long series.
Then the honest figure for ``episodic``: its configuration *and* threshold chosen
leave-one-file-out among the :data:`FAMILY` of refractory settings considered.

One process (the machine is shared); each (detector, file) score array is cached under
``--cache`` keyed by the detectors' source, so a re-run after a change re-scores only
what the change can affect.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from loopwatch.bench.nab_score import (
    DEFAULT_DATA,
    FloatArray,
    LabelledSeries,
    Profile,
    best_threshold,
    leave_one_out,
    load_corpus,
    load_profiles,
    run_detector,
)
from loopwatch.detectors.anomaly.base import AnomalyDetector
from loopwatch.detectors.anomaly.generic import GenericDetector
from loopwatch.detectors.anomaly.refractory import Refractory
from loopwatch.detectors.anomaly.registry import DEFAULT_DETECTOR, DETECTORS, EPISODIC

ROWS = ("generic", "episodic", "corroborated", "resonance", "cad_ose", "contextual", "ensemble",
        "windowed_gaussian")
"""Detectors in the table: today's default, the new ones, NAB's baseline."""

def _episodic(rest: int, level: float) -> Callable[[], AnomalyDetector]:
    return lambda: Refractory(GenericDetector(EPISODIC), rest=rest, level=level)


FAMILY: dict[str, Callable[[], AnomalyDetector]] = {
    f"episodic rest={rest} level={level}": _episodic(rest, level)
    for rest in (100, 150, 200, 300)
    for level in (0.4, 0.45, 0.5)
}
"""The refractory settings considered for ``episodic`` (rest points x quiet level); the
default's own settings are chosen leave-one-out in :mod:`loopwatch.bench.nab_ideas`."""

SOURCES = Path(__file__).resolve().parents[1] / "detectors" / "anomaly"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "loopwatch-nab"


def source_digest() -> str:
    """A digest of every detector module: cached scores are valid while it holds."""
    digest = hashlib.sha256()
    for path in sorted(SOURCES.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def cached_scores(
    key: str, factory: Callable[[], AnomalyDetector], series: LabelledSeries, cache: Path
) -> tuple[FloatArray, float]:
    """One file's online scores and the CPU seconds they took, from the cache if there."""
    name = hashlib.sha256(f"{key}|{series.name}".encode()).hexdigest()[:24]
    path = cache / source_digest() / f"{name}.npz"
    if path.exists():
        with np.load(path) as stored:
            return stored["scores"], float(stored["cpu"])
    started = time.process_time()
    scores = run_detector(factory(), series)
    cpu = time.process_time() - started
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, scores=scores, cpu=cpu)
    return scores, cpu


def memory_per_series(factory: Callable[[], AnomalyDetector], series: LabelledSeries) -> int:
    """Bytes still allocated by one detector after it has read the whole series."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    detector = factory()
    for t, x in zip(series.timestamps, series.values, strict=True):
        detector.score_one(x, t)
        detector.learn_one(x, t)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del detector
    return held


def score_family(
    factories: dict[str, Callable[[], AnomalyDetector]],
    corpus: Sequence[LabelledSeries],
    cache: Path,
    progress: Callable[[str], None],
) -> tuple[dict[str, dict[str, FloatArray]], dict[str, float]]:
    scores: dict[str, dict[str, FloatArray]] = {}
    cpu: dict[str, float] = {}
    for key, factory in factories.items():
        scores[key], cpu[key] = {}, 0.0
        for series in corpus:
            scores[key][series.name], seconds = cached_scores(key, factory, series, cache)
            cpu[key] += seconds
        progress(f"{key}: {cpu[key]:.1f} s CPU")
    return scores, cpu


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loopwatch.bench.nab_table", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("NAB_DIR", DEFAULT_DATA)))
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--only", nargs="+", choices=sorted(DETECTORS), help="these rows only")
    parser.add_argument("--no-family", action="store_true",
                        help="skip the leave-one-out choice among the default's settings")
    args = parser.parse_args(argv)

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    corpus = load_corpus(args.data)
    profiles: list[Profile] = load_profiles(args.data)[:2]  # standard, reward_low_FP_rate
    rows = args.only or list(ROWS)
    points = sum(map(len, corpus))
    longest = max(corpus, key=len)
    scores, cpu = score_family({n: DETECTORS[n] for n in rows}, corpus, args.cache, progress)
    print("| detector | standard, LOO | low FP, LOO | standard, in-sample | low FP, in-sample "
          f"| µs/point | memory/series ({len(longest)} points) |")
    print("|---|---|---|---|---|---|---|")
    for name in rows:
        loo = [leave_one_out({name: scores[name]}, corpus, p)[0] for p in profiles]
        fit = [best_threshold(scores[name], corpus, p).normalized for p in profiles]
        memory = memory_per_series(DETECTORS[name], longest)
        marker = " (default)" if name == DEFAULT_DETECTOR else ""
        print(f"| {name}{marker} | {loo[0]:.1f} | {loo[1]:.1f} | {fit[0]:.1f} | {fit[1]:.1f} "
              f"| {1e6 * cpu[name] / points:.0f} | {memory / 1024:.0f} KiB |")
    if not args.no_family:
        family, _ = score_family(FAMILY, corpus, args.cache, progress)
        print(f"\nepisodic's settings chosen leave-one-file-out among {len(FAMILY)} "
              "(settings and threshold fitted on 17 files, the 18th scored):")
        for p in profiles:
            value, chosen = leave_one_out(family, corpus, p)
            picks = sorted(set(chosen.values()), key=list(chosen.values()).count, reverse=True)
            print(f"- {p.name}: {value:.1f} (picked "
                  + ", ".join(f"{c} x{list(chosen.values()).count(c)}" for c in picks) + ")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
