"""Online anomaly detectors, CSV scoring and the NAB scorer, on scripted inputs (no services)."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from datetime import datetime, timedelta

import numpy as np
import pytest
from scipy.stats import ks_2samp

from loopwatch.bench.nab_score import (
    LabelledSeries,
    Profile,
    best_threshold,
    file_raw_score,
    leave_one_out,
    probationary_length,
    scaled_sigmoid,
    sweep_rows,
    sweep_thresholds,
)
from loopwatch.detectors.anomaly import DEFAULT_DETECTOR, DETECTORS, AnomalyDetector, score_csv
from loopwatch.detectors.anomaly.base import score_series
from loopwatch.detectors.anomaly.cusum import Cusum
from loopwatch.detectors.anomaly.ewma import EWMALevelShift
from loopwatch.detectors.anomaly.generic import GenericDetector
from loopwatch.detectors.anomaly.ks import KSShift
from loopwatch.detectors.anomaly.proportion import ProportionDetector
from loopwatch.detectors.anomaly.robust_z import RobustZScore
from loopwatch.detectors.anomaly.seasonal import SeasonalBaseline

ALERT = 0.5
"""Score of a tail probability of 1e-5 on the shared surprise scale."""
START = datetime(2024, 1, 1)


def minutes(n: int) -> list[datetime]:
    return [START + timedelta(minutes=i) for i in range(n)]


def level_shift(n: int, at: int, size: float, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    values = 10.0 + rng.normal(0.0, 1.0, n)
    values[at:] += size
    return [float(v) for v in values]


def nasty_series() -> tuple[list[float], list[datetime]]:
    """Flat runs, zeros, negatives, huge spikes, a level shift and a noisy stretch."""
    rng = np.random.default_rng(42)
    parts = [
        np.full(200, 5.0),
        np.zeros(100),
        rng.normal(-3.0, 0.5, 300),
        np.array([1e6, -1e6, 0.0, 1e-12]),
        rng.normal(50.0, 10.0, 400),
        rng.exponential(2.0, 200),
        np.full(100, 7.25),
    ]
    values = [float(v) for v in np.concatenate(parts)]
    return values, minutes(len(values))


# ----------------------------------------------------------------------------- detectors


MINUTE, HOUR = timedelta(minutes=1), timedelta(hours=1)


@pytest.mark.parametrize(
    ("make", "within", "step", "size", "alert"),
    [
        (lambda: RobustZScore(window=200), 1, MINUTE, 6.0, ALERT),
        (lambda: EWMALevelShift(), 10, MINUTE, 6.0, ALERT),
        (lambda: Cusum(), 10, MINUTE, 6.0, ALERT),
        (lambda: GenericDetector(), 1, MINUTE, 6.0, ALERT),
        # Hourly points, so that buckets fill; a bucket holds at most 48 values, so the
        # detector is less sure of its baseline: a bigger shift, a higher bar.
        (lambda: SeasonalBaseline(), 1, HOUR, 10.0, 0.6),
    ],
    ids=["robust_z", "ewma", "cusum", "generic", "seasonal"],
)
def test_level_shift_is_caught_soon_and_nothing_before(
    make: Callable[[], AnomalyDetector], within: int, step: timedelta, size: float,
    alert: float,
) -> None:
    at = 1200
    values = level_shift(1500, at, size, seed=3)
    times = [START + step * i for i in range(len(values))]
    scores = score_series(make(), values, times)
    warmed_up = 400  # the generic detector's likelihood needs 388 points
    assert max(scores[warmed_up:at]) < alert
    assert max(scores[at : at + within]) >= alert


def test_ewma_ignores_a_lone_spike_that_robust_z_flags() -> None:
    values = level_shift(600, 600, 0.0, seed=8)
    values[500] = 25.0
    ewma = score_series(EWMALevelShift(), values)
    robust = score_series(RobustZScore(), values)
    assert robust[500] >= ALERT
    assert max(ewma[100:]) < ALERT


def test_proportion_jump_with_small_counts() -> None:
    rng = np.random.default_rng(12)
    det = ProportionDetector(side="upper")
    trials = rng.integers(5, 25, 400)
    rates = np.where(np.arange(400) < 350, 0.05, 0.35)
    errors = rng.binomial(trials, rates)
    scores = []
    for k, n in zip(errors.tolist(), trials.tolist(), strict=True):
        scores.append(det.score_counts(k, n))
        det.learn_counts(k, n)
    assert max(scores[20:350]) < ALERT
    assert max(scores[350:353]) >= ALERT
    # Few trials cannot be alarming however bad they look.
    assert det.score_counts(2, 2) < ALERT


def test_proportion_ratio_interface_uses_trials() -> None:
    det = ProportionDetector(trials=50)
    for _ in range(100):
        det.learn_one(0.04)
    assert det.rate == pytest.approx(0.04, abs=0.002)
    assert det.score_one(0.04) < 0.1
    assert det.score_one(0.3) >= ALERT


def test_proportion_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError, match="k <= n"):
        ProportionDetector().score_counts(5, 3)


def test_ks_sees_a_distribution_shift_with_the_same_mean() -> None:
    rng = np.random.default_rng(21)
    det = KSShift(reference=300, recent=100)
    before = score_series(det, rng.normal(500.0, 150.0, 600))
    # Same mean, a bimodal shape: what a silent model update can do to answer lengths.
    after = score_series(det, rng.choice([300.0, 700.0], 150) + rng.normal(0.0, 20.0, 150))
    assert max(before) < ALERT
    assert max(after) >= 0.6


def test_ks_unwrapped_gives_scipys_p_values() -> None:
    """KSShift calls ks_2samp without its axis/NaN wrapper: the same p-value, point by
    point, as the public function on the windows it sees (ties and shifts included)."""
    rng = np.random.default_rng(8)
    series = np.concatenate([rng.gamma(4.0, 100.0, 420).round(), rng.gamma(4.0, 70.0, 80)])
    det = KSShift(reference=200, recent=50, min_reference=60)
    compared = 0
    for x in series:
        held = np.array(det._held)
        if len(held) >= det.min_reference + det.recent - 1:
            split = len(held) - (det.recent - 1)
            expected = ks_2samp(held[:split], np.append(held[split:], x)).pvalue
            assert det.p_value(float(x)) == float(expected)
            compared += 1
        det.learn_one(float(x))
    assert compared == 500 - 109


def test_ks_p_values_once_per_statistic_are_scipys_to_the_last_bit() -> None:
    """ks_p_value computes scipy's exact p-value once per (sizes, statistic) and reuses
    it: over 3,000 pairs of samples (eight pairs of sizes: equal, unequal, swapped;
    integer values, so ties are common; shifted and not), each p-value equals the
    public ks_2samp's, and most came from the memo (a wrong reuse would show)."""
    from loopwatch.detectors.anomaly import ks

    rng = np.random.default_rng(27)
    ks._P_BY_STATISTIC.clear()
    sizes = [(2, 3), (10, 10), (10, 7), (30, 7), (7, 30), (45, 45), (200, 50), (200, 60)]
    for number in range(3_000):
        n1, n2 = sizes[number % len(sizes)]
        reference = rng.integers(0, 12, n1).astype(float)
        recent = (rng.integers(0, 12, n2) + rng.integers(0, 4)).astype(float)
        assert ks.ks_p_value(reference, recent) == float(ks_2samp(reference, recent).pvalue)
    assert len(ks._P_BY_STATISTIC) < 600


