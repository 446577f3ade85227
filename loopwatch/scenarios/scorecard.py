"""The detection scorecard: recall, false alerts and time to detect, on event time.

Everything runs in simulated time through the pipeline core (decode, run assembly,
outcomes, rows) into a real ClickHouse store, and the detector engine is stepped minute
by minute on event time, reading the same store. First N days of clean history are
loaded (so the 7-day and time-of-day baselines exist), then a clean baseline is watched
for false alerts, then each scenario gets its own segment: clean traffic, the injection,
observation, and recovery so its alerts resolve before the next one.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import chain
from typing import Any

from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
from loopwatch.detectors.alerts import Transition
from loopwatch.detectors.engine import DetectorEngine
from loopwatch.detectors.rules import load_rules
from loopwatch.ingest.events import EventBase
from loopwatch.ingest.wire import encode_envelope
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.scenarios import FLEET, Scenario, load_scenarios
from loopwatch.scenarios.traffic import Injection, Traffic
from loopwatch.store.clickhouse import run_query
from loopwatch.store.sink import ClickHouseSink, RowBatch

Progress = Callable[[str], None]

#: the most simulated time stored in one feed where no rule pass looks in between
UNOBSERVED_FEED = timedelta(hours=1)


@dataclass
class ScenarioResult:
    expected: list[str]
    fired: list[str]
    detected: bool
    time_to_detect_s: float | None
    collateral: list[str] = field(default_factory=list)
    #: the advisor finding the scenario names, and the kinds of finding it showed
    advisor: str = ""
    advice: list[str] = field(default_factory=list)

    @property
    def advised(self) -> bool | None:
        """Whether the scenario's advisor found it (None: it names none)."""
        return self.advisor in self.advice if self.advisor else None


@dataclass
class Scorecard:
    scenarios: dict[str, ScenarioResult]
    baseline_hours: float
    false_alerts: dict[str, int]
    false_alert_rules: list[str]
    #: advisor findings on the clean baseline, as kind:agent:subject (none expected)
    false_findings: list[str] = field(default_factory=list)

    @property
    def recall(self) -> float:
        """Of the scenarios an alert rule must catch (advisor-only ones name none)."""
        paged = [r for r in self.scenarios.values() if r.expected]
        if not paged:
            return 0.0
        return sum(r.detected for r in paged) / len(paged)

    def as_json(self) -> dict[str, Any]:
        times = [r.time_to_detect_s for r in self.scenarios.values()
                 if r.time_to_detect_s is not None]
        return {
            "scenarios": {name: {"detected": r.detected, "expected": r.expected,
                                 "fired": r.fired, "time_to_detect_s": r.time_to_detect_s,
                                 "advisor": r.advisor, "advice": r.advice,
                                 "advised": r.advised}
                          for name, r in self.scenarios.items()},
            "baseline": {"simulated_hours": self.baseline_hours,
                         "false_alerts": self.false_alerts,
                         "false_alert_rules": self.false_alert_rules,
                         "false_findings": self.false_findings},
            "recall": self.recall,
            "median_time_to_detect_s": statistics.median(times) if times else None,
        }


class Simulation:
    """A store fed in simulated time, and a detector engine stepped along with it."""

    def __init__(self, client: Client, settings: Settings, seed: int,
                 progress: Progress | None = None) -> None:
        self.client = client
        self.traffic = Traffic(FLEET, seed)
        self.clock = 0.0
        self.pipeline = Pipeline(settings, MemoryRunStore(), clock=lambda: self.clock)
        self.sink = ClickHouseSink(client)
        self.offset = 0
        self.progress = progress or (lambda message: None)
        rules = {name: rule for name, rule in load_rules().items() if rule.clock == "event"}
        self.engine = DetectorEngine(
            lambda sql, parameters: run_query(client, sql, parameters, readonly=True),
            self._write, rules=rules, playbook_steps=lambda name: [])

    def _write(self, table: str, rows: list[dict[str, Any]]) -> None:
        self.sink.write_batch(RowBatch({table: rows}))

    def feed(self, events: Iterable[EventBase], until: datetime) -> int:
        ordered = sorted(events, key=lambda event: event.ts)
        messages = []
        for start in range(0, len(ordered), 1000):
            self.offset += 1
            messages.append(RawMessage("simulated", 0, self.offset,
                                       encode_envelope(ordered[start:start + 1000])))
        self.clock = until.timestamp()
        if messages:
            self.sink.write_batch(self.pipeline.process(messages).rows)
        self.sink.write_batch(self.pipeline.sweep().rows)
        return len(ordered)

    def advance(self, start: datetime, end: datetime, step: timedelta,
                injection: Injection | None = None, observe: bool = True,
                pass_every: timedelta | None = None) -> list[Transition]:
        """Generate traffic from ``start`` to ``end`` a ``step`` at a time (it is seeded
        per step), store it, and run a rule pass every ``pass_every`` (default: every
        step) of simulated time.

        Each insert goes through the store's views at a fixed cost of tens of ms, and a
        rule pass costs ~0.3 s of CPU, so steps are stored together until a pass needs
        them: unobserved, in feeds of up to :data:`UNOBSERVED_FEED`; observed, one feed
        per pass. The traffic is the same however it is grouped."""
        every = (pass_every or step) if observe else UNOBSERVED_FEED
        transitions: list[Transition] = []
        moment = start
        pending: list[Iterable[EventBase]] = []
        pending_from = start
        while moment < end:
            until = min(end, moment + step)
            pending.append(self.traffic.events(moment, until, injection))
            if until - pending_from >= every or until >= end:
                self.feed(chain.from_iterable(pending), until)
                pending, pending_from = [], until
                if observe:
                    transitions.extend(self.engine.evaluate(event_now=until, wall_now=until))
            moment = until
        return transitions


