"""Advisor findings as ``info`` alerts: recorded in the alert history, never paged.

A pass computes the findings over the window ending at the newest event and compares
them with the advisor alerts still open: a finding that is new, or whose recommended
value moved by more than ``alert_move_share``, raises an alert (rule
``advisor_<kind>``, labels agent and subject, the playbook that covers it); the alert
of a finding that moved or is gone is resolved. Nothing goes to the outbox: whatever
the notifiers, an advice is read, not paged (the detector engine leaves these alerts
out of the ones it restores and re-sends).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from loopwatch.core.config import AdvisorSettings
from loopwatch.detectors.advisors.base import Finding, Scope, window_ending_now
from loopwatch.detectors.alerts import Alert, fingerprint
from loopwatch.store.clickhouse import read_time
from loopwatch.store.reader import Reader

log = logging.getLogger(__name__)

RULE_PREFIX = "advisor_"
#: the playbook whose investigation steps name each advisor
PLAYBOOKS: dict[str, str] = {
    "timeout": "timeout_miscalibration",
    "cache": "silent_prompt_cache_miss",
    "retry_amplification": "retry_storm_permanent_error",
    "quadratic_context": "cost_spike",
    "judge_agreement": "quality_degradation",
    "pipeline_candidate": "cost_spike",
}
OPEN_SQL = """
SELECT * FROM alerts FINAL
WHERE startsWith(rule, 'advisor_') AND state = 'firing'
"""

Write = Callable[[str, list[dict[str, Any]]], None]


def finding_alert(finding: Finding, now: datetime) -> Alert:
    rule = f"{RULE_PREFIX}{finding.kind}"
    labels = {"agent": finding.agent, "subject": finding.subject}
    value = finding.recommended if finding.recommended is not None else (
        finding.saving_usd_per_day or 0.0)
    return Alert(
        fingerprint=fingerprint(rule, labels), rule=rule, severity="info", labels=labels,
        playbook=PLAYBOOKS[finding.kind], summary=finding.recommendation, value=value,
        state="firing", started_at=now, fired_at=now,
        evidence={"evidence": finding.evidence, "query": finding.query,
                  "saving_usd_per_day": finding.saving_usd_per_day})


def moved(old: float, new: float, share: float) -> bool:
    """Whether the recommended value moved by more than ``share`` of the old one.

    >>> moved(1500, 2200, 0.2), moved(1500, 1600, 0.2), moved(0.0, 0.1, 0.2)
    (True, False, True)
    """
    if old == 0:
        return new != 0
    return abs(new - old) > share * abs(old)


def transitions(findings: list[Finding], open_alerts: list[Alert], share: float,
                now: datetime) -> list[Alert]:
    """The alert rows to write: new and moved findings fire, moved and gone ones resolve."""
    current = {alert.fingerprint: alert for alert in open_alerts}
    rows: list[Alert] = []
    seen = set()
    for finding in findings:
        alert = finding_alert(finding, now)
        seen.add(alert.fingerprint)
        old = current.get(alert.fingerprint)
        if old is not None and not moved(old.value, alert.value, share):
            continue
        if old is not None:
            rows.append(_resolved(old, now))
        rows.append(alert)
    rows.extend(_resolved(alert, now) for fp, alert in current.items() if fp not in seen)
    return rows


def _resolved(alert: Alert, now: datetime) -> Alert:
    return replace(alert, state="resolved", resolved_at=now, version=alert.version + 1)


def open_advisor_alerts(reader: Reader) -> list[Alert]:
    rows = reader.query(OPEN_SQL).records()
    for row in rows:  # through the store service, times and maps arrive as JSON
        row["started_at"] = read_time(row["started_at"])
        if isinstance(row["evidence"], dict):
            row["evidence"] = orjson.dumps(row["evidence"]).decode()
    return [Alert.from_row(row) for row in rows]


def advisor_pass(reader: Reader, write: Write, settings: AdvisorSettings,
                 max_clock_skew: timedelta, now: datetime | None = None,
                 scope: Scope | None = None) -> list[Alert]:
    """One pass: compute, compare, write; returns the rows written."""
    from loopwatch.detectors.advisors.run import advise

    wall = now or datetime.now(UTC)
    scope = scope or window_ending_now(reader, settings, "", wall, max_clock_skew)
    if scope is None:
        return []
    rows = transitions(advise(reader, scope, settings), open_advisor_alerts(reader),
                       settings.alert_move_share, wall)
    if rows:
        write("alerts", [alert.row(wall) for alert in rows])
    return rows


def run_advisors(reader: Reader, write: Write, settings: AdvisorSettings,
                 max_clock_skew: timedelta, stop: threading.Event,
                 delay_s: float = 0.0) -> None:
    """An advisor pass after ``delay_s`` and every ``interval_s`` until ``stop`` (a
    thread of ``up``)."""
    if delay_s and stop.wait(delay_s):
        return
    while True:
        try:
            advisor_pass(reader, write, settings, max_clock_skew)
        except Exception:  # the thread outlives any one pass's failure
            log.exception("advisor pass failed")
        if stop.wait(settings.interval_s):
            return


class QueryReader:
    """A :class:`~loopwatch.store.reader.Reader` over a query function (the detector
    engine's, which holds the lock on its reader client)."""

    def __init__(self, query: Callable[[str, dict[str, Any]], Any]) -> None:
        self._query = query

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> Any:
        return self._query(sql, parameters or {})


def start_advisors(query: Callable[[str, dict[str, Any]], Any], write: Write,
                   settings: AdvisorSettings, max_clock_skew: timedelta,
                   stop: threading.Event, delay_s: float = 0.0) -> None:
    threading.Thread(target=run_advisors,
                     args=(QueryReader(query), write, settings, max_clock_skew, stop,
                           delay_s),
                     name="advisors", daemon=True).start()
