"""The store's generated views (store/event_views.py) against the Python rows
they replace, in the real chdb store.

- on the bench's event mix (plus events with extras, which take pydantic's route, and
  OTLP claim events, whose rows stay Python's), the views write the same ``events``,
  ``llm_calls``, ``tool_calls`` and ``labels`` tables as the processors' Python rows
  did before them: row counts and per-column hashes equal;
- SQL and Python price every entry of the price table (and an unknown model, both
  cache TTLs) to the same double, with the same mismatch flag; near-miss at the factor;
- a changed price table or setting re-creates the views (content hash), an unchanged
  one leaves them;
- a row ClickHouse refuses inside a large insert is found and dead-lettered with the
  store's reason while the rest is stored; a store fault is retried, never lettered.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError

from loopwatch.bench.fold import envelopes
from loopwatch.bench.pipeline import generate_events
from loopwatch.bench.store_path import fingerprint, python_rows, today_schema
from loopwatch.core.config import Settings
from loopwatch.core.pricing import PriceTable, cost_mismatch
from loopwatch.ingest.attribution import extras as claim_extras
from loopwatch.ingest.events import EventBase, Label, LlmCall, RunEnd, RunStart, ToolCall
from loopwatch.ingest.wire import encode_envelope
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.processors.rows import EVENTS_IN_TABLE, events_in_row
from loopwatch.store import event_views, tables
from loopwatch.store.sink import ClickHouseSink, RowBatch, encode_rows
from tests.stores import fresh_store

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)


def _odd_events() -> list[EventBase]:
    """Events off the mirror's route (extras) and claim events (rows built in Python)."""
    common: dict[str, Any] = {"run_id": "odd-1", "agent": "odd", "ts": T0}
    claim: dict[str, Any] = {"run_id": "otlp-1", "agent": "svc", "ts": T0,
                             **claim_extras(1)}
    return [
        RunStart(**common, step_cap=3),
        LlmCall(**common, step=1, model="claude-sonnet-4", input_tokens=900,
                cache_read_input_tokens=600, output_tokens=12, cost_usd=0.5,
                surprise={"nested": [1, 2]}),
        ToolCall(**common, tool="grep", timed_out=True, timeout_ms=1000.0,
                 late_completion_ms=1300.0, http_status=429, error_type="rate",
                 weird="é"),
        Label(**common, verdict="wrong", hallucination=True, extra_note=1),
        LlmCall(**claim, model="gpt-4o", input_tokens=50, output_tokens=5),
        ToolCall(**claim, tool="search", latency_ms=3.5),
        RunEnd(**common, terminal_reason="model_done"),
    ]


def _messages(count: int, settings: Settings) -> list[RawMessage]:
    mix = generate_events(count, 11, T0)
    messages = envelopes(mix, settings.partitions, settings.events_topic)
    odd = encode_envelope(_odd_events())
    return [*messages, RawMessage(settings.events_topic, 0, 10**6, odd)]


def test_the_views_store_the_tables_the_python_rows_did(local_store):
    """The same folded batch into two stores: today's (migration 006's split, Python
    call and label rows) and the views'. Every column of every table hashes equal."""
    today_settings, today = fresh_store(local_store, "today")
    views_settings, views = fresh_store(local_store, "views")
    messages = _messages(3000, views_settings)
    pipeline = Pipeline(views_settings, MemoryRunStore())
    work = pipeline.process(messages)
    assert set(work.rows.tables) >= {EVENTS_IN_TABLE, tables.RUNS}
    claim_rows = {table: len(work.rows.tables.get(table, []))
                  for table in (tables.LLM_CALLS, tables.TOOL_CALLS, tables.LABELS)}
    assert claim_rows == {tables.LLM_CALLS: 1, tables.TOOL_CALLS: 1, tables.LABELS: 0}

    today_schema(today, today_settings)
    legacy = RowBatch()
    legacy.extend(work.rows)
    legacy.extend(python_rows(messages, work.rows, today_settings,
                              PriceTable.load(today_settings.prices_file)))
    ClickHouseSink(today).write_batch(legacy)
    ClickHouseSink(views).write_batch(work.rows)

    expected, found = fingerprint(today), fingerprint(views)
    assert found == expected
    counts = {table: found[table][0] for table in event_views._TABLE_ORDER}
    assert counts[tables.EVENTS] == sum(
        len(orjson.loads(m.value)["events"]) if b'"envelope_version"' in m.value else 1
        for m in messages)
    assert all(counts.values()) and counts[tables.LABELS] >= 2
    odd = views.query("SELECT agent, near_miss, is_error, http_status FROM tool_calls "
                      "WHERE run_id IN ('odd-1', 'otlp-1') ORDER BY run_id").result_rows
    assert odd == [("odd", 1, 1, 429), ("svc", None, 0, 0)]


