"""How long each table keeps its rows: one definition for the single-node store
(``migrate`` applies it as ``ALTER TABLE ... MODIFY TTL``) and the cluster DDL
(:mod:`loopwatch.store.cluster` renders it onto the ``_local`` tables).

Every rule counts from when loopwatch stored the row (``ingested_at``, or a column the
writer stamps with its own clock), never from the event's time: imported history is
kept for its retention too, and an event dated 1900 or 2299 (the contract's range) is
kept like any other. The TTL is DateTime64 arithmetic (``ingested_at + INTERVAL n
DAY``), exact over DateTime64's range; ``toDateTime`` would wrap at 2106.

Defaults are :data:`RETENTION`; ``retention_days`` (table -> days) overrides any table,
and ``capture_retention_days`` sets the kept-payload tables (:data:`CAPTURE_TABLES`).
Tables with a TTL in their migration (``pipeline_gauges``, the capture staging tables)
keep it. Rows are dropped by ClickHouse's TTL merges, so expiry is not instantaneous.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace

from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    """Rows older than ``days`` by ``column`` are dropped (a table TTL)."""

    column: str
    days: int
    why: str

    def ttl(self) -> str:
        return f"{self.column} + INTERVAL {self.days} DAY"

    def normalized(self) -> str:
        """The TTL as ClickHouse prints it back in ``system.tables.engine_full``."""
        return f"{self.column} + toIntervalDay({self.days})"


RAW_DAYS = 30
DERIVED_DAYS = 180

#: Retention per table. Raw input (events, dead letters) is the bulk of the bytes and
#: is only needed for replay and investigation: 30 days. Derived tables feed trends and
#: baselines: 180 days. Tables with a TTL in their migration (``pipeline_gauges``) keep it.
#: Columns: ``ingested_at`` (migration 007), else the time the writer stored the row
#: (``received_at``, ``updated_at``, ...): an alert's ``started_at`` is event time.
INGESTED = "ingested_at"
RETENTION: dict[str, Retention] = {
    "events": Retention(INGESTED, RAW_DAYS, "raw events (replay, reprocess, investigations)"),
    "dead_letters": Retention("received_at", RAW_DAYS, "refused raw input"),
    "llm_calls": Retention(INGESTED, DERIVED_DAYS, "derived: one row per LLM call"),
    "tool_calls": Retention(INGESTED, DERIVED_DAYS, "derived: one row per tool call"),
    "runs": Retention(INGESTED, DERIVED_DAYS, "derived: one row per run (its last write)"),
    "labels": Retention(INGESTED, DERIVED_DAYS, "derived: verdicts"),
    "annotations": Retention(INGESTED, DERIVED_DAYS,
                             "derived: deploys, model and prompt changes"),
    "alerts": Retention("updated_at", DERIVED_DAYS, "derived: alert history (last write)"),
    "rule_evaluations": Retention("evaluated_at", DERIVED_DAYS, "derived: latest evaluations"),
    "capture_parts": Retention("kept_at", RAW_DAYS, "captured payloads of kept runs (replay)"),
    "capture_blobs": Retention("kept_at", RAW_DAYS, "captured bodies, once per content hash"),
    "capture_decisions": Retention("decided_at", RAW_DAYS, "why a run's payloads were kept"),
}

#: 100 years. The TTL no longer wraps (DateTime64, not ``toDateTime``, which ended in
#: 2106 and bounded this at 10,000 days); what bounds it now is DateTime64's own end,
#: 2299-12-31: a row stored before 2199 and kept this long expires inside the range.
MAX_DAYS = 36_500

#: Follow ``capture_retention_days`` (docs/capture.md).
CAPTURE_TABLES = ("capture_parts", "capture_blobs", "capture_decisions")

_TTL = re.compile(r"\bTTL (?P<ttl>.*?)(?: SETTINGS |$)")


def retention_for(settings: Settings) -> dict[str, Retention]:
    """The rules with the settings' overrides applied (``retention_days`` wins)."""
    rules = dict(RETENTION)
    for table in CAPTURE_TABLES:
        rules[table] = replace(rules[table], days=settings.capture_retention_days)
    for table, days in settings.retention_days.items():
        if table not in rules:
            raise ValueError(f"retention_days names {table!r}, which has no retention "
                             f"rule; tables: {', '.join(sorted(rules))}")
        if not 1 <= days <= MAX_DAYS:
            raise ValueError(f"retention_days[{table!r}] must be 1..{MAX_DAYS} (got {days})")
        rules[table] = replace(rules[table], days=days)
    return rules


def current_ttls(client: Client, database: str) -> dict[str, str]:
    """MergeTree table -> its TTL as ClickHouse prints it ('' when it has none). Other
    engines (a cluster's Distributed front tables) take no TTL and are left out."""
    rows = client.query("SELECT name, engine_full FROM system.tables WHERE database = "
                        "{d:String} AND endsWith(engine, 'MergeTree')",
                        parameters={"d": database}).result_rows
    ttls = {}
    for name, engine in rows:
        match = _TTL.search(engine)
        ttls[name] = match["ttl"].strip() if match else ""
    return ttls


def apply_retention(client: Client, settings: Settings) -> dict[str, int]:
    """Set every table's TTL to its rule; only tables whose TTL differs are altered
    (so running it at every start rewrites nothing). Returns the tables changed."""
    rules = retention_for(settings)
    existing = current_ttls(client, settings.database)
    changed: dict[str, int] = {}
    for table, rule in rules.items():
        if table not in existing or existing[table] == rule.normalized():
            continue
        client.command(f"ALTER TABLE {settings.database}.{table} MODIFY TTL {rule.ttl()}")
        changed[table] = rule.days
    if changed:
        log.info("retention set: %s", ", ".join(f"{t} {d} days" for t, d in changed.items()))
    return changed
