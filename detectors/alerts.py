"""Alert lifecycle: pending -> firing -> resolved, one alert per rule and label set.

A finding that turns active opens a *pending* alert; it *fires* once it has stayed active
for the rule's for-duration (event time); it *resolves* when the condition is false or
its rows are gone. A rule that lacks samples or history neither fires nor resolves.

>>> from datetime import datetime, timedelta, UTC
>>> from loopwatch.detectors.rules import Finding, load_rules
>>> rule = load_rules()["stuck_run"]
>>> book, t0 = AlertBook(), datetime(2026, 1, 1, tzinfo=UTC)
>>> hit = Finding(rule, {"agent": "a", "task_type": "t", "run_id": "r"}, 25.0, "active", 1)
>>> [(t.kind, t.alert.state) for t in book.observe(rule, [hit], t0)]
[('fired', 'firing')]
>>> [(t.kind, t.alert.state) for t in book.observe(rule, [], t0 + timedelta(minutes=1))]
[('resolved', 'resolved')]
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Literal
from urllib.parse import quote

import orjson

from loopwatch.detectors.rules import Finding, Rule
from loopwatch.store.clickhouse import read_time

AlertState = Literal["pending", "firing", "resolved"]


#: between the summary an alert fired with and its current one
NOW_SEPARATOR = " · now "


def fingerprint(rule: str, labels: dict[str, str]) -> str:
    body = orjson.dumps({"rule": rule, "labels": labels}, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(body).hexdigest()[:16]


@dataclass(frozen=True)
class Alert:
    fingerprint: str
    rule: str
    severity: str
    labels: dict[str, str]
    playbook: str
    summary: str
    value: float
    state: AlertState
    started_at: datetime
    fired_at: datetime | None = None
    resolved_at: datetime | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    link: str = ""
    version: int = 1
    #: the rule's summary at the latest evaluation, while it differs from ``summary``
    #: (which keeps the figure the alert fired with)
    current_summary: str = ""

    @property
    def shown_summary(self) -> str:
        """The firing figure, and beside it the current one once they differ.

        >>> a = Alert("f", "r", "warning", {}, "", "11.6% looped (5 of 43 runs)", 0.116,
        ...           "firing", datetime(2026, 1, 1), current_summary="9.8% looped (5 of 51 runs)")
        >>> a.shown_summary
        '11.6% looped (5 of 43 runs) · now 9.8% looped (5 of 51 runs)'
        """
        if not self.current_summary or self.current_summary == self.summary:
            return self.summary
        return f"{self.summary}{NOW_SEPARATOR}{self.current_summary}"

    def row(self, updated_at: datetime) -> dict[str, Any]:
        """As a row of the ``alerts`` table; ``value`` is the latest evaluation's."""
        return {
            "fingerprint": self.fingerprint, "started_at": self.started_at, "rule": self.rule,
            "severity": self.severity, "state": self.state, "labels": self.labels,
            "summary": self.shown_summary, "playbook": self.playbook, "value": self.value,
            "fired_at": self.fired_at, "resolved_at": self.resolved_at,
            "evidence": orjson.dumps(self.evidence, default=str).decode(), "link": self.link,
            "version": self.version, "updated_at": updated_at,
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Alert:
        fired, _, current = str(row["summary"]).partition(NOW_SEPARATOR)
        return cls(
            fingerprint=row["fingerprint"], rule=row["rule"], severity=row["severity"],
            labels=dict(row["labels"]), playbook=row["playbook"], summary=fired,
            current_summary=current,
            value=float(row["value"]), state=row["state"],
            started_at=read_time(row["started_at"]), fired_at=read_time(row["fired_at"]),
            resolved_at=read_time(row["resolved_at"]),
            evidence=orjson.loads(row["evidence"] or "{}"), link=row["link"],
            version=int(row["version"]),
        )


REPLAY_EVIDENCE = "Replay the runs it names"
REPLAY_RUNS = 10


def named_run_ids(labels: dict[str, str], evidence: dict[str, Any]) -> list[str]:
    """The runs an alert names: its ``run_id`` label, then the ``run_id`` column of its
    evidence tables, in order and once each (at most ``REPLAY_RUNS``).

    >>> named_run_ids({"run_id": "r1"}, {"Top runs": {"columns": ["run_id", "cost"],
    ...                                              "rows": [["r2", 1.0], ["r1", 0.5]]}})
    ['r1', 'r2']
    """
    found = [labels["run_id"]] if labels.get("run_id") else []
    for table in evidence.values():
        columns = table.get("columns", []) if isinstance(table, dict) else []
        if "run_id" not in columns:
            continue
        position = columns.index("run_id")
        found.extend(str(row[position]) for row in table.get("rows", []) if row[position])
    return list(dict.fromkeys(found))[:REPLAY_RUNS]


def replay_evidence(link_base_url: str, run_ids: list[str]) -> dict[str, Any]:
    """Where to replay each named run, as an evidence table: the web view's replay
    (``<link_base_url>/#/replay/<run_id>``, when a base URL is set) and the command.

    >>> replay_evidence("http://lw:8765/", ["r 1"])["rows"]
    [['r 1', 'http://lw:8765/#/replay/r%201', "loopwatch replay 'r 1'"]]
    """
    base = link_base_url.rstrip("/")
    return {"columns": ["run_id", "replay", "command"],
            "rows": [[run_id, f"{base}/#/replay/{quote(run_id, safe='')}" if base else "",
                      f"loopwatch replay {shlex.quote(run_id)}"] for run_id in run_ids]}


@dataclass(frozen=True)
class Transition:
    """``updated``: a firing alert's current figure changed (a history row, no page)."""

    kind: Literal["pending", "fired", "resolved", "cancelled", "updated"]
    alert: Alert


class AlertBook:
    """The open (pending or firing) alerts, and the transitions each evaluation causes."""

    def __init__(self, open_alerts: Iterable[Alert] = (),
                 severity_for: Any = None) -> None:
        self.open: dict[str, Alert] = {alert.fingerprint: alert for alert in open_alerts}
        self._severity_for = severity_for

    def observe(self, rule: Rule, findings: list[Finding], now: datetime) -> list[Transition]:
        transitions: list[Transition] = []
        seen: set[str] = set()
        undecided: set[str] = set()
        for finding in findings:
            key = fingerprint(rule.name, finding.labels)
            if finding.state in ("too_few_samples", "waiting_for_history"):
                undecided.add(key)
                continue
            if not finding.active:
                continue
            seen.add(key)
            transitions.extend(self._active(rule, finding, key, now))
        for key, alert in list(self.open.items()):
            if alert.rule != rule.name or key in seen or key in undecided:
                continue
            del self.open[key]
            if alert.state == "firing":
                resolved = replace(alert, state="resolved", resolved_at=now,
                                   version=alert.version + 1)
                transitions.append(Transition("resolved", resolved))
            else:
                cancelled = replace(alert, state="resolved", resolved_at=now,
                                    version=alert.version + 1)
                transitions.append(Transition("cancelled", cancelled))
        return transitions

    def _active(self, rule: Rule, finding: Finding, key: str, now: datetime) -> list[Transition]:
        alert = self.open.get(key)
        effective = rule.for_labels(finding.labels)
        if alert is None:
            severity = self._severity_for(rule, finding.labels) if self._severity_for else None
            alert = Alert(key, rule.name, severity or rule.severity, finding.labels,
                          rule.playbook, finding.summary(), finding.value, "pending", now)
            self.open[key] = alert
            if effective.for_ > timedelta(0):  # a for-duration: wait in pending first
                return [Transition("pending", alert)]
        elif alert.state == "pending":
            alert = replace(alert, value=finding.value, summary=finding.summary())
            self.open[key] = alert
        else:
            current = finding.summary()
            shown = alert.shown_summary
            alert = replace(alert, value=finding.value,
                            current_summary="" if current == alert.summary else current)
            if alert.shown_summary == shown:
                self.open[key] = alert
                return []
            alert = replace(alert, version=alert.version + 1)
            self.open[key] = alert
            return [Transition("updated", alert)]
        if alert.state == "pending" and now - alert.started_at >= effective.for_:
            fired = replace(alert, state="firing", fired_at=now, version=alert.version + 1)
            self.open[key] = fired
            return [Transition("fired", fired)]
        return []