def test_the_ks_memo_is_emptied_when_full(monkeypatch) -> None:
    """New series keep adding keys while they warm up: the memo stays within
    MEMO_MAX entries, and p-values stay scipy's across the emptying."""
    from loopwatch.detectors.anomaly import ks

    monkeypatch.setattr(ks, "MEMO_MAX", 40)
    ks._P_BY_STATISTIC.clear()
    rng = np.random.default_rng(4)
    sizes = []
    for _ in range(400):
        reference, recent = rng.normal(0, 1, int(rng.integers(5, 60))), rng.normal(0.5, 1, 9)
        assert ks.ks_p_value(reference, recent) == float(ks_2samp(reference, recent).pvalue)
        sizes.append(len(ks._P_BY_STATISTIC))
    assert max(sizes) == 40 and min(sizes[40:]) >= 1 and sizes.count(1) >= 5


def test_the_detectors_median_and_scale_are_numpys_to_the_last_bit() -> None:
    """rolling.median and robust_scale skip numpy's wrappers: on windows of every size
    from 1 to 400, odd and even, with ties (rounded values), flat windows (the mean
    absolute deviation's branch) and spikes, they give np.median's and np.mean's
    values exactly; a NaN gives NaN."""
    from loopwatch.detectors.anomaly.rolling import (
        MAD_TO_SIGMA,
        MEAN_AD_TO_SIGMA,
        TINY_SCALE,
        median,
        robust_scale,
    )

    def numpy_scale(values: np.ndarray, center: float) -> float:
        deviations = np.abs(values - center)
        mad = float(np.median(deviations))
        if mad > 0.0:
            return MAD_TO_SIGMA * mad
        mean_ad = float(np.mean(deviations))
        if mean_ad > 0.0:
            return MEAN_AD_TO_SIGMA * mean_ad
        return max(TINY_SCALE, TINY_SCALE * abs(center))

    rng = np.random.default_rng(12)
    compared = set()
    for size in range(1, 401):
        for values in (rng.gamma(2.0, 3.0, size), rng.normal(0, 1, size).round(),
                       np.concatenate([np.full(size, 7.0), rng.normal(0, 50, size % 3)])):
            center = float(np.median(values))
            assert median(values) == center, (size, values)
            assert robust_scale(values, center) == numpy_scale(values, center), size
            compared.add(values.size % 2)
    assert compared == {0, 1}
    assert math.isnan(median(np.array([1.0, 2.0, float("nan"), 0.5])))
    assert math.isnan(median(np.array([float("nan")])))


