"""Registered detectors by name: what alert rules, ``detect-csv`` and the benchmark use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from loopwatch.detectors.anomaly.base import AnomalyDetector
from loopwatch.detectors.anomaly.cad import ContextualAnomalyDetector
from loopwatch.detectors.anomaly.contextual import ContextNovelty
from loopwatch.detectors.anomaly.corroborated import Corroborated
from loopwatch.detectors.anomaly.cusum import Cusum
from loopwatch.detectors.anomaly.ensemble import MaxEnsemble
from loopwatch.detectors.anomaly.ewma import EWMALevelShift
from loopwatch.detectors.anomaly.gaussian import WindowedGaussian
from loopwatch.detectors.anomaly.generic import GenericConfig, GenericDetector
from loopwatch.detectors.anomaly.ks import KSShift
from loopwatch.detectors.anomaly.proportion import ProportionDetector
from loopwatch.detectors.anomaly.refractory import Refractory
from loopwatch.detectors.anomaly.resonance import ResonanceDetector
from loopwatch.detectors.anomaly.robust_z import RobustZScore
from loopwatch.detectors.anomaly.seasonal import SeasonalBaseline

EPISODIC = replace(GenericConfig(), spatial_min_z=5.0, spatial_warmup=1500,
                   settled_tolerance=0.01, settled_min_z=4.0)
"""``generic``'s settings inside ``episodic``: its range check wants 5 sigmas, not 4, so an
ordinary record on a day-old range does not page (the scorecard's clean day; on NAB this
changes no score), and once the likelihood has learned (388 points) it waits until the
range has been seen for 1500 points: a range of a few hundred points is broken by
ordinary traffic (NAB: the first records of two rogue-agent series), and the likelihood
judges such records. While the likelihood learns, the range check stays on: it is the
only voice then (a 60x cost spike after 80 five-minute buckets must still page). After
the wait the range is settled, and a record by 1 % of it, 4 sigmas off the baseline,
scores 1.0 (NAB: machine temperature's first failure is caught at its climb to a record,
row 2380, rather than at row 2597; ec2 latency's first window at 2048, not 2081). The
wait, the settled tolerance and its sigmas are chosen leave-one-file-out together
(docs/detectors.md)."""


def episodic() -> AnomalyDetector:
    """``generic``'s residual likelihood, paging once per episode."""
    return Refractory(GenericDetector(EPISODIC), rest=150, level=0.45, name="episodic")


def corroborated() -> AnomalyDetector:
    """``episodic``, raised where the adaptive-resonance detector saw a new shape (the
    default): 0.3 x its highest score over the last 25 points is added to each episode
    opening, and the sum pages once per episode (the same 150-point rest)."""
    raised = Corroborated(episodic(), ResonanceDetector(), weight=0.3, memory=25)
    return Refractory(raised, rest=150, level=0.45, name="corroborated")


def cad_ose() -> AnomalyDetector:
    """CAD OSE's contexts, on a range fixed after a 600-point warm-up (widened by 1x)."""
    return ContextualAnomalyDetector(warmup=600, margin=1.0)


def contextual() -> AnomalyDetector:
    """CAD-OSE-style contextual novelty, each burst of novelty reported once."""
    return Refractory(ContextNovelty(), rest=150, level=None, name="contextual")


def ensemble() -> AnomalyDetector:
    """``generic`` and ``contextual`` voting by weighted maximum, once per episode."""
    members: list[tuple[AnomalyDetector, float]] = [
        (GenericDetector(), 1.0), (ContextNovelty(), 0.5)]
    return Refractory(MaxEnsemble(members), rest=150, level=0.45, name="ensemble")


DETECTORS: dict[str, Callable[[], AnomalyDetector]] = {
    "robust_z": RobustZScore,
    "ewma": EWMALevelShift,
    "cusum": Cusum,
    "proportion": ProportionDetector,
    "seasonal": SeasonalBaseline,
    "ks": KSShift,
    "generic": GenericDetector,
    "episodic": episodic,
    "corroborated": corroborated,
    "resonance": ResonanceDetector,
    "cad_ose": cad_ose,
    "contextual": contextual,
    "ensemble": ensemble,
    "windowed_gaussian": WindowedGaussian,
}
"""Every entry builds a fresh detector with its defaults."""

DEFAULT_DETECTOR = "corroborated"
"""For generic per-minute metric series (what the alert rules use unless told otherwise):
``generic`` inside a refractory period, corroborated by adaptive resonance; chosen on NAB
leave-one-file-out (docs/detectors.md)."""
