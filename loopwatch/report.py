"""Per-agent summary of the core metrics, read from the per-minute views.

Each ratio is its one definition in ``loopwatch/core/metrics.toml``, re-aggregated over the
views as sum(numerator) / sum(denominator) and divided here; a ratio with no denominator
is None.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Final

from loopwatch.core.metrics import METRICS, Metric
from loopwatch.ingest.events import OUTCOMES
from loopwatch.store.reader import Reader

#: report key -> metric, per agent (the report's keys are older than the metric names)
REPORTED: Final[dict[str, str]] = {
    "silent_failure_ratio": "silent_failure_ratio",
    "exception_rate": "exception_rate",
    "cost_per_successful_run": "cost_per_successful_run",
    "near_miss_timeout_ratio": "near_miss_ratio",
    "cache_hit_rate": "cache_hit_rate",
}
#: per agent and outcome
PER_OUTCOME: Final = METRICS["cost_per_outcome"]


def _sums(metric: Metric) -> str:
    return f"sum({metric.numerator}), sum({' + '.join(metric.denominator)})"


def metric_sql(keys: list[str]) -> str:
    """One query over the view the metrics share: agent, then (numerator, denominator)
    sums per metric, in ``keys``' order."""
    metrics = [METRICS[REPORTED[key]] for key in keys]
    return (f"SELECT agent, {', '.join(_sums(metric) for metric in metrics)}\n"
            f"FROM {metrics[0].view} GROUP BY agent")


def _by_view() -> dict[str, list[str]]:
    views: dict[str, list[str]] = {}
    for key, name in REPORTED.items():
        views.setdefault(METRICS[name].view, []).append(key)
    return views


OUTCOMES_SQL: Final = (f"SELECT agent, outcome, sum(runs), {_sums(PER_OUTCOME)}\n"
                       f"FROM {PER_OUTCOME.view} GROUP BY agent, outcome")


def fleet_report(reader: Reader) -> dict[str, Any]:
    agents: dict[str, dict[str, Any]] = defaultdict(lambda: {
        "runs": 0,
        "outcomes": {},
        "silent_failure_ratio": None,
        "exception_rate": None,
        "near_miss_timeout_ratio": None,
        "cache_hit_rate": None,
        "cost_per_outcome": {},
        "cost_per_successful_run": None,
    })
    for agent, outcome, runs, numerator, denominator in reader.query(OUTCOMES_SQL).rows:
        entry = agents[agent]
        entry["runs"] += int(runs)
        entry["outcomes"][outcome] = int(runs)
        entry["cost_per_outcome"][outcome] = PER_OUTCOME.value(numerator, denominator)
    for keys in _by_view().values():
        for agent, *sums in reader.query(metric_sql(keys)).rows:
            for index, key in enumerate(keys):
                agents[agent][key] = METRICS[REPORTED[key]].value(sums[2 * index],
                                                                  sums[2 * index + 1])
    for entry in agents.values():
        entry["outcomes"] = {name: entry["outcomes"].get(name, 0) for name in OUTCOMES
                             if name != "unknown" or entry["outcomes"].get(name)}
        entry["cost_per_outcome"] = {name: entry["cost_per_outcome"].get(name)
                                     for name in entry["outcomes"]}
    events = int(reader.query("SELECT count() FROM events FINAL").rows[0][0])
    runs = int(reader.query("SELECT count() FROM runs FINAL").rows[0][0])
    return {"events": events, "runs": runs, "agents": dict(sorted(agents.items()))}
