"""Both decoders' events are stored alike by ``events_in``'s view (migration 006).

A message the msgspec mirror decodes carries the JSON msgspec re-encoded; one pydantic
validated carries :func:`loopwatch.processors.rows.validated_events_json`. Here the same events
take each route into the real chdb store and the stored rows are compared column by
column, and against the models (``payload`` as JSON: ClickHouse writes a float that
has no fraction as ``0`` where orjson writes ``0.0``).
"""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from loopwatch.bench.pipeline import RENAMED_BY_CHDB, generate_events
from loopwatch.core.config import Settings
from loopwatch.ingest.events import EventBase, LlmCall, RunStart, Step, ToolCall
from loopwatch.ingest.wire import _decode_slow, decode_message, encode_envelope
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.processors.rows import (
    EVENT_COLUMNS,
    EVENTS_IN_TABLE,
    events_in_row,
    validated_events_json,
)
from loopwatch.store.sink import ClickHouseSink, RowBatch
from tests.stores import fresh_store

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
PARTITION, OFFSET = 3, 41


def _awkward_events(run_id: str) -> list[EventBase]:
    """Values a JSON round trip through two encoders could disagree on."""
    common: dict[str, Any] = {"run_id": run_id, "agent": 'agënt "q" \\ / \n\t☃ 🚀'}
    return [
        RunStart(**common, ts=T0, step_cap=7, trace_id="t" * 32, span_id="s1",
                 parent_span_id="p0", deployment="d/1", worker_id="w-ü"),
        Step(**common, ts=T0, step=0, duration_ms=0.1, action_type="</script>\u2028",
             cost_usd=1e-7),
        LlmCall(**common, ts=T0, step=1, input_tokens=10**12, output_tokens=0,
                cost_usd=1e21, provider="ø", response_model=""),
        ToolCall(**common, ts=T0 + timedelta(seconds=1), tool="search\u0000x",
                 latency_ms=123456789.123, timeout_ms=8000.0, timed_out=True,
                 late_completion_ms=9000.5, http_status=504, error_type="Timeout"),
    ]


def _envelope(events: list[EventBase]) -> bytes:
    """The events as an SDK sends them, two with times as other clients write them: an
    offset (the step, 14:30+05:30 = 09:00 UTC) and no zone at all (UTC), microseconds."""
    dumped = orjson.loads(encode_envelope(events))
    dumped["events"][1]["ts"] = "2026-11-30T14:30:00.250+05:30"
    dumped["events"][2]["ts"] = "2026-11-30T09:00:00.123456"
    return orjson.dumps(dumped)


def _stored(client: Any, run_ids: list[str]) -> list[dict[str, Any]]:
    rows = client.query("SELECT * FROM events FINAL WHERE run_id IN {ids:Array(String)} "
                        "ORDER BY run_id, event_id", parameters={"ids": run_ids})
    stored = list(rows.named_results())
    for row in stored:
        row["payload"] = orjson.loads(row["payload"])
    return stored


def _delete(client: Any, run_ids: list[str]) -> None:
    quoted = ", ".join(f"'{run_id}'" for run_id in run_ids)
    client.command(f"DELETE FROM events WHERE run_id IN ({quoted})")


