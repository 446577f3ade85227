"""Per-agent summary of the four core metrics, read from the per-minute views.

Ratios are re-aggregated as sum(numerator) / sum(denominator) over the views, so the
formulas live in one place (the migrations); a ratio with no denominator is None.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from loopwatch.ingest.events import OUTCOMES
from loopwatch.store.reader import Reader

RUNS_SQL = """
SELECT agent, sum(closed_runs), sum(silent_failures), sum(hard_errors), sum(successes),
       sum(cost_usd)
FROM run_metrics_1m GROUP BY agent
"""
OUTCOMES_SQL = """
SELECT agent, outcome, sum(runs), sum(cost_usd) FROM outcomes_1m GROUP BY agent, outcome
"""
TOOLS_SQL = """
SELECT agent, sum(near_misses), sum(timeouts_known_duration) FROM tool_metrics_1m GROUP BY agent
"""
CACHE_SQL = """
SELECT agent, sum(cache_read_input_tokens),
       sum(cache_read_input_tokens + cache_creation_input_tokens + uncached_input_tokens)
FROM cache_metrics_1m GROUP BY agent
"""


def ratio(numerator: float, denominator: float) -> float | None:
    return None if not denominator else float(numerator) / float(denominator)


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
    for agent, outcome, runs, cost in reader.query(OUTCOMES_SQL).rows:
        entry = agents[agent]
        entry["runs"] += int(runs)
        entry["outcomes"][outcome] = int(runs)
        entry["cost_per_outcome"][outcome] = ratio(cost, runs)
    for agent, closed, silent, hard, successes, cost in reader.query(RUNS_SQL).rows:
        entry = agents[agent]
        entry["silent_failure_ratio"] = ratio(silent, closed)
        entry["exception_rate"] = ratio(hard, closed)
        entry["cost_per_successful_run"] = ratio(cost, successes)
    for agent, near_misses, known in reader.query(TOOLS_SQL).rows:
        agents[agent]["near_miss_timeout_ratio"] = ratio(near_misses, known)
    for agent, read, total in reader.query(CACHE_SQL).rows:
        agents[agent]["cache_hit_rate"] = ratio(read, total)
    for entry in agents.values():
        entry["outcomes"] = {name: entry["outcomes"].get(name, 0) for name in OUTCOMES
                             if name != "unknown" or entry["outcomes"].get(name)}
        entry["cost_per_outcome"] = {name: entry["cost_per_outcome"].get(name)
                                     for name in entry["outcomes"]}
    events = int(reader.query("SELECT count() FROM events FINAL").rows[0][0])
    runs = int(reader.query("SELECT count() FROM runs FINAL").rows[0][0])
    return {"events": events, "runs": runs, "agents": dict(sorted(agents.items()))}