def _priced_events() -> list[LlmCall]:
    prices = PriceTable.load()
    events = []
    for model in [*prices.models, "no-such-model"]:
        for ttl in ("5m", "1h"):
            for tokens in ((1_234_567, 89_012, 345_678, 111_111), (10, 0, 40, 0),
                           (10**12, 10**12, 0, 0), (7, 3, 1, 2)):
                input_tokens, output, read, write = tokens
                priced = prices.cost(model, input_tokens, output, read, write, ttl)
                for reported in (None, priced.cost_usd, priced.cost_usd * 1.02 + 1e-6):
                    events.append(LlmCall(
                        run_id=f"price-{len(events)}", agent="pricing", ts=T0, model=model,
                        input_tokens=input_tokens, output_tokens=output,
                        cache_read_input_tokens=read, cache_creation_input_tokens=write,
                        cache_ttl=ttl, cost_usd=reported))
    return events


def test_sql_and_python_price_every_entry_of_the_price_table_alike(local_store):
    settings, client = fresh_store(local_store, "prices")
    prices = PriceTable.load(settings.prices_file)
    events = _priced_events()
    value = encode_envelope(events)
    ClickHouseSink(client).write_batch(Pipeline(settings, MemoryRunStore()).process(
        [RawMessage(settings.events_topic, 0, 0, value)]).rows)
    stored = {str(row[0]): row[1:] for row in client.query(
        "SELECT event_id, cost_usd, cost_mismatch, price_version, uncached_input_tokens "
        "FROM llm_calls").result_rows}
    assert len(stored) == len(events)
    mismatches = 0
    for event in events:
        priced = prices.cost(event.model, event.input_tokens, event.output_tokens,
                             event.cache_read_input_tokens, event.cache_creation_input_tokens,
                             event.cache_ttl)
        mismatch = cost_mismatch(event.cost_usd, priced.cost_usd,
                                 settings.cost_mismatch_tolerance)
        mismatches += mismatch
        assert stored[str(event.event_id)] == (
            priced.cost_usd, int(mismatch), prices.version, event.uncached_input_tokens), event
    assert mismatches == len(events) // 3  # every third reported 2 % off


def _near_miss_store(local_store: Any, factor: float) -> tuple[Settings, Client]:
    return fresh_store(local_store, "nearmiss", near_miss_factor=factor)


def _tool_call(client: Client, settings: Settings, late_ms: float) -> int | None:
    event = ToolCall(run_id=f"nm-{uuid.uuid4().hex[:6]}", agent="nm", ts=T0, tool="t",
                     timed_out=True, timeout_ms=1000.0, late_completion_ms=late_ms)
    row = events_in_row(0, 0, datetime.now(UTC),
                        orjson.dumps([event.model_dump(mode="json")]))
    ClickHouseSink(client).write_batch(RowBatch({EVENTS_IN_TABLE: [row]}))
    result = client.query("SELECT near_miss FROM tool_calls WHERE run_id = {r:String}",
                          parameters={"r": event.run_id}).result_rows
    return result[0][0]


def test_a_changed_setting_or_price_table_re_creates_the_views(local_store, tmp_path: Path):
    settings, client = fresh_store(local_store, "rehash")
    first = event_views.installed_hash(client)
    assert first == event_views.render(settings).content_hash
    assert event_views.install(client, settings) is False  # same text: left alone
    split = client.query("SELECT count() FROM system.tables WHERE database = "
                         "currentDatabase() AND name = 'events_in_split'").result_rows
    assert split == [(0,)]
    assert _tool_call(client, settings, 1300.0) == 1  # within 1.3 x the timeout
    assert _tool_call(client, settings, 1301.0) == 0

    wider = settings.model_copy(update={"near_miss_factor": 2.0})
    assert event_views.install(client, wider) is True
    assert event_views.installed_hash(client) not in (None, first)
    assert _tool_call(client, wider, 1900.0) == 1

    repriced = wider.model_copy(update={"prices_file": _price_file(tmp_path, "test-rehash")})
    assert event_views.install(client, repriced) is True
    assert "'test-rehash' AS price_version" in _llm_calls_view(client)


