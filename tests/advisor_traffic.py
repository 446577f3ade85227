"""Scenario traffic for the advisor tests: one agent of the scenario fleet, renamed so
tests sharing the session's stack cannot see each other's events."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta

from loopwatch.ingest.events import EventBase
from loopwatch.ingest.sdk import Emitter
from loopwatch.scenarios import FLEET, load_scenarios
from loopwatch.scenarios.traffic import Behaviour, Injection, Traffic
from tests.conftest import scalar, wait_for, wait_stored


def scenario_events(agent: str, behaviour: Behaviour, start: datetime, hours: float,
                    seed: int = 7) -> list[EventBase]:
    """``hours`` of the scenario fleet's target agent, behaving as ``behaviour``."""
    target = replace(FLEET[0], name=agent)
    traffic = Traffic((target,), seed)
    end = start + timedelta(hours=hours)
    # times to the millisecond, as the store keeps them: a test's window edge then cuts
    # the emitted events exactly where the advisors' SQL cuts the stored rows
    return [event.model_copy(update={"ts": event.ts.replace(
                microsecond=event.ts.microsecond // 1000 * 1000)})
            for event in traffic.events(start, end, Injection(agent, start, behaviour))]


def behaviour_of(scenario: str) -> Behaviour:
    return load_scenarios()[scenario].behaviour


def emit_all(emitter: Emitter, reader, agent: str, events: list[EventBase]) -> None:
    for event in events:
        emitter.emit(event)
    emitter.flush(120)
    wait_stored(reader, agent, len(events), timeout_s=300)
    # a batch's raw events are written before its call rows: wait for those too
    for table, kind in (("llm_calls", "llm.call"), ("tool_calls", "tool.call")):
        expected = sum(1 for event in events if event.event_type == kind)
        wait_for(lambda table=table, expected=expected: scalar(
            reader, f"SELECT count() FROM {table} FINAL WHERE agent = {{a:String}}",
            a=agent) >= expected, 120, what=f"{expected} {table} rows of {agent}")
    runs = len({event.run_id for event in events})
    wait_for(lambda: scalar(reader, "SELECT count() FROM runs FINAL WHERE agent = {a:String}",
                            a=agent) >= runs, 120, what=f"{runs} runs of {agent}")
