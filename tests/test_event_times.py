"""Every event time the contract accepts (1900-01-01 .. 2299-12-31, DateTime64(3)'s range)
is stored and read back exactly through every table it reaches, and is still there after
``OPTIMIZE TABLE ... FINAL`` applies the TTLs; what it refuses is a dead letter naming
the reason (issue 24 §4: 2250 wrapped to 1978 in the TTL's ``toDateTime`` and vanished,
1970 expired at once).

Real chdb (the session's in-process store, a database per test), the real pipeline
(:class:`loopwatch.processors.pipeline.Pipeline`, both decoders) and the real sink; Kafka adds
nothing to what a time becomes, so messages are handed to the pipeline directly.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest
from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
from loopwatch.ingest.events import TS_MAX, TS_MIN, TS_RANGE
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.store.sink import ClickHouseSink
from tests.conftest import wait_for
from tests.stores import fresh_store

#: (sent, as ClickHouse prints it back, its minute)
ACCEPTED = [
    ("1900-01-01T00:00:00.000Z", "1900-01-01 00:00:00.000", "1900-01-01 00:00:00.000"),
    ("1969-12-31T23:59:59.999Z", "1969-12-31 23:59:59.999", "1969-12-31 23:59:00.000"),
    ("1970-01-01T00:00:00.000Z", "1970-01-01 00:00:00.000", "1970-01-01 00:00:00.000"),
    ("2106-02-07T06:28:16Z", "2106-02-07 06:28:16.000", "2106-02-07 06:28:00.000"),
    ("2250-06-01T00:00:00Z", "2250-06-01 00:00:00.000", "2250-06-01 00:00:00.000"),
    ("2299-12-31T23:59:59.999Z", "2299-12-31 23:59:59.999", "2299-12-31 23:59:00.000"),
]
REFUSED = [("1899-12-31T23:59:59.999Z", "1899-12-31T23:59:59.999000+00:00"),
           ("2300-01-01T00:00:00Z", "2300-01-01T00:00:00+00:00")]
KINDS = ("run.start", "llm.call", "tool.call", "run.end", "label", "annotation")
#: the per-event tables and their event-time column
EVENT_TABLES = ("events", "llm_calls", "tool_calls", "labels", "annotations")
ALL_TABLES = (*EVENT_TABLES, "runs", "dead_letters")


def _events(run_id: str, ts: str, extra: bool) -> list[dict[str, Any]]:
    common: dict[str, Any] = {"run_id": run_id, "agent": "times", "ts": ts}
    if extra:  # an unknown field: the message takes pydantic's route, not the mirror's
        common["probe_extra"] = [1]
    fields: dict[str, dict[str, Any]] = {
        "run.start": {}, "llm.call": {"model": "m", "input_tokens": 3, "output_tokens": 2},
        "tool.call": {"tool": "t", "latency_ms": 5.0},
        "run.end": {"terminal_reason": "model_done"}, "label": {"verdict": "correct"},
        "annotation": {"kind": "deploy", "message": run_id}}
    return [dict(common, event_type=kind, **fields[kind]) for kind in KINDS]


def _store(local_store: tuple[Settings, Client]) -> tuple[Settings, Client]:
    return fresh_store(local_store, "times")


def _write(settings: Settings, client: Client, values: list[str], extra: bool
           ) -> dict[str, str]:
    """One message per time, through the pipeline into the store; run_id -> time."""
    pipeline = Pipeline(settings, MemoryRunStore())
    sink = ClickHouseSink(client)
    runs = {}
    for offset, ts in enumerate(values):
        run_id = f"t{offset}"
        runs[run_id] = ts
        value = orjson.dumps({"envelope_version": 1, "events": _events(run_id, ts, extra)})
        sink.write_batch(pipeline.process([RawMessage("loopwatch.events", 0, offset,
                                                      value)]).rows)
    return runs


def _read(client: Client) -> dict[str, list[tuple[Any, ...]]]:
    """Each table's (run, time as text, time as the client reads it), sorted."""
    def rows(sql: str) -> list[tuple[Any, ...]]:
        return sorted(tuple(row) for row in client.query(sql).result_rows)
    found = {table: rows(f"SELECT run_id, toString(ts), ts FROM {table} FINAL")
             for table in ("events", "llm_calls", "tool_calls", "labels")}
    found["annotations"] = rows("SELECT message, toString(ts), ts FROM annotations FINAL")
    found["runs"] = rows("SELECT run_id, toString(started_ts), toString(last_event_ts), "
                         "toString(closed_ts), outcome FROM runs FINAL")
    found["outcomes_1m"] = rows("SELECT toString(minute), runs FROM outcomes_1m")
    found["tool_metrics_1m"] = rows("SELECT toString(minute), calls FROM tool_metrics_1m")
    found["cache_metrics_1m"] = rows("SELECT toString(minute), calls FROM cache_metrics_1m")
    found["dead_letters"] = rows("SELECT reason FROM dead_letters FINAL")
    return found


def _optimize(client: Client) -> None:
    for table in ALL_TABLES:
        client.command(f"OPTIMIZE TABLE {table} FINAL")


def _expected_moment(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=None)


