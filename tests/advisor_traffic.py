"""Scenario traffic for the advisor tests: one agent of the scenario fleet, renamed so
tests sharing the session's stack cannot see each other's events."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta

from loopwatch.ingest.events import EventBase
from loopwatch.ingest.sdk import Emitter
from loopwatch.scenarios import FLEET, load_scenarios
from loopwatch.scenarios.traffic import Behaviour, Injection, Traffic
from tests.conftest import wait_stored


def scenario_events(agent: str, behaviour: Behaviour, start: datetime, hours: float,
                    seed: int = 7) -> list[EventBase]:
    """``hours`` of the scenario fleet's target agent, behaving as ``behaviour``."""
    target = replace(FLEET[0], name=agent)
    traffic = Traffic((target,), seed)
    end = start + timedelta(hours=hours)
    return list(traffic.events(start, end, Injection(agent, start, behaviour)))


def behaviour_of(scenario: str) -> Behaviour:
    return load_scenarios()[scenario].behaviour


def emit_all(emitter: Emitter, reader, agent: str, events: list[EventBase]) -> None:
    for event in events:
        emitter.emit(event)
    emitter.flush(120)
    wait_stored(reader, agent, len(events), timeout_s=300)
