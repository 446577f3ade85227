"""The detector loop: evaluate every rule on event time, move alerts through their
lifecycle, attach the playbook's evidence, record history, and hand notifications to
the outbox.

It needs three things from outside: a way to query (read-only), a way to write rows
(the ``alerts`` and ``rule_evaluations`` tables), and an outbox. Inside ``loopwatch up``
those are the store owner's own clients; against a ClickHouse server (``loopwatch
detect``) they are direct connections.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from loopwatch.detectors.alerts import (
    REPLAY_EVIDENCE,
    Alert,
    AlertBook,
    Transition,
    named_run_ids,
    replay_evidence,
)
from loopwatch.detectors.batch import RuleQueries
from loopwatch.detectors.outbox import Outbox
from loopwatch.detectors.rules import (
    EXCLUDED_SLICES,
    Finding,
    Rule,
    SeriesState,
    evaluate,
    load_rules,
)
from loopwatch.ingest.events import TEST_TRAFFIC_SLICES
from loopwatch.store.clickhouse import QueryResult, read_time

log = logging.getLogger(__name__)

Query = Callable[[str, dict[str, Any]], QueryResult]
Write = Callable[[str, list[dict[str, Any]]], None]
EVIDENCE_ROWS = 10
EVENT_NOW_SQL = """SELECT max(ts), count() FROM events
WHERE ts <= {limit:DateTime64(3, 'UTC')}"""
#: the open alerts a restarted engine takes over; the advisors' info alerts are theirs
#: (detectors/advisors/alerting.py): never re-sent
RESTORE_SQL = ("SELECT * FROM alerts FINAL WHERE state IN ('pending', 'firing') "
               "AND NOT startsWith(rule, 'advisor_')")
#: history rows kept in memory while the store refuses them (~1 KB each)
MAX_UNWRITTEN_ROWS = 50_000


@dataclass
class Policy:
    """Delivery policy for loopwatch's own notifiers (Alertmanager has its own)."""

    via_alertmanager: bool = False
    resend: timedelta = timedelta(minutes=1)
    renotify: timedelta = timedelta(hours=4)
    silences: list[dict[str, Any]] = field(default_factory=list)
    tool_criticality: dict[str, str] = field(default_factory=dict)
    daily_budget_usd: dict[str, float] = field(default_factory=dict)
    link_base_url: str = ""
    #: event times further ahead of the wall clock are not event time (as in the pipeline)
    max_clock_skew: timedelta = timedelta(minutes=5)
    #: traffic slices the rules leave out (``{excluded_slices}`` in their SQL)
    excluded_slices: tuple[str, ...] = TEST_TRAFFIC_SLICES

    def silenced(self, alert: Alert, now: datetime) -> bool:
        for silence in self.silences:
            until = silence.get("until")
            if until and datetime.fromisoformat(str(until)).astimezone(UTC) < now:
                continue
            match = dict(silence.get("match", {}))
            labels = {"alertname": alert.rule, "severity": alert.severity, **alert.labels}
            if all(labels.get(key) == value for key, value in match.items()):
                return True
        return False


