"""Registered detectors by name: what alert rules, ``detect-csv`` and the benchmark use."""

from __future__ import annotations

from collections.abc import Callable

from loopwatch.detectors.anomaly.base import AnomalyDetector
from loopwatch.detectors.anomaly.cusum import Cusum
from loopwatch.detectors.anomaly.ewma import EWMALevelShift
from loopwatch.detectors.anomaly.gaussian import WindowedGaussian
from loopwatch.detectors.anomaly.generic import GenericDetector
from loopwatch.detectors.anomaly.ks import KSShift
from loopwatch.detectors.anomaly.proportion import ProportionDetector
from loopwatch.detectors.anomaly.robust_z import RobustZScore
from loopwatch.detectors.anomaly.seasonal import SeasonalBaseline

DETECTORS: dict[str, Callable[[], AnomalyDetector]] = {
    "robust_z": RobustZScore,
    "ewma": EWMALevelShift,
    "cusum": Cusum,
    "proportion": ProportionDetector,
    "seasonal": SeasonalBaseline,
    "ks": KSShift,
    "generic": GenericDetector,
    "windowed_gaussian": WindowedGaussian,
}
"""Every entry builds a fresh detector with its defaults."""

DEFAULT_DETECTOR = "generic"
"""For generic per-minute metric series (what the alert rules use unless told otherwise)."""
