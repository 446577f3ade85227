"""Capture decisions: which closed runs keep their staged payloads (docs/capture.md).

Every pass (``decide``, every ``capture_decide_interval_s`` inside ``loopwatch up``, or
next to the detectors with an external ClickHouse):

1. candidates: runs closed in ``runs FINAL`` that have staged parts and no decision yet;
   a success under ``capture=failures`` only once ``closed_ts + label_window_s`` has
   passed (a late ``wrong`` label makes it a failure, kept at once);
2. keep? ``capture=all`` -> keep; outcome other than ``success`` -> keep
   (``failure:<outcome>``); else keep if ``cityHash64(run_id) % 10000`` falls under
   ``capture_success_sample x 10000`` (a hash, so reprocessing decides the same way);
   ``capture=off`` keeps nothing;
3. the kept runs' parts and blobs are copied from staging (``INSERT … SELECT``), blobs
   first so a part is never visible without its bodies;
4. a ``capture_decisions`` row for every decided run, written last: a crash before it
   leaves the run undecided and the next pass copies again, harmlessly (the copies skip
   what is already kept).

Parts staged after their run was kept (the capture topic is consumed apart from the
events, so a failed run can be decided before its last bodies are staged) are copied
by later passes for an hour after the decision, and the decision's counts updated.
A decided run is never decided again, and never un-kept.

Blobs are shared between runs (a system prompt is stored once); a blob referenced by a
newly kept part is re-written with a fresh ``kept_at`` when its copy is over an hour
old, so the retention TTL on ``kept_at`` never removes a body a kept part still needs.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
from loopwatch.store import tables
from loopwatch.store.clickhouse import clickhouse_time, run_query

log = logging.getLogger(__name__)

#: Runs decided per query (a pass loops until none are left).
BATCH = 2000
#: How long after a keep decision late-staged parts are still copied.
LATE_PARTS = timedelta(hours=1)
#: A kept blob older than this is re-written when a new part needs it (TTL refresh).
BLOB_REFRESH = timedelta(hours=1)
NOW = "{now:DateTime64(3, 'UTC')}"

CANDIDATES_SQL = f"""
SELECT run_id, agent, outcome, cityHash64(run_id) % 10000 AS bucket
FROM runs FINAL
WHERE run_id IN (SELECT run_id FROM capture_staging)
  AND run_id NOT IN (SELECT run_id FROM capture_decisions)
  AND status = 'closed'
  AND ({{mode:String}} != 'failures' OR outcome != 'success'
       OR closed_ts <= {NOW} - toIntervalMillisecond({{window_ms:UInt64}}))
ORDER BY run_id
LIMIT {{limit:UInt32}}
"""
STAGED_TOTALS_SQL = """
SELECT run_id, count() AS parts, sum(bytes) AS bytes
FROM capture_staging FINAL WHERE run_id IN {ids:Array(String)} GROUP BY run_id
"""
KEPT_TOTALS_SQL = """
SELECT run_id, count() AS parts, sum(bytes) AS bytes
FROM capture_parts FINAL WHERE run_id IN {ids:Array(String)} GROUP BY run_id
"""
_NEEDED = "SELECT arrayJoin(hashes) FROM capture_staging WHERE run_id IN {ids:Array(String)}"
COPY_BLOBS_SQL = f"""
INSERT INTO capture_blobs (hash, encoding, body, bytes, kept_at)
SELECT hash, encoding, body, bytes, {NOW}
FROM capture_staging_blobs FINAL
WHERE hash IN ({_NEEDED})
  AND hash NOT IN (SELECT hash FROM capture_blobs
                   WHERE kept_at >= {{fresh:DateTime64(3, 'UTC')}} AND hash IN ({_NEEDED}))
"""
_PART_COLUMNS = ("event_id, run_id, agent, ts, event_type, step, tool, part, encoding, hashes, "
                 "bytes, truncated, redactions")
COPY_PARTS_SQL = f"""
INSERT INTO capture_parts ({_PART_COLUMNS}, kept_at)
SELECT {_PART_COLUMNS}, {NOW}
FROM capture_staging FINAL
WHERE run_id IN {{ids:Array(String)}}
  AND (run_id, event_id, part) NOT IN (SELECT run_id, event_id, part FROM capture_parts
                                       WHERE run_id IN {{ids:Array(String)}})
"""
LATE_SQL = """
SELECT DISTINCT run_id FROM capture_staging FINAL
WHERE run_id IN (SELECT run_id FROM capture_decisions FINAL
                 WHERE keep = 1 AND decided_at >= {since:DateTime64(3, 'UTC')})
  AND (run_id, event_id, part) NOT IN (
      SELECT run_id, event_id, part FROM capture_parts
      WHERE run_id IN (SELECT run_id FROM capture_decisions FINAL
                       WHERE keep = 1 AND decided_at >= {since:DateTime64(3, 'UTC')}))