@pytest.mark.parametrize("extra", [False, True], ids=["mirror", "pydantic"])
def test_every_accepted_time_is_stored_exactly_in_every_table_and_kept(local_store, extra):
    settings, client = _store(local_store)
    runs = _write(settings, client, [sent for sent, _, _ in ACCEPTED], extra)
    printed = {run_id: next(p for s, p, _ in ACCEPTED if s == sent)
               for run_id, sent in runs.items()}
    minutes = sorted((minute, 1) for _, _, minute in ACCEPTED)
    expected: dict[str, list[tuple[Any, ...]]] = {
        table: sorted((run_id, text, _expected_moment(text)) for run_id, text
                      in printed.items() for _ in range(6 if table == "events" else 1))
        for table in EVENT_TABLES}
    expected["runs"] = sorted((run_id, text, text, text, "success")
                              for run_id, text in printed.items())
    expected.update({view: minutes for view in
                     ("outcomes_1m", "tool_metrics_1m", "cache_metrics_1m")})
    expected["dead_letters"] = []
    assert _read(client) == expected
    _optimize(client)
    assert _read(client) == expected, "a TTL merge dropped rows"


def test_the_contract_bounds_are_datetime64s_range_and_one_definition():
    """The bounds the refusal names are the ones it checks."""
    bounds = (datetime(1900, 1, 1, tzinfo=UTC),
              datetime(2299, 12, 31, 23, 59, 59, 999000, tzinfo=UTC))
    assert bounds == (TS_MIN, TS_MAX)
    assert TS_RANGE == "1900-01-01T00:00:00.000+00:00 .. 2299-12-31T23:59:59.999+00:00"


@pytest.mark.parametrize("extra", [False, True], ids=["mirror", "pydantic"])
def test_a_time_outside_the_contract_is_a_dead_letter_naming_why(local_store, extra):
    settings, client = _store(local_store)
    _write(settings, client, [sent for sent, _ in REFUSED], extra)
    reasons = sorted(f"schema violation: {kind}.ts: Value error, ts {shown} is outside "
                     f"{TS_RANGE}" for _, shown in REFUSED for kind in KINDS)
    found = _read(client)
    assert [reason for (reason,) in found.pop("dead_letters")] == reasons
    assert found == {name: [] for name in found}, "a refused time reached a table"
    _optimize(client)
    assert len(_read(client)["dead_letters"]) == len(reasons)


def test_retention_counts_from_ingestion_so_old_history_is_kept(local_store):
    """An event from 400 days ago, stored now, is kept for its table's retention (30 and
    180 days); a row stored 31 days ago (ingested_at) is dropped by the TTL merge."""
    settings, client = _store(local_store)
    old = (datetime.now(UTC) - timedelta(days=400)).isoformat()
    _write(settings, client, [old], extra=False)
    client.insert("events", [[uuid.uuid4(), "step", "stale", "times", datetime.now(UTC),
                              "{}", datetime.now(UTC) - timedelta(days=31)]],
                  column_names=["event_id", "event_type", "run_id", "agent", "ts",
                                "payload", "ingested_at"])
    _optimize(client)
    counts = {table: client.query(f"SELECT count() FROM {table} FINAL").result_rows[0][0]
              for table in ALL_TABLES}
    assert counts == {"events": 6, "llm_calls": 1, "tool_calls": 1, "labels": 1,
                      "annotations": 1, "runs": 1, "dead_letters": 0}


def test_the_edge_times_through_the_broker_and_loopwatch_up(emitter, reader, agent):
    """The same times end to end: the SDK's raw path (which leaves validation to the
    pipeline) to the real broker, the session's ``loopwatch up``, its store, and back
    through the store service's JSON; refused ones are dead letters with their reason."""
    lines = []
    for index, (sent, _, _) in enumerate(ACCEPTED):
        run_id = f"{agent}-ok{index}"
        lines.extend(orjson.dumps(dict(event, agent=agent))
                     for event in _events(run_id, sent, extra=False))
    for index, (sent, _) in enumerate(REFUSED):
        lines.append(orjson.dumps(dict(_events(f"{agent}-no{index}", sent, False)[0],
                                       agent=agent)))
    emitter.emit_raw(lines)
    assert emitter.flush(60)
    accepted = len(ACCEPTED) * len(KINDS)

    def stored() -> int:
        return int(reader.query("SELECT count() FROM events FINAL WHERE agent = {a:String}",
                                {"a": agent}).scalar())

    def letters() -> list[str]:
        return [row["reason"] for row in reader.query(
            "SELECT reason FROM dead_letters FINAL WHERE position(payload, {a:String}) > 0 "
            "ORDER BY reason", {"a": agent}).records()]

    wait_for(lambda: stored() == accepted and len(letters()) == len(REFUSED), 120,
             what=f"{accepted} events and {len(REFUSED)} dead letters of {agent}")
    printed = sorted(text for _, text, _ in ACCEPTED)
    for table in ("events", "llm_calls", "tool_calls", "labels"):
        rows = reader.query(f"SELECT toString(ts) AS t FROM {table} FINAL WHERE agent = "
                            "{a:String} ORDER BY t", {"a": agent}).records()
        times = [row["t"] for row in rows]
        assert times == (sorted(printed * len(KINDS)) if table == "events" else printed), table
    wait_for(lambda: reader.query(
        "SELECT count() FROM runs FINAL WHERE agent = {a:String} AND outcome = 'success'",
        {"a": agent}).scalar() == len(ACCEPTED), 60, what="every run closed")
    runs = reader.query("SELECT toString(started_ts) AS s, toString(last_event_ts) AS l "
                        "FROM runs FINAL WHERE agent = {a:String} ORDER BY s",
                        {"a": agent}).records()
    assert [(row["s"], row["l"]) for row in runs] == [(text, text) for text in printed]
    assert letters() == sorted(
        f"schema violation: run.start.ts: Value error, ts {shown} is outside {TS_RANGE}"
        for _, shown in REFUSED)