def _price_file(folder: Path, version: str) -> Path:
    """The shipped price table under another version: a price table the views differ by."""
    table = json.loads(Path(PriceTable.load.__code__.co_filename).parent.parent.joinpath(
        "processors", "prices.json").read_text())
    table["version"] = version
    path = folder / "prices.json"
    path.write_text(json.dumps(table))
    return path


def _llm_calls_view(client: Client) -> str:
    """The ``CREATE`` statement of the view that writes ``llm_calls`` (where prices live)."""
    return str(client.query("SELECT create_table_query FROM system.tables WHERE database = "
                            "currentDatabase() AND name = {n:String}",
                            parameters={"n": event_views.view_name(tables.LLM_CALLS)}
                            ).result_rows[0][0])



class _WritersBeside:
    """The store's client as ``install`` sees it, with another process's writes in
    between: after every statement ``install`` sends, one message of one tool call
    goes into ``events_in`` (deterministic interleaving, no threads)."""

    def __init__(self, client: Client, run: str) -> None:
        self.client, self.run, self.sent = client, run, 0
        self.statements: list[str] = []

    def command(self, statement: str, **kwargs: Any) -> Any:
        done = self.client.command(statement, **kwargs)
        self.statements.append(statement.split("\n", 1)[0][:60])
        event = ToolCall(run_id=f"{self.run}-{self.sent}", agent="beside", ts=T0,
                         tool="t", latency_ms=1.0)
        row = events_in_row(2, self.sent, datetime.now(UTC),
                            orjson.dumps([event.model_dump(mode="json")]))
        ClickHouseSink(self.client).write_batch(RowBatch({EVENTS_IN_TABLE: [row]}))
        self.sent += 1
        return done

    def query(self, *args: Any, **kwargs: Any) -> Any:
        return self.client.query(*args, **kwargs)


def test_a_new_price_table_changes_the_views_in_place_while_others_write(
        local_store, tmp_path: Path):
    """Another worker (or another host on a shared server) writes while this one starts
    with a new price table and near-miss factor: every message written meanwhile is
    stored, each event once, in ``events`` and ``tool_calls`` alike; the new prices
    are in force after."""
    settings, client = fresh_store(local_store, "inplace")
    changed = settings.model_copy(update={
        "prices_file": _price_file(tmp_path, "test-in-place"), "near_miss_factor": 2.0})
    run = f"beside-{uuid.uuid4().hex[:6]}"
    beside = _WritersBeside(client, run)
    assert event_views.install(beside, changed) is True  # type: ignore[arg-type]
    assert [line.split(" MODIFY")[0] for line in beside.statements if "ALTER" in line] == [
        f"ALTER TABLE {event_views.view_name(name)}" for name in event_views._TABLE_ORDER]
    assert not [line for line in beside.statements if line.startswith(("DROP", "CREATE"))
                and event_views.RECORD not in line]
    counts = [client.query(f"SELECT count(), uniqExact(run_id) FROM {name} "
                           "WHERE run_id LIKE {r:String}", parameters={"r": f"{run}-%"}
                           ).result_rows[0] for name in (tables.EVENTS, tables.TOOL_CALLS)]
    assert counts == [(beside.sent, beside.sent)] * 2
    assert event_views.install(client, changed) is False
    assert "'test-in-place' AS price_version" in _llm_calls_view(client)
    assert _tool_call(client, changed, 1900.0) == 1


def test_a_contract_change_re_creates_the_views_and_says_writers_must_stop(local_store):
    """What cannot change in place (here: the record of the parsed table's structure
    says another build made it) takes the drop-and-create path: messages written
    between its statements are lost, which is why ``install`` runs before anything is
    written and the upgrade needs every writer stopped (the docstring says so)."""
    settings, client = fresh_store(local_store, "recreate")
    for name in (event_views.STRUCTURE_NAME, event_views.RECORD_NAME):
        client.command(f"INSERT INTO {event_views.RECORD} (name, content_hash, applied_at) "
                       "VALUES ({n:String}, 'another build', now64(3))", parameters={"n": name})
    run = f"recreate-{uuid.uuid4().hex[:6]}"
    beside = _WritersBeside(client, run)
    assert event_views.install(beside, settings) is True  # type: ignore[arg-type]
    views = [line for line in beside.statements if event_views.RECORD not in line]
    assert views[0].startswith("DROP VIEW IF EXISTS") and "ALTER" not in " ".join(views)
    stored = client.query("SELECT count() FROM events WHERE run_id LIKE {r:String}",
                          parameters={"r": f"{run}-%"}).result_rows[0][0]
    assert 0 < stored < beside.sent
    assert event_views.installed_hash(client, event_views.STRUCTURE_NAME) == (
        event_views.render(settings).structure_hash)


