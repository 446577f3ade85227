"""Trace economics (seed 000): what reproducing a failure by re-running costs, against
what capturing every run costs, per agent, from the stored data.

A failure mode seen in a share ``p`` of an agent's runs takes, in expectation, ``1/p``
re-runs to see once. Each re-run is a draw from all the agent's runs, so it costs the
agent's average run in tokens and its average wall-clock time of an engineer waiting:

    reproduction tax = (1/p) x (avg run cost + avg run seconds x engineer $/s)

Capturing costs storage on every run: the compressed bytes kept per run, priced per
GiB-month for the retention. Capture is worth it when ``TRACE_COST < p x tax``.

The seed's worked example (p = 2 %, $0.05 and 40 s a run, $120/h) is the test vector:

>>> tax = reproduction_tax(0.02, 0.05, 40, 120)
>>> round(tax.expected_runs), f"{tax.token_cost:.2f}", f"{tax.engineer_cost:.2f}"
(50, '2.50', '66.67')
>>> f"{tax.total:.2f}", round(tax.wall_seconds / 60)
('69.17', 33)
>>> worth_capturing(0.01, 0.02, tax.total)
True

**Compressed bytes per run.** ClickHouse reports compressed sizes per table
(``system.parts``), not per run, and blobs are shared between runs (a system prompt is
stored once). So the kept tables' compressed size is apportioned by logical bytes:
``stored(agent) = compressed(capture_parts + capture_blobs) x kept bytes(agent's runs)
/ kept bytes(all runs)``, the logical bytes being ``capture_decisions.bytes`` of kept
runs. That is the uncompressed size times the measured ratio, deduplication included.
Staging (every run's parts for 7 days before its decision) is left out: it is the same
bytes for a week, priced the same way, and is not what keeping a run costs.
A GiB is 2^30 bytes and a month 30 days, as object stores bill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from loopwatch.core.config import Settings
from loopwatch.store.reader import Reader

GIB: Final = 1 << 30
MONTH_DAYS: Final = 30.0
KEPT_TABLES: Final = ("capture_parts", "capture_blobs")


@dataclass(frozen=True)
class ReproductionTax:
    """What one reproduction by re-running costs, split into tokens and engineer time."""

    p: float
    expected_runs: float
    token_cost: float
    wall_seconds: float
    engineer_cost: float

    @property
    def total(self) -> float:
        return self.token_cost + self.engineer_cost

    def to_json(self) -> dict[str, float]:
        return {"p": self.p, "expected_runs": self.expected_runs,
                "token_cost_usd": self.token_cost, "wall_seconds": self.wall_seconds,
                "engineer_cost_usd": self.engineer_cost, "total_usd": self.total}


def reproduction_tax(p: float, run_cost_usd: float, run_seconds: float,
                     engineer_usd_per_hour: float) -> ReproductionTax:
    """``1/p`` runs of tokens plus ``1/p`` runs of an engineer's time; ``p`` in (0, 1]."""
    if not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1], got {p}")
    runs = 1 / p
    wall = runs * run_seconds
    return ReproductionTax(p=p, expected_runs=runs, token_cost=runs * run_cost_usd,
                           wall_seconds=wall,
                           engineer_cost=wall * engineer_usd_per_hour / 3600)


def capture_cost_per_run(stored_bytes_per_run: float, storage_usd_per_gb_month: float,
                         retention_days: float) -> float:
    """Storage of one run's captured bytes for the retention.

    >>> capture_cost_per_run(GIB, 0.10, 30)
    0.1
    """
    return stored_bytes_per_run / GIB * storage_usd_per_gb_month * retention_days / MONTH_DAYS


def worth_capturing(trace_cost_per_run: float, p: float, tax_total: float) -> bool:
    """The seed's rule: capture when it costs less per run than the tax it avoids."""
    return trace_cost_per_run < p * tax_total


@dataclass(frozen=True)
class Rates:
    """The prices the numbers use (``LOOPWATCH_ENGINEER_USD_PER_HOUR`` etc.)."""

    engineer_usd_per_hour: float = 120.0
    storage_usd_per_gb_month: float = 0.10
    capture_retention_days: int = 30

    @classmethod
    def from_settings(cls, settings: Settings) -> Rates:
        return cls(settings.engineer_usd_per_hour, settings.storage_usd_per_gb_month,
                   settings.capture_retention_days)

    @classmethod
    def from_environment(cls) -> Rates:
        """The configured rates (``LOOPWATCH_*``, config file), or the defaults when the
        settings do not load: the web view must show numbers either way."""
        from pydantic import ValidationError

        from loopwatch.core.config import load_settings

        try:
            return cls.from_settings(load_settings())
        except (ValidationError, OSError):
            return cls()

    def to_json(self) -> dict[str, float]:
        return {"engineer_usd_per_hour": self.engineer_usd_per_hour,
                "storage_usd_per_gb_month": self.storage_usd_per_gb_month,
                "capture_retention_days": self.capture_retention_days}