def _first_fired(transitions: list[Transition], agent: str) -> dict[str, datetime]:
    fired: dict[str, datetime] = {}
    for transition in transitions:
        alert = transition.alert
        if transition.kind != "fired" or alert.labels.get("agent", agent) != agent:
            continue
        when = alert.fired_at or alert.started_at
        if alert.rule not in fired or when < fired[alert.rule]:
            fired[alert.rule] = when
    return fired


def score(client: Client, settings: Settings, *, seed: int = 7, history_days: float = 7,
          baseline_hours: float = 24, scenario_names: Iterable[str] | None = None,
          start: datetime | None = None, progress: Progress | None = None,
          observe_minutes: float = 75, rules: bool = True,
          quiet_passes: timedelta | None = None) -> Scorecard:
    """Run the whole scorecard against the store behind ``client`` (it gains the data).

    ``quiet_passes`` spaces the rule passes of the stretches no figure is read from: the
    clean 20 minutes before each injection (a pass a minute by default) and the 45
    minutes of recovery after it (every 5). Their traffic is made the same way whatever
    the spacing, every anomaly detector still learns each point, and what those passes
    find is never counted, so wider passes only save time: the fast test tier's reduced
    scorecard (8 observed minutes), with 45 minutes, runs 42 passes instead of 123 and
    gets the same card.

    ``rules=False`` scores the advisors' column alone: the same traffic, stored the same
    way, but no rule passes (four fifths of the time; advisors read no alerts), so every
    scenario's ``fired`` is empty."""
    say = progress or (lambda message: None)
    scenarios = load_scenarios()
    names = list(scenarios) if scenario_names is None else list(scenario_names)
    chosen = [scenarios[name] for name in names]
    simulation = Simulation(client, settings, seed, say)
    moment = start or datetime(2026, 1, 5, tzinfo=UTC)
    say(f"loading {history_days:g} days of clean history")
    history_end = moment + timedelta(days=history_days)
    simulation.advance(moment, history_end, timedelta(hours=1), observe=False)
    say(f"watching {baseline_hours:g} clean hours for false alerts")
    baseline_end = history_end + timedelta(hours=baseline_hours)
    baseline = simulation.advance(history_end, baseline_end, timedelta(minutes=5),
                                  observe=rules)
    false_fired = [t.alert for t in baseline if t.kind == "fired"]
    false_findings = [":".join(f.identity) for f in _advice(client, history_end, baseline_end)]
    results: dict[str, ScenarioResult] = {}
    moment = baseline_end
    for scenario in chosen:
        say(f"scenario {scenario.name}")
        results[scenario.name], moment = _run_scenario(simulation, scenario, moment,
                                                       timedelta(minutes=observe_minutes),
                                                       rules, quiet_passes)
    return Scorecard(
        scenarios=results, baseline_hours=baseline_hours,
        false_alerts={severity: sum(alert.severity == severity for alert in false_fired)
                      for severity in ("critical", "warning", "info")},
        false_alert_rules=sorted({alert.rule for alert in false_fired}),
        false_findings=false_findings,
    )


def _advice(client: Client, since: datetime, until: datetime, agent: str = "") -> list[Any]:
    """The advisors' findings over a stretch of simulated time (detectors/advisors)."""
    from loopwatch.core.config import AdvisorSettings
    from loopwatch.detectors.advisors.alerting import QueryReader
    from loopwatch.detectors.advisors.base import Scope
    from loopwatch.detectors.advisors.run import advise

    reader = QueryReader(lambda sql, parameters: run_query(client, sql, parameters,
                                                           readonly=True))
    return advise(reader, Scope(since, until, agent), AdvisorSettings())


def _run_scenario(simulation: Simulation, scenario: Scenario, start: datetime,
                  observe: timedelta, rules: bool = True,
                  quiet_passes: timedelta | None = None) -> tuple[ScenarioResult, datetime]:
    inject_at = start + timedelta(minutes=20)
    observe_until = inject_at + observe
    simulation.advance(start, inject_at, timedelta(minutes=1), observe=rules,
                       pass_every=quiet_passes)
    injection = Injection(scenario.agent, inject_at, scenario.behaviour)
    transitions = simulation.advance(inject_at, observe_until, timedelta(minutes=1), injection,
                                     observe=rules)
    recovered = observe_until + timedelta(minutes=45)
    simulation.advance(observe_until, recovered, timedelta(minutes=5), observe=rules,
                       pass_every=quiet_passes)
    fired = _first_fired(transitions, scenario.agent)
    advice = sorted({f.kind for f in _advice(simulation.client, inject_at, observe_until,
                                             scenario.agent)})
    caught = [rule for rule in scenario.expected if rule in fired]
    detected = bool(caught) if scenario.expected else scenario.advisor in advice
    time_to_detect = (min((fired[rule] - inject_at).total_seconds() for rule in caught)
                      if caught else None)
    result = ScenarioResult(
        expected=list(scenario.expected), fired=sorted(fired), detected=detected,
        time_to_detect_s=time_to_detect,
        collateral=sorted(set(fired) - set(scenario.expected)),
        advisor=scenario.advisor, advice=advice)
    return result, recovered