def _good_rows(count: int, run: str) -> list[dict[str, Any]]:
    rows = []
    for offset in range(count):
        event = ToolCall(run_id=f"{run}-{offset}", agent="hostile", ts=T0 + timedelta(
            seconds=offset), tool="t", latency_ms=1.0)
        rows.append(events_in_row(1, offset, datetime.now(UTC),
                                  orjson.dumps([event.model_dump(mode="json")])))
    return rows


def _letters(client: Client) -> list[tuple[str, str]]:
    return [(source, reason) for source, reason in client.query(
        "SELECT source, reason FROM dead_letters FINAL ORDER BY reason").result_rows]


def test_a_row_the_store_refuses_in_a_large_insert_is_dead_lettered(local_store):
    """Hostile input past validation (a bug or a tampered message): an event id that is
    no UUID and a time ClickHouse cannot read, among 600 good rows. The good rows
    are stored, each bad one becomes a dead letter naming the store's error, and a
    redelivery of the batch changes nothing."""
    _settings, client = fresh_store(local_store, "refused")
    rows = _good_rows(600, "good")
    good = ToolCall(run_id="x", agent="hostile", ts=T0, tool="t").model_dump(mode="json")
    rows.insert(200, events_in_row(2, 7, datetime.now(UTC), orjson.dumps(
        [{**good, "event_id": "not-a-uuid", "run_id": "bad-id"}])))
    rows.insert(450, events_in_row(2, 8, datetime.now(UTC), orjson.dumps(
        [{**good, "ts": "next tuesday", "run_id": "bad-ts"}])))
    sink = ClickHouseSink(client)
    for _ in range(2):  # and once more, as a redelivery
        sink.write_batch(RowBatch({EVENTS_IN_TABLE: list(rows)}))
    assert sink.refused == 4
    stored = client.query("SELECT count(), uniqExact(run_id), countIf(run_id LIKE 'bad%') "
                          "FROM events FINAL").result_rows
    assert stored == [(600, 600, 0)]
    assert client.query("SELECT count() FROM tool_calls FINAL").result_rows == [(600,)]
    letters = _letters(client)
    assert [source for source, _ in letters] == ["sink:events_in", "sink:events_in"]
    assert [reason.split(": ")[0] for _, reason in letters] == [
        "events_in row refused by the store (CANNOT_PARSE_DATETIME)",
        "events_in row refused by the store (CANNOT_PARSE_UUID)"]
    payloads = sorted(orjson.loads(payload)["kafka_offset"] for (payload,) in client.query(
        "SELECT payload FROM dead_letters FINAL").result_rows)
    assert payloads == [7, 8]


def test_a_store_fault_is_retried_whole_not_dead_lettered(local_store):
    """A failure that is the store's (here a view's target table gone) is no refusal of
    a row: the write raises (the batch is retried) and nothing becomes a letter."""
    _settings, client = fresh_store(local_store, "fault")
    client.command(f"DROP TABLE {tables.EVENTS_PARSED}")
    sink = ClickHouseSink(client)
    with pytest.raises(DatabaseError):
        sink.write_batch(RowBatch({EVENTS_IN_TABLE: _good_rows(50, "fault")}))
    assert sink.refused == 0 and _letters(client) == []


def test_a_refused_row_sent_by_an_extra_worker_is_dead_lettered_too(local_store):
    """An extra worker's batch reaches the store owner already encoded (its insert
    endpoint, loopwatch/runtime.py): the owner decodes it only when the store refuses
    it, then bisects like any batch."""
    _settings, client = fresh_store(local_store, "encoded")
    rows = _good_rows(40, "encoded")
    good = ToolCall(run_id="x", agent="hostile", ts=T0, tool="t").model_dump(mode="json")
    rows.insert(17, events_in_row(3, 9, datetime.now(UTC), orjson.dumps(
        [{**good, "event_id": "not-a-uuid", "run_id": "bad-id"}])))
    sink = ClickHouseSink(client)
    sink.write_encoded(EVENTS_IN_TABLE, encode_rows(rows))
    assert sink.refused == 1
    assert client.query("SELECT count(), countIf(run_id = 'bad-id') FROM events FINAL"
                        ).result_rows == [(40, 0)]
    assert [reason.split(": ")[0] for _, reason in _letters(client)] == [
        "events_in row refused by the store (CANNOT_PARSE_UUID)"]