def test_seasonal_uses_the_time_of_day() -> None:
    det = SeasonalBaseline()
    for hour in range(24 * 21):
        t = START + timedelta(hours=hour)
        det.learn_one(100.0 if 9 <= t.hour < 18 else 5.0, t)
    busy, quiet = START + timedelta(days=21, hours=11), START + timedelta(days=21, hours=3)
    assert det.score_one(100.0, busy) < 0.1
    assert det.score_one(100.0, quiet) >= ALERT
    assert det.score_one(5.0, busy) >= ALERT


@pytest.mark.parametrize("name", sorted(DETECTORS))
def test_scores_always_within_unit_interval(name: str) -> None:
    values, times = nasty_series()
    scores = score_series(DETECTORS[name](), values, times)
    assert len(scores) == len(values)
    assert all(0.0 <= s <= 1.0 for s in scores), name


@pytest.mark.parametrize("name", sorted(DETECTORS))
def test_no_look_ahead(name: str) -> None:
    values, times = nasty_series()
    full = score_series(DETECTORS[name](), values, times)
    prefix = score_series(DETECTORS[name](), values[:700], times[:700])
    assert prefix == full[:700]


@pytest.mark.parametrize("name", sorted(DETECTORS))
def test_score_one_changes_nothing(name: str) -> None:
    values, times = nasty_series()
    plain = score_series(DETECTORS[name](), values, times)
    det = DETECTORS[name]()
    meddled = []
    for x, t in zip(values, times, strict=True):
        det.score_one(x * 3.0 + 1.0, t + timedelta(minutes=7))
        meddled.append(det.score_one(x, t))
        det.score_one(-x, t)
        det.learn_one(x, t)
    assert meddled == plain


def test_registry() -> None:
    assert DEFAULT_DETECTOR == "corroborated"  # issue 29: episodic, corroborated by resonance
    assert {"robust_z", "ewma", "cusum", "proportion", "seasonal", "ks", "generic",
            "episodic", "corroborated", "resonance", "cad_ose", "contextual", "ensemble",
            "windowed_gaussian"} <= set(DETECTORS)
    for name, factory in DETECTORS.items():
        det = factory()
        assert isinstance(det, AnomalyDetector)
        assert det.name == name


# ----------------------------------------------------------------------------- csv