class DetectorEngine:
    def __init__(self, query: Query, write: Write, outbox: Outbox | None = None,
                 rules: Mapping[str, Rule] | None = None, policy: Policy | None = None,
                 playbook_steps: Callable[[str], list[tuple[str, str]]] | None = None) -> None:
        self.query = query
        self.write = write
        self.outbox = outbox
        self.rules = dict(rules or load_rules())
        self.policy = policy or Policy()
        self.playbook_steps = playbook_steps or _playbook_steps
        self.book = AlertBook(self._restore(), severity_for=self._severity_for)
        self.last_findings: dict[str, list[Finding]] = {}
        self._series: dict[str, dict[tuple[str, ...], SeriesState]] = {}
        #: the rules queried alone (detectors/batch.py)
        self._alone: set[str] = set()
        self._last_sent: dict[str, datetime] = {}
        #: history rows the store refused, oldest first, written with a later pass
        self._unwritten: deque[tuple[str, list[dict[str, Any]]]] = deque()
        self.unwritten_dropped = 0

    def _restore(self) -> list[Alert]:
        try:
            result = self.query(RESTORE_SQL, {})
        except Exception:
            log.exception("could not restore open alerts")
            return []
        return [Alert.from_row(row) for row in result.records()]

    def _severity_for(self, rule: Rule, labels: dict[str, str]) -> str | None:
        if rule.severity_from_tool_criticality:
            return self.policy.tool_criticality.get(labels.get("tool", ""))
        return None

    def event_now(self) -> datetime | None:
        """Event time: the newest event stored (None before the first one), leaving out
        times more than ``max_clock_skew`` ahead of the wall clock: one agent with a
        clock years ahead would otherwise move every event-time window into an empty
        future, where no alert fires and firing ones resolve."""
        latest = self.query(EVENT_NOW_SQL, {
            "limit": datetime.now(UTC) + self.policy.max_clock_skew}).rows
        if not latest or not latest[0][1]:
            return None
        value = latest[0][0]
        return read_time(value)

    def evaluate(self, event_now: datetime | None = None,
                 wall_now: datetime | None = None) -> list[Transition]:
        """One pass over every rule; returns the transitions it caused."""
        wall_now = wall_now or datetime.now(UTC)
        event_now = event_now or self.event_now()
        transitions: list[Transition] = []
        evaluations: list[dict[str, Any]] = []
        work: list[tuple[Rule, dict[str, Any]]] = []
        for rule in self.rules.values():
            now = wall_now if rule.clock == "wall" else event_now
            if now is not None:
                work.append((rule, self._parameters(rule, now, wall_now)))
        answers = RuleQueries(self.query, self._alone).rows(work)
        for rule, parameters in work:
            now = parameters["now"]
            rows = answers[rule.name]
            try:
                if isinstance(rows, Exception):
                    raise rows
                findings = evaluate(rule, rows, self.policy.daily_budget_usd,
                                    self._series.setdefault(rule.name, {}))
            except Exception as exc:
                log.warning("rule %s failed: %s", rule.name, exc)
                continue
            self.last_findings[rule.name] = findings
            evaluations.extend(_evaluation_row(f, wall_now, now) for f in findings)
            for transition in self.book.observe(rule, findings, now):
                if transition.kind == "fired":
                    transition = Transition("fired", self._with_evidence(transition.alert, now))
                    self.book.open[transition.alert.fingerprint] = transition.alert
                transitions.append(transition)
        self._notify(transitions, wall_now)
        if evaluations:
            self._unwritten.append(("rule_evaluations", evaluations))
        if transitions:
            self._unwritten.append(("alerts", [t.alert.row(wall_now) for t in transitions]))
        self._write_history()
        return transitions

    def _write_history(self) -> None:
        """Write the history rows waiting, oldest first, until the store refuses one
        batch (it stays for the next pass). Notifying never waits on this: the outbox
        is durable on its own, and a page must not depend on the history's store.
        Beyond ``MAX_UNWRITTEN_ROWS`` waiting, the oldest evaluations are dropped first
        (counted in ``unwritten_dropped``): alert rows are what the history is for."""
        while self._unwritten:
            table, rows = self._unwritten[0]
            try:
                self.write(table, rows)
            except Exception as exc:
                log.warning("could not write %d %s rows (%s); %d batches wait for the "
                            "next pass", len(rows), table, exc, len(self._unwritten))
                break
            self._unwritten.popleft()
        while sum(len(rows) for _, rows in self._unwritten) > MAX_UNWRITTEN_ROWS:
            oldest = next((batch for batch in self._unwritten
                           if batch[0] == "rule_evaluations"), self._unwritten[0])
            self._unwritten.remove(oldest)
            self.unwritten_dropped += len(oldest[1])

    def _parameters(self, rule: Rule, now: datetime, wall_now: datetime) -> dict[str, Any]:
        """The query parameters of ``rule`` evaluated at ``now`` (rules.toml's header)."""
        return {"now": now, "start": now - rule.window,
                "baseline_start": now - max(rule.baseline, rule.window),
                "wall_now": wall_now, EXCLUDED_SLICES: list(self.policy.excluded_slices)}

    def _with_evidence(self, alert: Alert, now: datetime) -> Alert:
        """Run the playbook's investigation queries for this alert's labels."""
        rule = self.rules[alert.rule]
        parameters = {"agent": alert.labels.get("agent", ""), "tool": alert.labels.get("tool", ""),
                      "run_id": alert.labels.get("run_id", ""),
                      "since": alert.started_at - rule.window - timedelta(hours=1), "until": now}
        evidence: dict[str, Any] = {}
        try:
            steps = self.playbook_steps(alert.playbook)
        except Exception as exc:
            log.warning("playbook %s unavailable: %s", alert.playbook, exc)
            steps = []
        for title, sql in steps:
            try:
                result = self.query(sql, parameters)
            except Exception as exc:
                evidence[title] = {"error": str(exc).splitlines()[0][:300]}
                continue
            evidence[title] = {"columns": result.columns, "rows": result.rows[:EVIDENCE_ROWS]}
        run_ids = named_run_ids(alert.labels, evidence)
        if run_ids:
            evidence[REPLAY_EVIDENCE] = replay_evidence(self.policy.link_base_url, run_ids)
        link = ""
        if self.policy.link_base_url and alert.labels.get("run_id"):
            link = f"{self.policy.link_base_url.rstrip('/')}/runs/{alert.labels['run_id']}"
        return replace(alert, evidence=evidence, link=link)

    def _notify(self, transitions: list[Transition], now: datetime) -> None:
        if self.outbox is None:
            return
        due: list[tuple[str, Alert]] = []
        for transition in transitions:
            if transition.kind in ("fired", "resolved"):
                due.append(("resolved" if transition.kind == "resolved" else "firing",
                            transition.alert))
        fired_now = {alert.fingerprint for _, alert in due}
        interval = self.policy.resend if self.policy.via_alertmanager else self.policy.renotify
        for alert in self.book.open.values():
            last = self._last_sent.get(alert.fingerprint)
            if (alert.state == "firing" and alert.fingerprint not in fired_now
                    and last is not None and now - last >= interval):
                due.append(("firing", alert))
        groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for status, alert in due:
            if alert.severity == "info" and not self.policy.via_alertmanager:
                continue  # info: recorded in the history, nobody is notified
            if not self.policy.via_alertmanager and self.policy.silenced(alert, now):
                continue
            self._last_sent[alert.fingerprint] = now
            if status == "resolved":
                self._last_sent.pop(alert.fingerprint, None)
            groups[(alert.rule, alert.severity)].append(
                {"status": status, "alert": _wire(alert)})
        for batch in groups.values():
            self.outbox.put(batch)
        self.outbox.flush()

    def run(self, stop: threading.Event, interval_s: float, delay_s: float = 0.0) -> None:
        """Evaluate every ``interval_s`` until ``stop`` is set, the first pass after
        ``delay_s``; retry the outbox meanwhile."""
        if delay_s and stop.wait(delay_s):
            return
        while not stop.is_set():
            try:
                self.evaluate()
            except Exception:
                log.exception("detector pass failed")
            try:
                if self.outbox is not None:
                    self.outbox.flush()
            except Exception:  # the thread must outlive any one notifier's failure
                log.exception("notification delivery failed")
            stop.wait(interval_s)


def _wire(alert: Alert) -> dict[str, Any]:
    row = alert.row(datetime.now(UTC))
    row["evidence"] = alert.evidence
    for key in ("started_at", "fired_at", "resolved_at", "updated_at"):
        if row[key] is not None:
            row[key] = row[key].isoformat()
    return row


def _evaluation_row(finding: Finding, wall_now: datetime, now: datetime) -> dict[str, Any]:
    return {"rule": finding.rule.name, "labels": finding.labels, "state": finding.state,
            "value": finding.value, "samples": finding.samples, "detail": finding.detail,
            "evaluated_at": wall_now, "event_time": now}


def _playbook_steps(name: str) -> list[tuple[str, str]]:
    """(title, sql) of the playbook's investigation steps that stored data answers."""
    from loopwatch.detectors.playbooks import load_playbooks

    playbook = load_playbooks().get(name)
    if playbook is None:
        return []
    return [(step.title, step.sql) for step in playbook.steps if step.sql]
