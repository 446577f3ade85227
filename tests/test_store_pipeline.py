"""The engine-free pipeline writing to a real in-process chdb store: cost recomputation,
mismatch flags, reprocessing with a new price table, and re-delivery.

This test process opens its own chdb path (chdb allows one per process); every other
test reaches the store through the running pipeline's service.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from loopwatch.core.config import Settings
from loopwatch.ingest.events import EventBase, LlmCall, RunEnd, RunStart
from loopwatch.ingest.wire import encode_envelope
from loopwatch.processors.jobs.reprocess import MemoryRunStore, reprocess_with
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.processors.runs import seen_ids
from loopwatch.runtime import _insert_action, _store_reads
from loopwatch.store.clickhouse import connect, migrate, run_query
from loopwatch.store.reader import BODY_PIECE_BYTES, DirectReader, QueryError, ServiceReader
from loopwatch.store.remote_sink import ServiceSink
from loopwatch.store.service import SERVICE_HOST, UNIX_SCHEME, StoreService
from loopwatch.store.sink import ClickHouseSink, RowBatch

T0 = datetime(2026, 11, 29, 9, 0, tzinfo=UTC)


@pytest.fixture()
def store(local_store):
    return local_store


def messages(events: list[EventBase], offset: int = 0) -> list[RawMessage]:
    return [RawMessage("loopwatch.events", 0, offset, encode_envelope(events))]


def run_events(run_id: str, reported: float) -> list[EventBase]:
    common = {"run_id": run_id, "agent": "local", "model": "claude-sonnet-4"}
    return [
        RunStart(ts=T0, **common),
        LlmCall(ts=T0 + timedelta(seconds=1), input_tokens=1_000_000, output_tokens=0,
                cost_usd=reported, **common),
        RunEnd(ts=T0 + timedelta(seconds=2), terminal_reason="model_done", **common),
    ]


def test_cost_is_recomputed_and_mismatches_flagged(store):
    settings, client = store
    pipeline = Pipeline(settings, MemoryRunStore())
    work = pipeline.process(messages(run_events("honest", 3.0) + run_events("off", 9.0)))
    ClickHouseSink(client).write_batch(work.rows)
    rows = run_query(client, "SELECT run_id, cost_usd, reported_cost_usd, cost_mismatch "
                             "FROM llm_calls FINAL WHERE agent = 'local' ORDER BY run_id").rows
    assert rows == [["honest", 3.0, 3.0, 0], ["off", 3.0, 9.0, 1]]
    assert pipeline.counters.cost_mismatches == 1


def test_redelivered_batch_changes_nothing(store):
    settings, client = store
    pipeline = Pipeline(settings, MemoryRunStore())
    batch = messages(run_events("again", 3.0), offset=7)
    sink = ClickHouseSink(client)
    sink.write_batch(pipeline.process(batch).rows)
    sink.write_batch(pipeline.process(batch).rows)  # a crash before the commit
    assert pipeline.counters.duplicates == 3
    row = run_query(client, "SELECT count(), sum(llm_calls), sum(cost_usd) FROM runs FINAL "
                            "WHERE run_id = 'again'").rows[0]
    assert row == [1, 1, 3.0]
    assert run_query(client, "SELECT count() FROM events FINAL WHERE run_id = 'again'"
                     ).scalar() == 3


def test_a_run_read_back_from_the_store_still_knows_its_events(store):
    """``runs.state`` leaves the seen event ids out; a state read back (adoption after a
    broker restart, a label on a forgotten run) gets them from ``events``, so a
    redelivered event is still a duplicate and the counts stay exact. In a database of
    its own, with one runs row that has no state (skipped, not fatal)."""
    settings = Settings(data_dir=store[0].data_dir, database="read_back_check")
    client = migrate(settings)
    ClickHouseSink(client).write_batch(RowBatch({"runs": [
        {"run_id": "by-hand", "status": "running", "state": "", "version": 1}]}))
    first = Pipeline(settings, MemoryRunStore())
    events = run_events("read-back", 3.0)
    ClickHouseSink(client).write_batch(first.process(messages(events[:2], offset=1)).rows)
    stored = run_query(client, "SELECT state FROM runs FINAL WHERE run_id = 'read-back'"
                       ).scalar()
    assert json.loads(str(stored))["seen"] == ""
    open_runs, lookup_runs = _store_reads(DirectReader(client))
    adopted = open_runs()
    looked_up = lookup_runs(["read-back"]).get("read-back")
    assert looked_up is not None and [state.run_id for state in adopted] == ["read-back"]
    assert lookup_runs(["by-hand"]) == {}
    assert seen_ids(looked_up) == seen_ids(adopted[0]) == [e.event_id.bytes for e in events[:2]]
    adopting = Pipeline(settings, MemoryRunStore())
    assert adopting.adopt(adopted) == 1
    resumed = adopting.process(messages(events, offset=1))  # the first two again, the end
    looking_up = Pipeline(settings, MemoryRunStore(), lookup_runs=lookup_runs)
    looked = looking_up.process(messages(events[1:], offset=2))  # the call again, the end
    assert (adopting.counters.duplicates, looking_up.counters.duplicates) == (2, 1)
    for work in (resumed, looked):
        run = work.rows.tables["runs"][-1]
        assert (run["outcome"], run["llm_calls"], run["cost_usd"]) == ("success", 1, 3.0)


def test_a_run_read_back_after_a_crash_between_its_events_and_its_row_is_closed_once(store):
    """Finding (CI, a SIGKILL of ``up``): a batch's events are written chunk by chunk and
    its runs rows with its last write; killed between, the store held a run's
    ``run.end`` but a row from before it, the state read back counted every stored event
    seen, the redelivered ``run.end`` was a duplicate and the run stayed open for good.
    Here message 10 (start, call) is folded and stored with its row; message 11 (the
    call again, as an SDK resends it, and the end) is folded and its events stored, but
    not its row. Read back, the state has folded what came at or before offset 10, so
    the end counts once on redelivery and the call not twice."""
    settings = Settings(data_dir=store[0].data_dir, database="crash_between_check")
    client = migrate(settings)
    sink = ClickHouseSink(client)
    start, call, end = run_events("cut-short", 3.0)
    first = Pipeline(settings, MemoryRunStore())
    sink.write_batch(first.process(messages([start, call], offset=10)).rows)
    cut = first.fold(messages([call, end], offset=11), {})  # the chunk; no settle
    assert "runs" not in cut.rows.tables
    sink.write_batch(cut.rows)
    open_runs, lookup_runs = _store_reads(DirectReader(client))
    adopted = open_runs()
    assert [(state.run_id, state.folded_offset) for state in adopted] == [("cut-short", 10)]
    assert seen_ids(adopted[0]) == seen_ids(lookup_runs(["cut-short"])["cut-short"]) == [
        start.event_id.bytes, call.event_id.bytes]
    resumed = Pipeline(settings, MemoryRunStore())
    assert resumed.adopt(adopted) == 1
    sink.write_batch(resumed.process(messages([call, end], offset=11)).rows)
    assert resumed.counters.duplicates == 1
    assert run_query(client, "SELECT status, outcome, llm_calls, cost_usd FROM runs FINAL "
                             "WHERE run_id = 'cut-short'").rows == [["closed", "success", 1, 3.0]]


def test_after_a_lost_broker_offsets_count_from_the_new_incarnation(store):
    """An embedded broker that is lost (or stopped) starts its offsets again. A run
    folded at offset 500 of the first incarnation and read back after the loss folds
    on at offsets 3 and 4 of the second; killed between message 4's events and its
    row, the state read back must still fold message 4's end. With one offset for all
    incarnations its marker stayed 500, every new event counted as folded, and the end
    was dropped as a duplicate."""
    settings = Settings(data_dir=store[0].data_dir, database="incarnation_check")
    client = migrate(settings)
    sink = ClickHouseSink(client)
    start, call, end = run_events("across-brokers", 3.0)
    second_call = call.model_copy(update={"event_id": uuid.uuid4(),
                                          "ts": T0 + timedelta(seconds=1.5)})
    first_ms = int(time.time() * 1000) - 1
    first = Pipeline(settings, MemoryRunStore(), incarnation_ms=first_ms)
    sink.write_batch(first.process(messages([start, call], offset=500)).rows)
    time.sleep(0.01)
    second_ms = int(time.time() * 1000)
    time.sleep(0.01)
    open_runs, _ = _store_reads(DirectReader(client))
    after_loss = Pipeline(settings, MemoryRunStore(), incarnation_ms=second_ms)
    assert after_loss.adopt(open_runs()) == 1
    sink.write_batch(after_loss.process(messages([second_call], offset=3)).rows)
    cut = after_loss.fold(messages([end], offset=4), {})  # killed before the settle
    sink.write_batch(cut.rows)
    adopted = open_runs()
    assert [(s.folded_offset, s.folded_since_ms) for s in adopted] == [(3, second_ms)]
    assert seen_ids(adopted[0]) == [e.event_id.bytes for e in (start, call, second_call)]
    resumed = Pipeline(settings, MemoryRunStore(), incarnation_ms=second_ms)
    assert resumed.adopt(adopted) == 1
    sink.write_batch(resumed.process(messages([second_call, end], offset=3)).rows)
    assert resumed.counters.duplicates == 1
    assert run_query(client, "SELECT status, outcome, llm_calls, cost_usd FROM runs FINAL "
                             "WHERE run_id = 'across-brokers'").rows == [
        ["closed", "success", 2, 6.0]]


def test_many_runs_are_read_back_in_one_lookup(store):
    """``lookup_runs`` (what the fold calls for every run of a window it does not hold)
    returns each stored run with its folded event ids, leaves out runs the store does not
    have, and asks in one query per ``LOOKUP_CHUNK`` runs, not one per run."""
    settings = Settings(data_dir=store[0].data_dir, database="lookup_many_check")
    client = migrate(settings)
    runs = {run_id: run_events(run_id, 3.0) for run_id in ("many-a", "many-b")}
    folded = {run_id: events[:2] for run_id, events in runs.items()}
    writer = Pipeline(settings, MemoryRunStore())
    ClickHouseSink(client).write_batch(writer.process(
        messages([e for events in folded.values() for e in events])).rows)
    reader = DirectReader(client)
    queries: list[str] = []
    query = reader.query

    def counted(sql: str, parameters: dict | None = None):
        queries.append(sql)
        return query(sql, parameters)

    reader.query = counted  # type: ignore[method-assign]
    _, lookup_runs = _store_reads(reader)
    found = lookup_runs(["many-a", "missing", "many-b"])
    assert sorted(found) == ["many-a", "many-b"]
    assert {run_id: seen_ids(state) for run_id, state in found.items()} == {
        run_id: [e.event_id.bytes for e in events] for run_id, events in folded.items()}
    assert len(queries) == 2  # the states, then their events' ids
    looking_up = Pipeline(settings, MemoryRunStore(), lookup_runs=lookup_runs)
    again = looking_up.process(messages(
        [e for events in runs.values() for e in events[1:]], offset=1))
    assert looking_up.counters.duplicates == 2
    assert sorted((row["run_id"], row["outcome"], row["llm_calls"])
                  for row in again.rows.tables["runs"]) == [
        ("many-a", "success", 1), ("many-b", "success", 1)]


def test_reprocess_applies_a_new_price_table(store, tmp_path: Path):
    """In a database of its own: reprocessing rewrites every closed run it finds."""
    settings = Settings(data_dir=store[0].data_dir, database="reprocess_check")
    client = migrate(settings)
    late = T0 + timedelta(hours=1)
    client.insert("runs", [["no-state", "closed", late, late, ""]],
                  column_names=["run_id", "status", "last_event_ts", "closed_ts", "state"])
    pipeline = Pipeline(settings, MemoryRunStore())
    events = run_events("repriced", 3.0)
    work = pipeline.process(messages(events))
    ClickHouseSink(client).write_batch(work.rows)
    prices = json.loads((Path(__file__).parent.parent / "processors/prices.json").read_text())
    prices["version"] = "2027-01-01"
    prices["models"]["claude-sonnet-4"]["input"] = 2.0
    price_file = tmp_path / "prices.json"
    price_file.write_text(json.dumps(prices))
    repriced = Settings(data_dir=settings.data_dir, database="reprocess_check",
                        prices_file=price_file)
    summary = reprocess_with(client, repriced, T0 - timedelta(minutes=1))
    assert summary == {"runs": 1, "events": 3, "skipped": 1}
    assert run_query(client, "SELECT cost_usd, price_version, cost_mismatch FROM llm_calls "
                             "FINAL WHERE run_id = 'repriced'").rows == [[2.0, "2027-01-01", 1]]
    assert run_query(client, "SELECT outcome, cost_usd FROM runs FINAL "
                             "WHERE run_id = 'repriced'").rows == [["success", 2.0]]
    again = reprocess_with(client, repriced, T0 - timedelta(minutes=1))
    assert again == summary
    assert run_query(client, "SELECT count() FROM runs FINAL WHERE run_id = 'repriced'"
                     ).scalar() == 1


def _rows(client, run_id: str) -> list[list[object]]:
    return [row for table in ("events", "llm_calls", "runs")
            for row in run_query(client, f"SELECT * FROM {table} FINAL WHERE run_id = "
                                 "{run_id:String} ORDER BY ALL", {"run_id": run_id}).rows]


def _delete(client, run_id: str) -> None:
    for table in ("events", "llm_calls", "runs"):
        client.command(f"DELETE FROM {table} WHERE run_id = '{run_id}'")


def test_rows_through_the_store_service_equal_direct_inserts_and_redelivery_is_harmless(
        store, tmp_path: Path):
    """An extra worker's write path (ServiceSink -> owner's insert action) stores exactly
    what the owner's own sink stores, answers only after the insert, and rejects a batch
    naming a table it does not take without inserting any of it. Each request whose
    raw events went in is reported (the owner's ``events_stored_at``), a refused one not."""
    settings, client = store
    events_in: list[int] = []
    service = StoreService(client, lambda: {}, tmp_path / "service.json",
                           raw_actions={"insert-batch": _insert_action(
                               lambda: connect(settings), lambda: events_in.append(1))})
    url = service.start({})
    try:
        sink = ServiceSink(ServiceReader(url))
        work = Pipeline(settings, MemoryRunStore()).process(
            messages(run_events("remote", 3.0), offset=11))
        ClickHouseSink(client).write_batch(work.rows)
        direct = _rows(client, "remote")
        assert len(direct) == 5  # 3 events, 1 llm call, 1 run
        _delete(client, "remote")
        sink.write_batch(work.rows)
        assert _rows(client, "remote") == direct
        sink.write_batch(work.rows)  # redelivered after a crash before the commit
        assert _rows(client, "remote") == direct
        assert events_in == [1, 1]

        bad = RowBatch({"events_in": work.rows.tables["events_in"], "system_users": [{"x": 1}]})
        _delete(client, "remote")
        with pytest.raises(QueryError, match="does not take remote inserts"):
            sink.write_batch(bad)
        assert _rows(client, "remote") == []
        assert events_in == [1, 1]
    finally:
        service.stop()


def test_a_body_larger_than_a_socket_buffer_goes_in_pieces_as_one_plain_body(
        store, tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    """An extra worker's insert batches are tens of MB: the reader hands them to the
    socket in pieces (httpcore re-copies the unsent rest of a whole body after every
    send, docs/performance.md) yet still as one body of a stated length, never chunked,
    and the owner's action gets every byte, at every size around a piece's."""
    _, client = store
    received: list[bytes] = []

    def echo(body: bytes) -> dict[str, object]:
        received.append(body)
        return {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}

    service = StoreService(client, lambda: {}, tmp_path / "service.json",
                           raw_actions={"echo": echo})
    url = service.start({})
    sent: list[tuple[str | None, str | None, bool]] = []

    def seen(request: httpx.Request) -> None:
        try:
            request.content  # noqa: B018  # read only when the body is one bytes object
            streamed = False
        except httpx.RequestNotRead:
            streamed = True
        sent.append((request.headers.get("content-length"),
                     request.headers.get("transfer-encoding"), streamed))

    try:
        reader = ServiceReader(url)
        reader._http().event_hooks["request"].append(seen)
        sizes = [0, 1, BODY_PIECE_BYTES - 1, BODY_PIECE_BYTES, BODY_PIECE_BYTES + 1,
                 3 * BODY_PIECE_BYTES, 24 * BODY_PIECE_BYTES + 7]
        for size in sizes:
            body = os.urandom(size)
            answer = json.loads(reader.send("/admin/echo", body, "application/octet-stream"))
            assert answer == {"bytes": size, "sha256": hashlib.sha256(body).hexdigest()}
            assert received[-1] == body
        assert sent == [(str(size), None, size > BODY_PIECE_BYTES) for size in sizes]

        # hostile: a sender that states a length, sends part of it and hangs up never
        # gets its part to the action nor a traceback into the log, and the service
        # still answers the next sender
        cut = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        cut.connect(url.removeprefix(UNIX_SCHEME))
        cut.sendall(f"POST /admin/echo HTTP/1.1\r\nHost: {SERVICE_HOST}\r\n"
                    f"Content-Type: application/octet-stream\r\n"
                    f"Content-Length: {3 * BODY_PIECE_BYTES}\r\n\r\n".encode()
                    + bytes(BODY_PIECE_BYTES))
        cut.close()
        body = os.urandom(2 * BODY_PIECE_BYTES + 1)
        answer = json.loads(reader.send("/admin/echo", body, "application/octet-stream"))
        assert answer["bytes"] == len(body)
        assert len(received) == len(sizes) + 1 and received[-1] == body
        assert "Exception in ASGI application" not in capfd.readouterr().err
    finally:
        service.stop()


def test_an_extra_worker_follows_its_store_owner_across_a_restart(store, tmp_path: Path):
    """``loopwatch up`` listened on a new port each time it started. An extra worker
    kept the address it started with, and after a restart of the owner its every write
    was refused and retried until the worker itself was restarted: its partitions
    stalled. The owner's socket now lives at a stable path in the data dir (a restart
    serves the same address), and a worker whose address moved anyway (a data dir path
    too long for a socket) follows the announcement: ``test_a_socket_path_too_long_...``
    in tests/test_service_auth.py."""
    settings, client = store
    owner_dir = Settings(data_dir=tmp_path)

    def owner() -> StoreService:
        return StoreService(client, lambda: {}, owner_dir.service_file, raw_actions={
            "insert-batch": _insert_action(lambda: connect(settings))})

    first = owner()
    service = ServiceReader(first.start({}), follow=owner_dir)
    sink = ServiceSink(service)
    work = Pipeline(settings, MemoryRunStore()).process(
        messages(run_events("follow", 3.0), offset=11))
    try:
        sink.write_batch(work.rows)
    finally:
        first.stop()
    _delete(client, "follow")
    second = owner()
    moved_to = second.start({})
    try:
        assert moved_to == first.url == f"unix:{owner_dir.service_socket}"
        sink.write_batch(work.rows)
        assert service.url == moved_to
        assert len(_rows(client, "follow")) == 5
        assert service.query("SELECT count() FROM runs FINAL WHERE run_id = 'follow'"
                             ).rows == [[1]]
    finally:
        second.stop()
    with pytest.raises(OSError):
        ServiceReader(moved_to).query("SELECT 1")


def test_a_row_that_cannot_be_encoded_is_a_dead_letter_not_a_stalled_sink(store):
    """Every field is bounded when an event or capture is validated, so no row should
    ever hold what the insert cannot encode; if a future gap lets one through (here an
    integer past 64 bits, as the capture counts once did), the sink used to raise on the
    whole batch and the retrying sink retried it forever: every table stalled. The row
    becomes a dead letter with the error, and the rest of its batch is written."""
    _settings, client = store
    tag = uuid.uuid4().hex[:8]
    good = {"event_id": uuid.uuid4(), "ts": T0, "kind": "deploy", "agent": f"enc-{tag}",
            "message": "fine"}
    bad = {**good, "event_id": uuid.uuid4(), "message": 2**64}
    sink = ClickHouseSink(client)
    sink.write_batch(RowBatch({"annotations": [good, bad], "labels": []}))
    stored = run_query(client, "SELECT event_id FROM annotations FINAL "
                               "WHERE agent = {a:String}", {"a": f"enc-{tag}"}).rows
    assert [str(row[0]) for row in stored] == [str(good["event_id"])]
    letters = run_query(client, "SELECT source, reason, payload FROM dead_letters FINAL "
                                "WHERE payload LIKE {p:String}", {"p": f"%enc-{tag}%"}).rows
    assert [(source, reason) for source, reason, _ in letters] == [
        ("sink:annotations", "unstorable annotations row: TypeError: Integer exceeds "
                             "64-bit range")]
    assert json.loads(letters[0][2])["message"] == 2**64
    assert sink.unstorable == 1
    sink.write_batch(RowBatch({"annotations": [bad]}))  # redelivered: the same letter
    assert run_query(client, "SELECT count() FROM dead_letters FINAL WHERE payload LIKE "
                             "{p:String}", {"p": f"%enc-{tag}%"}).rows == [[1]]