def test_score_csv_keeps_rows_order_and_header() -> None:
    values = level_shift(600, 500, 8.0, seed=5)
    times = [START + timedelta(minutes=5 * i) for i in range(len(values))]
    lines = [f"{t:%Y-%m-%d %H:%M:%S},{v!r}" for t, v in zip(times, values, strict=True)]
    source = "timestamp,value\n" + "\n".join(lines) + "\n"
    sink = io.StringIO()
    assert score_csv(io.StringIO(source), sink, detector="robust_z") == 600
    out = sink.getvalue().splitlines()
    assert out[0] == "timestamp,value,anomaly_score"
    assert len(out) == 601
    assert [line.rsplit(",", 1)[0] for line in out[1:]] == lines
    scores = [float(line.rsplit(",", 1)[1]) for line in out[1:]]
    assert scores[:30] == [0.0] * 30  # warming up, still scored
    expected = score_series(RobustZScore(), values, times)
    assert scores == pytest.approx(expected, abs=1e-5)
    assert scores[500] >= ALERT


def test_score_csv_default_detector_and_iso_timestamps() -> None:
    source = "timestamp,value\n2024-03-01T10:00:00Z,1\n2024-03-01T10:01:00+00:00,2.5\n"
    sink = io.StringIO()
    assert score_csv(io.StringIO(source), sink) == 2
    assert sink.getvalue().splitlines()[1:] == [
        "2024-03-01T10:00:00Z,1,0",
        "2024-03-01T10:01:00+00:00,2.5,0",
    ]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("2024-01-01 00:00:00,1\n2024-01-01 00:01:00,abc\n", "line 3: cannot parse value 'abc'"),
        ("2024-01-01 00:00:00,1\nyesterday,2\n", "line 3: cannot parse timestamp 'yesterday'"),
        ("2024-01-01 00:00:00,\n", "line 2: cannot parse value ''"),
        ("2024-01-01 00:00:00,nan\n", "line 2: value 'nan' is not a finite number"),
        ("2024-01-01 00:00:00,1,2\n", "line 2: expected 2 fields"),
    ],
)
def test_score_csv_names_the_bad_line(body: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        score_csv(io.StringIO("timestamp,value\n" + body), io.StringIO())


def test_score_csv_rejects_wrong_header_and_unknown_detector() -> None:
    with pytest.raises(ValueError, match="header"):
        score_csv(io.StringIO("time,val\n2024-01-01 00:00:00,1\n"), io.StringIO())
    with pytest.raises(ValueError, match="unknown detector"):
        score_csv(io.StringIO("timestamp,value\n"), io.StringIO(), detector="nope")


# ----------------------------------------------------------------------------- NAB scorer

STANDARD = Profile("standard", tp_weight=1.0, fp_weight=0.11, fn_weight=1.0)
LOW_FN = Profile("reward_low_FN_rate", tp_weight=1.0, fp_weight=0.11, fn_weight=2.0)


def series(name: str, n: int, windows: tuple[tuple[int, int], ...]) -> LabelledSeries:
    times = tuple(START + timedelta(minutes=5 * i) for i in range(n))
    return LabelledSeries(name, times, tuple(0.0 for _ in range(n)), windows)


def sigmoid_weight(position: float) -> float:
    """NAB's scaled sigmoid, written out: 2 * sigmoid(-5 x) - 1."""
    return 2.0 / (1.0 + math.exp(5.0 * position)) - 1.0


def test_scaled_sigmoid_and_probation() -> None:
    assert scaled_sigmoid(-1.0) == pytest.approx(0.98661, abs=1e-5)
    assert scaled_sigmoid(-0.5) == pytest.approx(0.84828, abs=1e-5)
    assert scaled_sigmoid(0.0) == 0.0
    assert scaled_sigmoid(3.01) == -1.0
    assert probationary_length(20) == 3
    assert probationary_length(4032) == 604
    assert probationary_length(10_000) == 750


def test_hand_computed_example() -> None:
    # 20 rows: rows 0-2 are probation (floor(0.15 * 20) = 3); one window, rows 10-13.
    data = series("tiny.csv", 20, ((10, 13),))
    scores = np.zeros(20)
    scores[1] = 0.95  # in probation: ignored
    scores[5] = 0.8   # false positive before any window: -fpWeight
    scores[12] = 1.0  # true positive 3rd of 4 rows into the window
    scores[13] = 1.0  # a later detection in the same window: worth nothing more
    scores[16] = 0.6  # false positive 3 rows after the window (width 4)
    tp = sigmoid_weight(-(13 - 12 + 1) / 4) / sigmoid_weight(-1.0)
    fp_before = -0.11
    fp_after = 0.11 * sigmoid_weight(abs(13 - 16) / (4 - 1))
    assert tp == pytest.approx(0.848284 / 0.986614, abs=1e-6)
    assert fp_after == pytest.approx(0.11 * -0.986614, abs=1e-6)

    sweep = sweep_rows(data, STANDARD)
    assert sweep.rows.tolist() == list(range(3, 20))
    thresholds, raw = sweep_thresholds(scores[sweep.rows], sweep, STANDARD.fn_weight)
    assert thresholds[:4].tolist() == [1.1, 1.0, 0.8, 0.6]
    assert raw[:4] == pytest.approx([-1.0, tp, tp + fp_before, tp + fp_before + fp_after])

    result = best_threshold({"tiny.csv": scores}, [data], STANDARD)
    assert result.threshold == 1.0
    assert result.raw == pytest.approx(tp)
    assert (result.null, result.perfect) == (-1.0, 1.0)
    assert result.normalized == pytest.approx(100 * (tp + 1) / 2)  # 92.99
    assert file_raw_score(scores, data, STANDARD, 0.7) == pytest.approx(tp + fp_before)

    # With misses costing double, null is -2 and the same detection normalises higher.
    low_fn = best_threshold({"tiny.csv": scores}, [data], LOW_FN)
    assert low_fn.null == -2.0
    assert low_fn.normalized == pytest.approx(100 * (tp + 2) / 3)


def test_earliest_detection_in_a_window_counts() -> None:
    data = series("early.csv", 20, ((10, 13),))
    scores = np.zeros(20)
    scores[13] = 0.9
    scores[10] = 0.5
    sweep = sweep_rows(data, STANDARD)
    thresholds, raw = sweep_thresholds(scores[sweep.rows], sweep, STANDARD.fn_weight)
    late = sigmoid_weight(-1 / 4) / sigmoid_weight(-1.0)
    assert thresholds[:3].tolist() == [1.1, 0.9, 0.5]
    assert raw[:3] == pytest.approx([-1.0, late, 1.0])


def corpus_and_oracle() -> tuple[list[LabelledSeries], dict[str, np.ndarray]]:
    corpus = [
        series("a.csv", 400, ((100, 139), (250, 289))),
        series("b.csv", 300, ((200, 229),)),
        series("c.csv", 300, ()),
    ]
    oracle = {}
    for s in corpus:
        scores = np.zeros(len(s))
        for left, _ in s.windows:
            scores[left] = 1.0
        oracle[s.name] = scores
    return corpus, oracle


@pytest.mark.parametrize("profile", [STANDARD, LOW_FN], ids=lambda p: p.name)
def test_null_detector_scores_zero_and_oracle_scores_hundred(profile: Profile) -> None:
    corpus, oracle = corpus_and_oracle()
    null = {s.name: np.full(len(s), 0.5) for s in corpus}
    assert best_threshold(null, corpus, profile).normalized == pytest.approx(0.0)
    never = {s.name: np.zeros(len(s)) for s in corpus}
    assert best_threshold(never, corpus, profile).normalized == pytest.approx(0.0)
    perfect = best_threshold(oracle, corpus, profile)
    assert perfect.normalized == pytest.approx(100.0)
    assert perfect.threshold == 1.0


def test_leave_one_out_picks_what_generalises() -> None:
    corpus, oracle = corpus_and_oracle()
    rng = np.random.default_rng(0)
    noise = {s.name: rng.uniform(0, 1, len(s)) for s in corpus}
    score, chosen = leave_one_out({"noise": noise, "oracle": oracle}, corpus, STANDARD)
    assert score == pytest.approx(100.0)
    assert set(chosen.values()) == {"oracle"}