"""
DECISIONS_SQL = """
SELECT run_id, agent, outcome, keep, reason, decided_at
FROM capture_decisions FINAL WHERE run_id IN {ids:Array(String)}
"""
DECISION_COLUMNS = ["run_id", "agent", "outcome", "keep", "reason", "parts", "bytes",
                    "decided_at"]


@dataclass
class DecisionReport:
    """What one pass did."""

    decided: int = 0
    kept: int = 0
    parts_kept: int = 0
    bytes_kept: int = 0
    late_runs: int = 0
    reasons: Counter[str] = field(default_factory=Counter)


def keep_decision(mode: str, outcome: str, bucket: int, sample: float) -> tuple[bool, str]:
    """(keep, reason) for one closed run; ``bucket`` is ``cityHash64(run_id) % 10000``.

    >>> keep_decision("failures", "looped", 9999, 0.1)
    (True, 'failure:looped')
    >>> [keep_decision("failures", "success", bucket, 0.1) for bucket in (999, 1000)]
    [(True, 'sampled_success'), (False, 'success_not_sampled')]
    >>> keep_decision("all", "success", 5000, 0.0), keep_decision("off", "hard_error", 0, 1.0)
    ((True, 'capture_all'), (False, 'capture_off'))
    """
    if mode == "off":
        return False, "capture_off"
    if mode == "all":
        return True, "capture_all"
    if outcome != "success":
        return True, f"failure:{outcome}"
    if bucket < round(sample * 10000):
        return True, "sampled_success"
    return False, "success_not_sampled"


def _copy(client: Client, ids: list[str], now: datetime) -> None:
    """Blobs, then parts, of these runs from staging into the kept tables."""
    params = {"ids": ids, "now": clickhouse_time(now),
              "fresh": clickhouse_time(now - BLOB_REFRESH)}
    client.command(COPY_BLOBS_SQL, parameters=params)
    client.command(COPY_PARTS_SQL, parameters=params)


def _totals(client: Client, sql: str, ids: list[str]) -> dict[str, tuple[int, int]]:
    rows = run_query(client, sql, {"ids": ids}).rows
    return {str(run_id): (int(parts), int(size)) for run_id, parts, size in rows}


def _decide_batch(client: Client, settings: Settings, now: datetime,
                  report: DecisionReport) -> int:
    candidates = run_query(client, CANDIDATES_SQL, {
        "mode": settings.capture, "now": clickhouse_time(now),
        "window_ms": int(settings.label_window_s * 1000), "limit": BATCH}).records()
    if not candidates:
        return 0
    ids = [str(row["run_id"]) for row in candidates]
    totals = _totals(client, STAGED_TOTALS_SQL, ids)
    decisions = []
    for row in candidates:
        keep, reason = keep_decision(settings.capture, str(row["outcome"]), int(row["bucket"]),
                                     settings.capture_success_sample)
        parts, size = totals.get(str(row["run_id"]), (0, 0))
        decisions.append([row["run_id"], row["agent"], row["outcome"], int(keep), reason,
                          parts, size, now])
        report.reasons[reason] += 1
        if keep:
            report.kept += 1
            report.parts_kept += parts
            report.bytes_kept += size
    kept = [row[0] for row in decisions if row[3]]
    if kept:
        _copy(client, kept, now)
    client.insert(tables.CAPTURE_DECISIONS, decisions, column_names=DECISION_COLUMNS)
    report.decided += len(decisions)
    return len(decisions)


def _late_parts(client: Client, now: datetime, report: DecisionReport) -> None:
    """Copy parts staged after their run was kept; refresh the decisions' counts."""
    late = [str(row[0]) for row in run_query(
        client, LATE_SQL, {"since": clickhouse_time(now - LATE_PARTS)}).rows]
    if not late:
        return
    _copy(client, late, now)
    totals = _totals(client, KEPT_TOTALS_SQL, late)
    rows = run_query(client, DECISIONS_SQL, {"ids": late}).records()
    client.insert(tables.CAPTURE_DECISIONS, [
        [row["run_id"], row["agent"], row["outcome"], row["keep"], row["reason"],
         *totals.get(str(row["run_id"]), (0, 0)), row["decided_at"]]  # same version:
        for row in rows], column_names=DECISION_COLUMNS)  # the later insert wins
    report.late_runs += len(late)


def decide(client: Client, settings: Settings, now: datetime | None = None) -> DecisionReport:
    """One pass (see the module doc); safe to run again or from two places at once."""
    now = now or datetime.now(UTC)
    report = DecisionReport()
    while _decide_batch(client, settings, now, report) == BATCH:
        pass
    _late_parts(client, now, report)
    if report.decided or report.late_runs:
        log.info("capture decisions: %d runs decided, %d kept (%d parts, %d bytes), "
                 "%d with late parts", report.decided, report.kept, report.parts_kept,
                 report.bytes_kept, report.late_runs)
    return report


def start_decider(settings: Settings, client: Client,
                  stop: threading.Event) -> threading.Thread:
    """Run :func:`decide` every ``capture_decide_interval_s`` on a daemon thread until
    ``stop``; a failing pass is logged and retried at the next interval."""

    def loop() -> None:
        while not stop.wait(settings.capture_decide_interval_s):
            try:
                decide(client, settings)
            except Exception as exc:
                log.warning("capture decision pass failed: %s", exc)

    thread = threading.Thread(target=loop, name="capture-decider", daemon=True)
    thread.start()
    return thread