def test_mirrored_and_validated_events_are_stored_alike(local_store):
    _, client = local_store
    run_id = f"awkward-{uuid.uuid4().hex[:8]}"
    fleet = generate_events(400, seed=11, end=T0)
    events = _awkward_events(run_id) + fleet
    value = _envelope(events)
    decoded = decode_message(value, 10_000_000)
    assert decoded.events_json is not None and not decoded.dead  # the mirror's route

    pipeline = Pipeline(Settings(), MemoryRunStore(), clock=lambda: T0.timestamp())
    work = pipeline.process([RawMessage("loopwatch.events", PARTITION, OFFSET, value)])
    (mirrored,) = work.rows.tables[EVENTS_IN_TABLE]
    assert "event_extras" not in mirrored
    validated = _decode_slow(value)
    assert not validated.dead and validated.events_json is None
    events_json, extras = validated_events_json(validated.events)
    assert extras == [{}] * len(events)
    run_ids = sorted({event.run_id for event in events})
    sink = ClickHouseSink(client)

    sink.write_batch(RowBatch({EVENTS_IN_TABLE: [mirrored]}))
    through_mirror = _stored(client, run_ids)
    _delete(client, run_ids)
    sink.write_batch(RowBatch({EVENTS_IN_TABLE: [events_in_row(
        PARTITION, OFFSET, mirrored["ingested_at"], events_json, extras)]}))
    through_pydantic = _stored(client, run_ids)
    _delete(client, run_ids)

    assert len(through_mirror) == len(events) == len(through_pydantic)
    assert through_mirror == through_pydantic
    by_id = {event.event_id: event for event in decoded.events}
    for row in through_mirror:
        fields = by_id[row["event_id"]].model_dump(mode="json")
        assert row["payload"] == {name: value for name, value in fields.items()
                                  if name not in EVENT_COLUMNS and value is not None}
        assert row["extras"] == {}
    awkward = [row for row in through_mirror if row["run_id"] == run_id]
    assert [row["event_type"] for row in awkward] == [
        "run.start", "step", "llm.call", "tool.call"]
    assert (awkward[0]["trace_id"], awkward[0]["span_id"], awkward[1]["trace_id"]) == (
        "t" * 32, "s1", "")
    assert [row["ts"].isoformat() for row in awkward] == [  # UTC, to the millisecond
        "2026-11-30T09:00:00", "2026-11-30T09:00:00.250000", "2026-11-30T09:00:00.123000",
        "2026-11-30T09:00:01"]
    assert awkward[1]["payload"]["action_type"] == "</script>\u2028"
    assert awkward[2]["payload"]["input_tokens"] == 10**12
    assert awkward[3]["payload"]["tool"] == "search\u0000x"
    assert "late_completion_ms" in awkward[3]["payload"] and "step" not in awkward[3]["payload"]
    assert {row["kafka_partition"] for row in through_mirror} == {PARTITION}
    assert {row["kafka_offset"] for row in through_mirror} == {OFFSET}


def test_a_row_the_view_cannot_split_is_dead_lettered_not_lost(local_store):
    """The delivery guarantee rests on this: the view runs inside the insert, so a row
    it cannot write makes the insert fail rather than vanish into the Null table; the
    sink then finds that row (tests/test_event_views.py) and dead-letters it with the
    store's reason, and the good row is stored. (Before the sink bisected, the whole
    insert failed and was retried forever.)"""
    _settings, client = fresh_store(local_store, "unsplittable")
    run_id = f"unsplittable-{uuid.uuid4().hex[:8]}"
    good = orjson.loads(encode_envelope([Step(run_id=run_id, agent="a", step=1, ts=T0)]))
    bad = dict(good["events"][0], event_id="not-a-uuid")
    rows = [events_in_row(0, 1, T0, orjson.dumps(good["events"])),
            events_in_row(0, 2, T0, orjson.dumps([bad]))]
    ClickHouseSink(client).write_batch(RowBatch({EVENTS_IN_TABLE: rows}))
    assert len(_stored(client, [run_id])) == 1
    letters = client.query("SELECT source, reason FROM dead_letters").result_rows
    assert [(source, reason.split(": ")[0]) for source, reason in letters] == [
        ("sink:events_in", "events_in row refused by the store (CANNOT_PARSE_UUID)")]


def test_an_insert_through_the_view_leaves_its_thread_named_as_the_bench_reads_it(local_store):
    """The bench labels threads by the names chdb leaves on them (RENAMED_BY_CHDB): an
    insert that feeds ``events_in``'s view runs on the calling thread and renames it.
    If a chdb upgrade changes that name, the bench's "sink thread" figure goes astray.
    (A new thread inherits its creator's name, and this process's main thread inserted
    through the view in other tests: the thread names itself first.)"""
    _, client = local_store
    run_id = f"thread-name-{uuid.uuid4()}"
    work = Pipeline(Settings(), MemoryRunStore()).process(
        [RawMessage("t", PARTITION, OFFSET, _envelope(_awkward_events(run_id)))])
    names: list[str] = []

    def insert() -> None:
        task = Path(f"/proc/self/task/{threading.get_native_id()}/comm")
        task.write_text("python")
        names.append(task.read_text().strip())
        ClickHouseSink(client).write_batch(
            RowBatch(tables={EVENTS_IN_TABLE: work.rows.tables[EVENTS_IN_TABLE]}))
        names.append(task.read_text().strip())

    thread = threading.Thread(target=insert)
    thread.start()
    thread.join()
    _delete(client, [run_id])
    assert names[0] == "python"
    assert RENAMED_BY_CHDB.get(names[1]) == "sink thread"
