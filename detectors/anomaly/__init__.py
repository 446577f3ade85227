"""Online statistical anomaly detectors behind one river-style interface.

Every detector has ``score_one(x, t)`` (a score in ``[0, 1]`` from what it learned before
``x``; changes nothing) and ``learn_one(x, t)``; call them in that order on each point.
One module per detector, each class saying which signal it suits:

=====================  =============================================================
``robust_z``           spikes against a rolling median/MAD (:mod:`.robust_z`)
``ewma``               sustained level shifts, robust to lone spikes (:mod:`.ewma`)
``cusum``              small persistent drifts either way (:mod:`.cusum`)
``proportion``         rates from small counts, k of n (:mod:`.proportion`)
``seasonal``           same hour of the week or day (:mod:`.seasonal`)
``ks``                 distribution shift, e.g. completion lengths (:mod:`.ks`)
``generic``            residual likelihood for per-minute metric series (:mod:`.generic`)
``episodic``           ``generic`` paging once per episode (:mod:`.refractory`)
``corroborated``       the default: ``episodic`` raised by ``resonance`` (:mod:`.corroborated`)
``resonance``          ARTime-style adaptive resonance over window shapes (:mod:`.resonance`)
``cad_ose``            CAD OSE's contexts of facts, scored by novelty (:mod:`.cad`)
``contextual``         CAD-OSE-style novelty of a value in its context (:mod:`.contextual`)
``ensemble``           weighted-maximum vote of generic and contextual (:mod:`.ensemble`)
``windowed_gaussian``  NAB's baseline, for comparison only (:mod:`.gaussian`)
=====================  =============================================================

:mod:`.registry` maps these names to factories; :mod:`.csvscore` scores a CSV file;
``python -m loopwatch.bench.nab_score`` scores them all on the Numenta Anomaly Benchmark and
``python -m loopwatch.bench.nab_table`` gives the leave-one-file-out table of docs/detectors.md.
"""

from loopwatch.detectors.anomaly.base import AnomalyDetector, score_series
from loopwatch.detectors.anomaly.csvscore import score_csv
from loopwatch.detectors.anomaly.registry import DEFAULT_DETECTOR, DETECTORS

__all__ = ["DEFAULT_DETECTOR", "DETECTORS", "AnomalyDetector", "score_csv", "score_series"]