@dataclass(frozen=True)
class FailureMode:
    outcome: str
    runs: int
    tax: ReproductionTax
    worth_it: bool

    def to_json(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "runs": self.runs, **self.tax.to_json(),
                "avoided_per_run_usd": self.tax.p * self.tax.total, "worth_it": self.worth_it}


@dataclass(frozen=True)
class AgentEconomics:
    """One agent over a window of closed runs."""

    agent: str
    since: datetime
    until: datetime
    runs: int
    avg_run_cost_usd: float
    avg_run_seconds: float
    kept_runs: int
    kept_bytes: int
    stored_bytes: float
    capture_cost_per_run_usd: float
    rates: Rates
    failure_modes: tuple[FailureMode, ...] = field(default_factory=tuple)

    @property
    def stored_bytes_per_run(self) -> float:
        return self.stored_bytes / self.runs if self.runs else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "agent": self.agent, "since": self.since.isoformat(),
            "until": self.until.isoformat(), "runs": self.runs,
            "avg_run_cost_usd": self.avg_run_cost_usd, "avg_run_seconds": self.avg_run_seconds,
            "capture": {"kept_runs": self.kept_runs, "kept_bytes": self.kept_bytes,
                        "stored_bytes": self.stored_bytes,
                        "stored_bytes_per_run": self.stored_bytes_per_run,
                        "cost_per_run_usd": self.capture_cost_per_run_usd},
            "rates": self.rates.to_json(),
            "failure_modes": [mode.to_json() for mode in self.failure_modes],
            "verdict": "TRACE_COST < p x reproduction tax",
        }


RUNS_SQL: Final = """SELECT outcome, count() AS runs, sum(cost_usd) AS cost_usd,
       sum(toUnixTimestamp64Milli(assumeNotNull(closed_ts))
           - toUnixTimestamp64Milli(started_ts)) AS duration_ms
FROM runs FINAL
WHERE agent = {agent:String} AND status = 'closed'
  AND started_ts >= {since:DateTime64(3)} AND started_ts < {until:DateTime64(3)}
GROUP BY outcome ORDER BY outcome"""

KEPT_SQL: Final = """SELECT countIf(keep = 1) AS kept_runs, sumIf(bytes, keep = 1) AS kept_bytes
FROM capture_decisions FINAL
WHERE run_id IN (SELECT run_id FROM runs FINAL
                 WHERE agent = {agent:String} AND status = 'closed'
                   AND started_ts >= {since:DateTime64(3)}
                   AND started_ts < {until:DateTime64(3)})"""

STORED_SQL: Final = """SELECT
    (SELECT sum(data_compressed_bytes) FROM system.parts
     WHERE database = currentDatabase() AND active
       AND table IN ('capture_parts', 'capture_blobs')) AS compressed_bytes,
    (SELECT sumIf(bytes, keep = 1) FROM capture_decisions FINAL) AS kept_bytes"""


def agent_economics(reader: Reader, agent: str, rates: Rates,
                    window: timedelta = timedelta(days=7),
                    now: datetime | None = None) -> AgentEconomics:
    """The agent's reproduction tax per failure mode and its capture cost per run, over
    the closed runs started in ``[now - window, now)``. Three queries."""
    until = now or datetime.now(UTC)
    since = until - window
    parameters = {"agent": agent, "since": since, "until": until}
    by_outcome = reader.query(RUNS_SQL, parameters).records()
    runs = sum(int(row["runs"]) for row in by_outcome)
    cost = sum(float(row["cost_usd"] or 0) for row in by_outcome)
    seconds = sum(float(row["duration_ms"] or 0) for row in by_outcome) / 1000
    avg_cost = cost / runs if runs else 0.0
    avg_seconds = seconds / runs if runs else 0.0
    kept = reader.query(KEPT_SQL, parameters).records()[0]
    kept_runs, kept_bytes = int(kept["kept_runs"] or 0), int(kept["kept_bytes"] or 0)
    totals = reader.query(STORED_SQL, {}).records()[0]
    compressed, all_kept = int(totals["compressed_bytes"] or 0), int(totals["kept_bytes"] or 0)
    stored = compressed * kept_bytes / all_kept if all_kept else 0.0
    per_run = stored / runs if runs else 0.0
    trace_cost = capture_cost_per_run(per_run, rates.storage_usd_per_gb_month,
                                      rates.capture_retention_days)
    modes = []
    for row in by_outcome:
        if row["outcome"] == "success" or not runs:
            continue
        tax = reproduction_tax(int(row["runs"]) / runs, avg_cost, avg_seconds,
                               rates.engineer_usd_per_hour)
        modes.append(FailureMode(str(row["outcome"]), int(row["runs"]), tax,
                                 worth_capturing(trace_cost, tax.p, tax.total)))
    modes.sort(key=lambda mode: (-mode.runs, mode.outcome))
    return AgentEconomics(agent=agent, since=since, until=until, runs=runs,
                          avg_run_cost_usd=avg_cost, avg_run_seconds=avg_seconds,
                          kept_runs=kept_runs, kept_bytes=kept_bytes, stored_bytes=stored,
                          capture_cost_per_run_usd=trace_cost, rates=rates,
                          failure_modes=tuple(modes))
