"""The fold asks the store for the runs it does not hold many at a time, not one by one.

An OTLP exporter sends a trace's children before its root, often in another request, so
a run's first event at the processors is often no ``run.start``: each such run used to
cost one synchronous ClickHouse query on the fold's thread (~5-20 ms). The fold now reads
ahead (:data:`loopwatch.processors.pipeline.LOOKUP_WINDOW_EVENTS` events) and asks for all
of them in one call; what it folds is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from loopwatch.core.config import Settings
from loopwatch.ingest.events import EventBase, LlmCall, RunEnd, RunStart, ToolCall
from loopwatch.ingest.wire import encode_event, message_value
from loopwatch.processors import pipeline as pipeline_module
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.processors.runs import RunState, apply_event

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
SETTINGS = Settings(data_dir=Path("/nonexistent-run-lookup"))


def event(kind: type[EventBase], run_id: str, seconds: float, **fields: object) -> EventBase:
    return kind(run_id=run_id, agent="a", ts=T0 + timedelta(seconds=seconds), **fields)


def children_first(run_id: str) -> list[EventBase]:
    """A trace as an OTLP exporter sends it: its calls, then its root's start and end."""
    return [event(LlmCall, run_id, 1, model="m", input_tokens=10, output_tokens=2),
            event(ToolCall, run_id, 2, tool="t", args_hash="h"),
            event(RunStart, run_id, 0), event(RunEnd, run_id, 3, terminal_reason="model_done")]


def sdk_run(run_id: str) -> list[EventBase]:
    return [event(RunStart, run_id, 0), event(LlmCall, run_id, 1, model="m"),
            event(RunEnd, run_id, 2, terminal_reason="model_done")]


def envelopes(*runs: list[EventBase], per_message: int = 3) -> list[RawMessage]:
    lines = [encode_event(e) for run in runs for e in run]
    return [RawMessage("loopwatch.events", 0, offset, message_value(lines[i:i + per_message]))
            for offset, i in enumerate(range(0, len(lines), per_message))]


def the_stored_run() -> tuple[RunState, EventBase]:
    """A closed run the worker forgot: in the store, its call folded in already."""
    call = event(LlmCall, "stored", 1, model="m", input_tokens=5)
    state = RunState("stored", 0, agent="a")
    for stored in (event(RunStart, "stored", 0), call):
        apply_event(state, stored)
    return state, call


def test_one_lookup_for_every_run_of_the_window_that_the_fold_does_not_hold():
    otlp = [f"trace-{n:02d}" for n in range(30)]
    state, call = the_stored_run()
    asked: list[list[str]] = []

    def lookup_runs(run_ids: Sequence[str]) -> dict[str, RunState]:
        asked.append(list(run_ids))
        return {"stored": state} if "stored" in run_ids else {}

    def one_by_one(run_id: str) -> RunState | None:
        raise AssertionError(f"looked up {run_id} alone")

    pipeline = Pipeline(SETTINGS, MemoryRunStore(), lookup_run=one_by_one,
                        lookup_runs=lookup_runs)
    runs = [*(children_first(run_id) for run_id in otlp), sdk_run("sdk-1"),
            [call, event(RunEnd, "stored", 4, terminal_reason="model_done")], sdk_run("sdk-2")]
    work = pipeline.process(envelopes(*runs))

    assert asked == [[*otlp, "stored"]]
    assert pipeline.counters.duplicates == 1  # the stored run's call, folded already
    rows = {row["run_id"]: row for row in work.rows.tables["runs"]}
    assert sorted(rows) == sorted([*otlp, "sdk-1", "sdk-2", "stored"])
    assert (rows["stored"]["llm_calls"], rows["stored"]["outcome"]) == (1, "success")
    assert all(rows[run_id]["llm_calls"] == rows[run_id]["tool_calls"] == 1 for run_id in otlp)


def test_runs_the_fold_holds_already_are_not_looked_up_again():
    asked: list[list[str]] = []
    pipeline = Pipeline(SETTINGS, MemoryRunStore(),
                        lookup_runs=lambda ids: asked.append(list(ids)) or {})
    first, later = children_first("held")[:2], children_first("held")[2:]
    pipeline.process(envelopes(first))
    pipeline.process(envelopes(later, children_first("new")))
    assert asked == [["held"], ["new"]]


def test_each_window_asks_once(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(pipeline_module, "LOOKUP_WINDOW_EVENTS", 8)
    asked: list[list[str]] = []
    pipeline = Pipeline(SETTINGS, MemoryRunStore(),
                        lookup_runs=lambda ids: asked.append(list(ids)) or {})
    pipeline.process(envelopes(*(children_first(f"t{n}") for n in range(5)), per_message=4))
    # 4 events a message; a window closes once it holds 8 or more: two traces each
    assert asked == [["t0", "t1"], ["t2", "t3"], ["t4"]]


def test_a_failed_lookup_falls_back_to_one_run_at_a_time_and_folds_the_same():
    state, call = the_stored_run()
    runs = [children_first("a"), [call, event(RunEnd, "stored", 4, terminal_reason="model_done")]]

    def broken(run_ids: Sequence[str]) -> dict[str, RunState]:
        raise ConnectionError("store unreachable")

    one_by_one: list[str] = []

    def lookup_run(run_id: str) -> RunState | None:
        one_by_one.append(run_id)
        return state if run_id == "stored" else None

    pipeline = Pipeline(SETTINGS, MemoryRunStore(), lookup_run=lookup_run, lookup_runs=broken)
    work = pipeline.process(envelopes(*runs))
    assert one_by_one == ["a", "stored"]
    assert pipeline.counters.duplicates == 1
    assert {row["run_id"]: row["llm_calls"] for row in work.rows.tables["runs"]} == {
        "a": 1, "stored": 1}
