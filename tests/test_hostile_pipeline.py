"""Hostile input at the processors' engine-free core (``loopwatch.processors.pipeline.Pipeline``):
messages in, run state, rows and dead letters out; in-process, no broker.

Thrown at it: random bytes, truncated and malformed JSON, wrong types in every field,
integers beyond 64 bits, huge fields, deep nesting, odd unicode (NUL, bidi overrides,
BOM, non-characters, lone surrogate escapes), duplicates, out-of-order events, clock
skew (epoch 0, far past, far future), bad envelopes, a message whose events cannot be
stored, and a valid event the fold raises on (a planted bug). A known-good scripted run
is fed among the garbage.

What must hold: nothing raises; every message the pipeline reads yields its events or
dead letters (each dead letter has a reason and a ``dead_letters`` row); the rows it
produces are accepted by a real ClickHouse (chdb, a separate database in the session's
local store) so no garbage can wedge the sink; the good run's row is exact.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import orjson
import pytest
from clickhouse_connect.driver.client import Client
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from loopwatch.core.config import Settings
from loopwatch.ingest.events import TS_RANGE
from loopwatch.ingest.wire import decode_message
from loopwatch.processors.deadletter import payload_limit
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage, Work
from loopwatch.processors.pricing import PriceTable
from loopwatch.processors.runs import RunState
from loopwatch.store.cluster import render_cluster_ddl
from loopwatch.store.sink import ClickHouseSink, RowBatch, encode_rows
from tests.conftest import raw_events

MAX_MESSAGE_BYTES = 20_000
NOW_S = 1_800_000_000.0  # the pipeline's wall clock, fixed: 2027-01-15
HOSTILE_DB = "hostile"
EXAMPLES = 60  # hypothesis examples per property (whole module: well under a minute)
FUZZ_MESSAGES = 3000

ODD_STRINGS = [
    "", " ", "\x00", "a\x00b", "\u202egnp.exe", "\ufeff", "\uffff", "\U0010ffff",
    "e\u0301\u0301\u0301", "\U0001f468\u200d\U0001f469\u200d\U0001f467",
    "\U0001d518\U0001d52b\U0001d526",
    "' OR 1=1 --", "\\", '"', "\n\r\t", "null", "NaN", "٣", "Ⅻ", "ß" * 300,
]
#: Raw fragments no encoder produces: lone surrogate escapes, bad UTF-8, truncation.
RAW_GARBAGE = [
    b"", b"{", b"}", b"null", b"[]", b"42", b'"str"', b"\xff\xfe\xfd", b"\x00" * 16,
    b'{"event_type": "step", "run_id": "\\ud800", "agent": "a", "step": 1}',
    b'{"event_type": "step", "run_id": "r", "agent": "\xc3\x28", "step": 1}',
    b'{"event_type": "step", "run_id": "r", "agent": "a", "step": 1e400}',
    b'{"event_type": "step", "run_id": "r", "agent": "a", "step": NaN}',
    b'{"event_type": "step", "run_id": "r", "agent": "a", "step": 1',
    b'{"envelope_version": 2, "events": []}', b'{"envelope_version": 1, "events": {}}',
    b'{"envelope_version": 1, "events": [1, "x", null, []]}',
    b'{"event_type": "step", "run_id": "r", "agent": "a", "step": 1, "step": 2}',
]

#: Integers reach +-2**70, past 64 bits either way, in known fields and in extras alike.
#: Nesting inside an event stays below 255 levels here: deeper ones have a test of their
#: own below; deeper than 1024 is malformed JSON.
#: Epoch milliseconds and ISO strings for ``ts``: skewed clocks and nonsense; an epoch
#: beyond any date has a test of its own below.
#: The generators skew clocks into the past and up to an hour ahead; far-future stamps
#: move the watermark and have tests of their own (see the clock-skew tests below).
HOUR_MS = 3_600_000
SKEWED_TS: list[Any] = [
    0, -1, 1, -62_135_596_800_000, -(10**16), 1.5, int(NOW_S * 1000) + HOUR_MS,
    "1970-01-01T00:00:00Z", "0001-01-01T00:00:00", "2026-02-30T00:00:00Z", "yesterday", "",
    True, None, [], {}, 253_402_300_800_000, 10**16, "10000-01-01T00:00:00Z",
]
FAR_FUTURE_TS: list[Any] = [253_402_300_799_999, "9999-12-31T23:59:59Z",
                            int(NOW_S * 1000) + 365 * 86_400_000]


# -- messages -------------------------------------------------------------------------

def good_run(run_id: str, agent: str) -> list[dict[str, Any]]:
    """A scripted run whose row is known by hand: 2 steps, 2 calls to claude-sonnet-4
    (1000 in / 100 out each: $0.0045 at $3/$15 per million), one tool call, success."""
    base = {"run_id": run_id, "agent": agent, "model": "claude-sonnet-4", "task_type": "qa"}
    t0 = int(NOW_S * 1000) - 60_000

    def event(kind: str, offset_ms: int, **fields: Any) -> dict[str, Any]:
        return {"event_type": kind, "event_id": str(uuid.uuid4()), "ts": t0 + offset_ms,
                **base, **fields}

    return [
        event("run.start", 0, step_cap=10),
        event("step", 10, step=0),
        event("llm.call", 20, step=0, input_tokens=1000, output_tokens=100),
        event("tool.call", 30, step=0, tool="search", latency_ms=12.5),
        event("step", 40, step=1),
        event("llm.call", 50, step=1, input_tokens=1000, output_tokens=100),
        event("run.end", 60, terminal_reason="model_done"),
    ]


def assert_good_row(row: dict[str, Any], run_id: str) -> None:
    assert row["run_id"] == run_id
    assert (row["status"], row["outcome"], row["terminal_reason"]) == (
        "closed", "success", "model_done")
    assert (row["steps"], row["llm_calls"], row["tool_calls"], row["tool_errors"],
            row["llm_errors"]) == (2, 2, 1, 0, 0)
    assert (row["input_tokens"], row["output_tokens"]) == (2000, 200)
    assert row["cost_usd"] == pytest.approx(2 * (1000 * 3e-6 + 100 * 15e-6))
    assert row["loop_detected"] == 0


TEMPLATES: dict[str, dict[str, Any]] = {
    "run.start": {"step_cap": 5},
    "step": {"step": 1},
    "llm.call": {"input_tokens": 10, "output_tokens": 2, "model": "gpt-4o"},
    "tool.call": {"tool": "grep", "latency_ms": 3.0},
    "run.end": {"terminal_reason": "model_done"},
    "label": {"verdict": "wrong"},
    "annotation": {"kind": "deploy"},
}


_DEEP = re.compile(rb'"__deep_(\d+)__"')


def json_bytes(value: Any) -> bytes:
    """Standard JSON (big integers included), as a hostile client might send it; the
    placeholders :func:`nested` leaves become that deep a nesting of objects and arrays."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")
    return _DEEP.sub(lambda m: nested_bytes(int(m[1])), text)


def nested(depth: int) -> str:
    return f"__deep_{depth}__"


def nested_bytes(depth: int) -> bytes:
    opened = b"".join(b"[" if level % 2 else b'{"k":' for level in range(depth))
    closed = b"".join(b"]" if level % 2 else b"}" for level in reversed(range(depth)))
    return opened + b'"bottom"' + closed


json_scalars = (st.none() | st.booleans()
                | st.integers(min_value=-(2**70), max_value=2**70)
                | st.floats(min_value=-1e17, max_value=1e17, allow_nan=False)
                | st.text(max_size=30) | st.sampled_from(ODD_STRINGS))
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


@st.composite
def hostile_event(draw: st.DrawFn, run_ids: list[str]) -> dict[str, Any]:
    """A plausible event, then broken in one or more ways (or left valid)."""
    kind = draw(st.sampled_from(sorted(TEMPLATES)))
    event: dict[str, Any] = {"event_type": kind, "run_id": draw(st.sampled_from(run_ids)),
                             "agent": draw(st.sampled_from(["hostile", *ODD_STRINGS[:6]])),
                             "event_id": str(uuid.UUID(int=draw(st.integers(0, 40)))),
                             "ts": int(NOW_S * 1000) + draw(st.integers(-10**9, 10**9)),
                             **TEMPLATES[kind]}
    for _ in range(draw(st.integers(0, 3))):
        what = draw(st.sampled_from(["wrong_type", "drop", "extra", "skew", "kind", "version",
                                     "huge", "deep", "odd"]))
        key = draw(st.sampled_from(sorted(event)))
        if what == "wrong_type":
            event[key] = draw(json_values)
        elif what == "drop":
            event.pop(key, None)
        elif what == "extra":
            event[draw(st.text(max_size=12))] = draw(json_values)
        elif what == "skew":
            event["ts"] = draw(st.sampled_from(SKEWED_TS))
        elif what == "kind":
            event["event_type"] = draw(st.sampled_from(["", "STEP", "run.start ", "x" * 300]))
        elif what == "version":
            event["schema_version"] = draw(st.sampled_from(["1.9", "2.0", "0.1", "x", "", 1]))
        elif what == "huge":
            event[key] = "x" * draw(st.sampled_from([300, 5_000, MAX_MESSAGE_BYTES + 10]))
        elif what == "deep":
            event["nested"] = nested(draw(st.sampled_from([10, 200])))
        else:
            event[key] = draw(st.sampled_from(ODD_STRINGS))
    return event


@st.composite
def hostile_message(draw: st.DrawFn, run_ids: list[str]) -> bytes:
    shape = draw(st.sampled_from(["event", "envelope", "bytes", "raw", "json", "truncated",
                                  "deep", "oversized"]))
    if shape == "event":
        return json_bytes(draw(hostile_event(run_ids)))
    if shape == "envelope":
        events = draw(st.lists(hostile_event(run_ids), min_size=0, max_size=4))
        return json_bytes({"envelope_version": draw(st.sampled_from([1, 1, 1, 2, "1", None])),
                           "events": events})
    if shape == "bytes":
        return draw(st.binary(max_size=200))
    if shape == "raw":
        return draw(st.sampled_from(RAW_GARBAGE))
    if shape == "json":
        return json_bytes(draw(json_values))
    if shape == "truncated":
        whole = json_bytes(draw(hostile_event(run_ids)))
        return whole[: draw(st.integers(0, max(0, len(whole) - 1)))]
    if shape == "deep":
        return json_bytes(nested(draw(st.sampled_from([100, 1100, 3000]))))
    return b'{"event_type": "step", "pad": "' + b"x" * MAX_MESSAGE_BYTES + b'"}'


# -- the harness ----------------------------------------------------------------------

@dataclass
class Harness:
    """A pipeline on a memory run store, its rows collected for a real insert."""

    pipeline: Pipeline
    rows: RowBatch = field(default_factory=RowBatch)
    offset: int = 0
    messages: int = 0
    events: int = 0
    dead: int = 0

    def feed(self, values: list[bytes]) -> Work:
        batch = []
        for value in values:
            batch.append(RawMessage("loopwatch.events", self.offset % 4, self.offset, value))
            self.offset += 1
        before = (self.pipeline.counters.messages, self.pipeline.counters.events,
                  self.pipeline.counters.dead_letters)
        work = self.pipeline.process(batch)
        counters = self.pipeline.counters
        assert counters.messages - before[0] == len(values)
        assert counters.events - before[1] == len(raw_events(work.rows))
        assert counters.dead_letters - before[2] == len(work.dead)
        assert len(work.rows.tables["dead_letters"]) == len(work.dead)
        for letter, row in zip(work.dead, work.rows.tables["dead_letters"], strict=True):
            assert letter.reason and row["reason"] == letter.reason
            assert row["id"] == letter.letter_id
        for value in values:  # every message that carries anything yields an outcome
            decoded = decode_message(value, MAX_MESSAGE_BYTES)
            assert decoded.events or decoded.dead or value.lstrip().startswith(b"{")
        self.messages += len(values)
        self.events += len(raw_events(work.rows))
        self.dead += len(work.dead)
        self.rows.extend(work.rows)
        self.rows.extend(self.pipeline.sweep().rows)
        return work


def new_harness() -> Harness:
    """A pipeline as ``loopwatch up`` builds it, minus Kafka and ClickHouse: a memory run
    store, a fixed wall clock, and ``lookup_run`` reading back the run rows produced so
    far (production reads them from ClickHouse), so a run the worker forgot is resumed."""
    settings = Settings(data_dir=Path("/nonexistent-hostile"),
                        max_message_bytes=MAX_MESSAGE_BYTES, late_allowance_s=5,
                        idle_advance_s=10)
    harness = Harness(Pipeline(settings, MemoryRunStore(), clock=lambda: NOW_S))

    def lookup_run(run_id: str) -> RunState | None:
        rows = [row for row in harness.rows.tables["runs"] if row["run_id"] == run_id]
        if not rows:
            return None
        return RunState.from_dict(orjson.loads(max(rows, key=lambda r: r["version"])["state"]))

    harness.pipeline.lookup_run = lookup_run
    return harness


@pytest.fixture(scope="module")
def hostile_db(local_store: tuple[Settings, Client]) -> Client:
    """The loopwatch schema in a database of its own inside the session's chdb, so the
    garbage rows never show up in other tests' data (single-node cluster DDL: the same
    tables, each name a pass-through Buffer in front of ``<name>_local``)."""
    _settings, client = local_store
    for statement in render_cluster_ddl("unused", HOSTILE_DB, single_node=True):
        client.command(statement)
    return client


def insert_all(client: Client, batch: RowBatch) -> int:
    """Insert as :class:`loopwatch.store.sink.ClickHouseSink` does (one JSON insert per table);
    a refused batch is narrowed to the first row ClickHouse refuses, for the message."""
    sink = ClickHouseSink(client)
    total = 0
    for table, rows in batch.tables.items():
        if not rows:
            continue
        try:
            sink.write_json(f"{HOSTILE_DB}.{table}", encode_rows(rows))
        except Exception as exc:
            for row in rows:
                try:
                    sink.write_json(f"{HOSTILE_DB}.{table}", encode_rows([row]))
                except Exception:
                    raise AssertionError(f"ClickHouse refused a {table} row: {row!r}") from exc
            raise
        total += len(rows)
    return total


GOOD_STORED = [("closed", "success", 2, 2, 1, 2000, 200, 0.009)]


def stored_run(client: Client, run_id: str) -> list[tuple[Any, ...]]:
    """The run as ClickHouse keeps it (the highest version wins)."""
    return [tuple(row) for row in client.query(
        f"SELECT status, outcome, steps, llm_calls, tool_calls, input_tokens, output_tokens, "
        f"round(cost_usd, 6) FROM {HOSTILE_DB}.runs FINAL WHERE run_id = {{r:String}}",
        parameters={"r": run_id}).result_rows]


def latest_run_row(batch: RowBatch, run_id: str) -> dict[str, Any]:
    """The run row ClickHouse keeps: ReplacingMergeTree(version) picks the highest."""
    rows = [row for row in batch.tables["runs"] if row["run_id"] == run_id]
    assert rows, f"no run row for {run_id}"
    return max(rows, key=lambda row: row["version"])


def counts(client: Client, table: str, run_id: str) -> int:
    return int(client.query(f"SELECT count() FROM {HOSTILE_DB}.{table} FINAL "
                            "WHERE run_id = {r:String}",
                            parameters={"r": run_id}).result_rows[0][0])


# -- properties -------------------------------------------------------------------------

TRIED: dict[str, int] = {}


@pytest.fixture(scope="module", autouse=True)
def summary() -> Iterator[None]:
    yield
    print("\nhostile input at the processors' core: "
          + ", ".join(f"{name} {count}" for name, count in TRIED.items()))


@hypothesis_settings(max_examples=EXAMPLES, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_garbage_never_crashes_and_the_good_run_among_it_is_exact(data, hostile_db):
    """Property: for any mix of garbage, duplicates and a shuffled good run (its events
    out of order, some delivered twice), processing never raises, every rejected message
    is a dead letter with its reason, all rows insert into ClickHouse, and the good run's
    row is exactly the scripted one."""
    harness = new_harness()
    good_id = f"good-{uuid.uuid4().hex}"
    garbage_ids = ["g1", "g2", good_id + "-other", "\u202e", "x" * 256]
    good = [json_bytes(event) for event in good_run(good_id, "hostile-good")]
    order = data.draw(st.permutations(good), label="good run order")
    again = data.draw(st.lists(st.sampled_from(good), max_size=4), label="redelivered")
    garbage = data.draw(st.lists(hostile_message(garbage_ids), min_size=1, max_size=25),
                        label="garbage")
    stream = garbage + list(order) + again
    positions = data.draw(st.permutations(range(len(stream))), label="interleaving")
    mixed = [stream[i] for i in positions]
    cut = data.draw(st.integers(0, len(mixed)), label="batch split")
    harness.feed(mixed[:cut])
    harness.feed(mixed[cut:])
    assert_good_row(latest_run_row(harness.rows, good_id), good_id)
    insert_all(hostile_db, harness.rows)
    assert stored_run(hostile_db, good_id) == GOOD_STORED
    TRIED["property messages"] = TRIED.get("property messages", 0) + len(mixed)
    TRIED["property examples"] = TRIED.get("property examples", 0) + 1


@hypothesis_settings(max_examples=EXAMPLES, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(value=st.binary(max_size=500) | json_values.map(json_bytes))
def test_any_bytes_decode_to_events_or_reasoned_dead_letters(value):
    """Property: the decoder never raises; what it cannot read comes back with a reason
    and the bytes it could not read (nothing silently vanishes)."""
    decoded = decode_message(value, MAX_MESSAGE_BYTES)
    for letter in decoded.dead:
        assert letter.reason
        assert isinstance(letter.payload, bytes)
    if not value.lstrip().startswith(b"{"):  # not an (empty) envelope: something came out
        assert decoded.events or decoded.dead
    TRIED["decoder inputs"] = TRIED.get("decoder inputs", 0) + 1


def test_fuzz_run_with_a_good_run_inside(hostile_db):
    """Fuzz: 3000 messages from a seeded generator (same kinds as the properties, plus
    exact duplicates of earlier garbage), in batches of 50, with the good run spread
    among them. Counts are exact: events + dead letters account for every message, the
    stored rows equal the produced rows, the good run is exact in ClickHouse."""
    rng = random.Random(20261129)
    harness = new_harness()
    good_id = f"good-{uuid.uuid4().hex}"
    good = [json_bytes(event) for event in good_run(good_id, "hostile-good")]
    garbage: list[bytes] = []
    for _ in range(FUZZ_MESSAGES - len(good)):
        if garbage and rng.random() < 0.1:
            garbage.append(rng.choice(garbage))  # a duplicate delivery
        else:
            garbage.append(_fuzz_one(rng))
    stream = garbage[:]
    for event in good:
        stream.insert(rng.randrange(len(stream) + 1), event)
    for start in range(0, len(stream), 50):
        harness.feed(stream[start:start + 50])
    assert harness.messages == FUZZ_MESSAGES
    assert harness.events + harness.dead >= sum(
        1 for value in stream if not value.lstrip().startswith(b"{"))
    inserted = insert_all(hostile_db, harness.rows)
    assert inserted == len(harness.rows)
    assert counts(hostile_db, "events", good_id) == len(good)
    assert counts(hostile_db, "llm_calls", good_id) == 2
    assert counts(hostile_db, "tool_calls", good_id) == 1
    assert stored_run(hostile_db, good_id) == GOOD_STORED
    dead_rows = int(hostile_db.query(
        f"SELECT count() FROM {HOSTILE_DB}.dead_letters WHERE reason = ''").result_rows[0][0])
    assert dead_rows == 0
    TRIED["fuzz messages"] = harness.messages
    TRIED["fuzz events accepted"] = harness.events
    TRIED["fuzz dead letters"] = harness.dead


def _fuzz_one(rng: random.Random) -> bytes:
    """One hostile message from a plain seeded generator (fast, no hypothesis engine)."""
    kind = rng.random()
    if kind < 0.2:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 120)))
    if kind < 0.3:
        return rng.choice(RAW_GARBAGE)
    event_type = rng.choice(sorted(TEMPLATES))
    event: dict[str, Any] = {"event_type": event_type, "run_id": rng.choice(["f1", "f2", "f3"]),
                             "agent": rng.choice(["hostile", *ODD_STRINGS]),
                             "ts": int(NOW_S * 1000) + rng.randrange(-10**9, 10**9),
                             "event_id": str(uuid.UUID(int=rng.randrange(60))),
                             **TEMPLATES[event_type]}
    for _ in range(rng.randrange(0, 3)):
        key = rng.choice(sorted(event))
        if key == "ts":
            event[key] = rng.choice(SKEWED_TS)
            continue
        event[key] = rng.choice([
            rng.choice(ODD_STRINGS), rng.choice(SKEWED_TS), -rng.randrange(10**6),
            rng.random() * 10**rng.randrange(20), "x" * rng.choice([10, 4_000, 30_000]),
            nested(rng.choice([5, 200])), [1, "a", None], {"a": {"b": []}}, 2**53,
        ])
    if kind < 0.45:
        return json_bytes({"envelope_version": 1,
                           "events": [event, *(dict(event, step=i) for i in range(3))]})
    return json_bytes(event)


def test_far_future_timestamps_are_stored_as_sent_or_dead_lettered(hostile_db):
    """Far-future stamps: what ClickHouse can hold (to 2299) is stored as sent; later
    ones are dead letters with the reason, never accepted and then mangled."""
    harness = new_harness()
    run_id = f"future-{uuid.uuid4().hex}"
    base = {"event_type": "step", "run_id": run_id, "agent": "hostile", "step": 1}
    work = harness.feed([json_bytes({**base, "ts": ts}) for ts in FAR_FUTURE_TS])
    assert (harness.events, harness.dead) == (1, 2)
    assert all(f"outside {TS_RANGE}" in letter.reason for letter in work.dead)
    insert_all(hostile_db, harness.rows)
    assert counts(hostile_db, "events", run_id) == 1
    stored = [row[0].year for row in hostile_db.query(
        f"SELECT ts FROM {HOSTILE_DB}.events WHERE run_id = {{r:String}}",
        parameters={"r": run_id}).result_rows]
    assert stored == [2028]


def test_a_far_future_stamp_does_not_cost_an_out_of_order_run_its_counts():
    harness = new_harness()
    good_id = f"good-{uuid.uuid4().hex}"
    events = good_run(good_id, "hostile-good")
    skewed = {"event_type": "step", "run_id": "skewed", "agent": "x", "step": 1}
    harness.feed([json_bytes(events[2])])  # an llm.call before its run.start
    year_2200_ms = 7_258_118_400_000  # far ahead, yet inside what ClickHouse stores
    harness.feed([json_bytes({**skewed, "ts": year_2200_ms - 2 * 86_400_000})])
    harness.feed([json_bytes({**skewed, "ts": year_2200_ms})])
    harness.feed([json_bytes(event) for event in events[:2] + events[3:]])
    assert_good_row(latest_run_row(harness.rows, good_id), good_id)


def test_future_clock_skew_does_not_move_event_time():
    """Clock skew: one agent's event stamped a year ahead is stored, counted as a future
    event, and does not move event time, so no other open run is abandoned for it; the
    good run ends as it should, never revised."""
    harness = new_harness()
    good_id = f"good-{uuid.uuid4().hex}"
    events = good_run(good_id, "hostile-good")
    harness.feed([json_bytes(event) for event in events[:-1]])
    skewed = {**TEMPLATES["step"], "event_type": "step", "run_id": "skewed", "agent": "x",
              "ts": int(NOW_S * 1000) + 365 * 86_400_000}
    harness.feed([json_bytes(skewed)])
    state = harness.pipeline.store.get(good_id)
    assert state is not None and state.abandoned_ms is None and state.outcome == ""
    assert harness.pipeline.counters.future_events == 1
    harness.feed([json_bytes(events[-1])])
    assert_good_row(latest_run_row(harness.rows, good_id), good_id)
    assert harness.pipeline.counters.runs_revised == 0
    assert [row["run_id"] for row in raw_events(harness.rows)].count("skewed") == 1


def test_an_event_nested_300_deep_is_a_dead_letter_not_a_crash():
    """Extras may nest 64 levels; deeper ones (which storage could not re-encode beyond
    254) are dead letters with the reason."""
    work = new_harness().feed([json_bytes(
        {"event_type": "annotation", "run_id": "r", "agent": "a", "kind": "deploy",
         "nested": nested(depth)})
        for depth in (60, 100, 300)])
    assert len(raw_events(work.rows)) == 1
    assert [letter.reason for letter in work.dead] == [
        "schema violation: annotation: Value error, nested: nested deeper than 64 levels",
        "nested deeper than 254 levels"]


def test_a_count_beyond_64_bits_is_a_dead_letter_not_a_crash():
    work = new_harness().feed([json_bytes(
        {"event_type": "llm.call", "run_id": "r", "agent": "a", "input_tokens": 2**64})])
    assert len(work.dead) == 1


def test_an_extra_integer_beyond_64_bits_is_stored_digit_for_digit(hostile_db):
    """An unknown field holding such an integer (a 30-digit id) made storing its message
    raise (orjson writes 64 bits at most), and the batch with it, stalling the partition.
    It is stored as sent, next to the 64-bit bounds."""
    values = [2**64 - 1, -(2**63), 2**64, 123456789012345678901234567890]
    harness = new_harness()
    work = harness.feed([json_bytes({"event_type": "step", "run_id": "big-ints", "agent": "a",
                                     "step": 1, "x": value}) for value in values])
    assert work.dead == []
    insert_all(hostile_db, harness.rows)
    stored = hostile_db.query(f"SELECT payload, extras['x'] FROM {HOSTILE_DB}.events "
                              "WHERE run_id = 'big-ints' ORDER BY kafka_offset").result_rows
    assert [extra for _, extra in stored] == [str(value) for value in values]
    assert [orjson.loads(payload)["x"] for payload, _ in stored[:2]] == values[:2]
    assert [payload.endswith(f'"x":{value}}}') for (payload, _), value in
            zip(stored, values, strict=True)] == [True] * 4


def test_an_envelope_with_a_bad_event_keeps_its_neighbours_integers_exact(hostile_db):
    """An envelope holding one invalid event is decoded event by event; that path read
    numbers as floats past 64 bits, so a neighbour's 30-digit id was stored rounded
    (``1.2345678901234568e+29``). It is stored as sent, and the bad event is a dead
    letter with its reason."""
    big = 123456789012345678901234567890
    base = {"event_type": "step", "run_id": "big-ints-envelope", "agent": "a"}
    value = json_bytes({"envelope_version": 1, "events": [
        {**base, "step": 1, "x": big}, {**base, "step": -1}, {**base, "step": 2, "x": -big}]})
    harness = new_harness()
    work = harness.feed([value])
    assert [letter.reason for letter in work.dead] == [
        "schema violation: step.step: Input should be greater than or equal to 0"]
    insert_all(hostile_db, harness.rows)
    stored = hostile_db.query(
        f"SELECT extras['x'], payload FROM {HOSTILE_DB}.events "
        "WHERE run_id = 'big-ints-envelope' ORDER BY ts, event_id").result_rows
    assert sorted(extra for extra, _ in stored) == sorted([str(big), str(-big)])
    assert sorted(payload.endswith(f'"x":{extra}}}') for extra, payload in stored) == [
        True, True]


def test_a_message_that_cannot_be_stored_is_a_dead_letter_and_the_batch_goes_on():
    """Past 64 bits the standard library writes the extras, and it refuses an infinite
    float (``1e400`` parses as one): that message's events cannot be stored, so it is
    dead-lettered whole, with the error, and none of its events is folded."""
    harness = new_harness()
    good_id = f"good-{uuid.uuid4().hex}"
    unstorable = json_bytes({"event_type": "step", "run_id": "unstorable", "agent": "a",
                             "step": 1, "x": [2**64, 1.0]}).replace(b"1.0]", b"1e400]")
    work = harness.feed([unstorable, *(json_bytes(event)
                                       for event in good_run(good_id, "hostile-good"))])
    assert [(letter.reason, letter.payload) for letter in work.dead] == [
        ("processing failed: ValueError: Out of range float values are not JSON compliant",
         unstorable)]
    assert harness.pipeline.counters.processing_errors == 1
    assert harness.pipeline.store.get("unstorable") is None
    assert_good_row(latest_run_row(harness.rows, good_id), good_id)


def test_messages_nested_beyond_the_parser_limit_are_dead_letters():
    """1200 and 3000 levels (beyond any JSON parser's limit here), alone and inside an
    envelope's event: dead letters with a reason, never an exception."""
    deep_event = {"event_type": "step", "run_id": "r", "agent": "a", "step": 1}
    values = [nested_bytes(1200), nested_bytes(3000),
              json_bytes({"envelope_version": 1, "events": [
                  {**deep_event, "nested": nested(1200)}, deep_event]}),
              json_bytes({**deep_event, "nested": nested(3000)})]
    work = new_harness().feed(values)
    assert len(work.dead) == len(values)
    assert all(letter.reason for letter in work.dead)


def test_an_epoch_ts_beyond_any_date_is_a_dead_letter_not_a_crash():
    work = new_harness().feed(
        [b'{"event_type": "step", "run_id": "r", "agent": "a", "step": 1, "ts": 1e300}'])
    assert [letter.reason[:16] for letter in work.dead] == ["schema violation"]


BUGGY_MODEL = "gpt-4o"


@dataclass(frozen=True)
class PricesWithABug(PriceTable):
    """Stands in for a loopwatch bug (the only fake in this module: no input is known
    to make the fold raise, which is the point): pricing raises for one model."""

    def dollars(self, model: str, *args: Any, **kwargs: Any) -> float:
        """Where every price comes from (``cost`` calls it too)."""
        if model == BUGGY_MODEL:
            raise ZeroDivisionError("planted bug")
        return super().dollars(model, *args, **kwargs)


def test_an_event_the_fold_raises_on_is_a_dead_letter_and_is_applied_when_replayed(
        hostile_db):
    """An event whose processing raises is dead-lettered with the error as its reason and
    counted; every other event of the batch, its own run's included, is folded, and all
    of them are stored. Replayed once the bug is gone, it is applied exactly once."""
    harness = new_harness()
    shipped = PriceTable.load()
    harness.pipeline.prices = PricesWithABug(
        **{f.name: getattr(shipped, f.name) for f in fields(PriceTable)})
    good_id, hit_id = f"good-{uuid.uuid4().hex}", f"hit-{uuid.uuid4().hex}"
    hit_events = good_run(hit_id, "hostile-hit")
    hit_events[5]["model"] = BUGGY_MODEL
    values = [json_bytes(event) for event in good_run(good_id, "hostile-good") + hit_events]
    work = harness.feed(values)

    (letter,) = work.dead
    assert letter.reason == "processing failed: ZeroDivisionError: planted bug"
    assert letter.run_id == hit_id
    assert orjson.loads(letter.payload)["event_id"] == hit_events[5]["event_id"]
    assert harness.pipeline.counters.processing_errors == 1
    assert len(raw_events(work.rows)) == len(values)
    assert_good_row(latest_run_row(harness.rows, good_id), good_id)
    hit = latest_run_row(harness.rows, hit_id)
    assert (hit["outcome"], hit["steps"], hit["llm_calls"], hit["tool_calls"],
            hit["input_tokens"]) == ("success", 2, 1, 1, 1000)

    harness.pipeline.prices = shipped
    harness.feed([letter.payload])
    hit = latest_run_row(harness.rows, hit_id)
    assert (hit["llm_calls"], hit["input_tokens"], hit["output_tokens"]) == (2, 2000, 200)
    assert harness.pipeline.counters.duplicates == 0
    assert insert_all(hostile_db, harness.rows) == len(harness.rows)
    assert counts(hostile_db, "events", hit_id) == len(hit_events)
    assert counts(hostile_db, "llm_calls", hit_id) == 2
    assert stored_run(hostile_db, good_id) == GOOD_STORED


def damaged_state(run_id: str, last_ms: int) -> RunState:
    """An open run's state the pipeline raises on: a start time no date has (in the year
    31,690,708). It has the field's type, which is all ``RunState.from_dict`` checks of
    a state from the changelog or ClickHouse (``test_changelog.py``) and all the
    compiled class can (it refuses a value of another type when it is built): the
    guards are for damage no reader foresaw."""
    return RunState(run_id=run_id, partition=0, agent="hostile-damaged", first_ms=last_ms,
                    last_ms=last_ms, started_ms=10**18, steps=3)


def test_a_damaged_run_state_costs_its_own_run_not_the_batch_nor_the_sweep(hostile_db):
    """A run state the pipeline raises on outside any one event (building its row) is
    logged and counted, and that run alone gets no row: the batch it was folded in, and
    a sweep that abandons it with other runs, store everything else exactly. Its events
    are stored."""
    harness = new_harness()
    now_ms = int(NOW_S * 1000)
    folded_id, swept_id, good_id = (f"{kind}-{uuid.uuid4().hex}"
                                    for kind in ("damaged", "damaged", "good"))
    stale_id = f"stale-{uuid.uuid4().hex}"
    lookup = harness.pipeline.lookup_run
    harness.pipeline.lookup_run = lambda run_id: (
        damaged_state(folded_id, now_ms - 5000) if run_id == folded_id else lookup(run_id))
    step = {"event_type": "step", "event_id": str(uuid.uuid4()), "ts": now_ms - 1000,
            "run_id": folded_id, "agent": "hostile-damaged", "step": 3}
    values = [json_bytes(step)] + [json_bytes(event) for event in good_run(good_id, "hostile-good")]

    work = harness.feed(values)

    assert work.dead == []
    assert harness.pipeline.counters.processing_errors == 1
    assert len(raw_events(work.rows)) == len(values)
    assert_good_row(latest_run_row(harness.rows, good_id), good_id)
    assert not [row for row in harness.rows.tables["runs"] if row["run_id"] == folded_id]

    an_hour_ago = now_ms - 3_600_000
    stale = RunState(run_id=stale_id, partition=0, agent="hostile-stale",
                     first_ms=an_hour_ago, last_ms=an_hour_ago, steps=1)
    assert harness.pipeline.adopt([damaged_state(swept_id, an_hour_ago), stale]) == 2
    swept = harness.pipeline.sweep()

    assert [row["run_id"] for row in swept.rows.tables["runs"]] == [stale_id]
    assert harness.pipeline.counters.processing_errors == 2
    assert harness.pipeline.counters.runs_abandoned == 1
    harness.rows.extend(swept.rows)
    assert insert_all(hostile_db, harness.rows) == len(harness.rows)
    assert stored_run(hostile_db, good_id) == GOOD_STORED
    assert stored_run(hostile_db, stale_id) == [("closed", "abandoned", 1, 0, 0, 0, 0, 0.0)]
    assert stored_run(hostile_db, folded_id) == stored_run(hostile_db, swept_id) == []
    assert counts(hostile_db, "events", folded_id) == 1


def test_a_10_mb_message_is_one_dead_letter_cut_to_the_bound(hostile_db):
    """Its letter (row and record) keeps the first ``payload_limit`` bytes, with the whole
    message's size and sha256 in its reason and headers; the good run beside it is
    exact. The whole 10 MB letter was what the producer refused forever."""
    harness = new_harness()
    limit = payload_limit(harness.pipeline.settings)
    big = b'{"event_type": "step", "run_id": "big", "pad": "' + b"x" * 10_485_760 + b'"}'
    good_id = f"good-{uuid.uuid4().hex}"
    work = harness.feed([big, *(json_bytes(e) for e in good_run(good_id, "hostile-good"))])
    (letter,) = work.dead
    digest = hashlib.sha256(big).hexdigest()
    assert (letter.payload, letter.size, letter.sha256) == (big[:limit], len(big), digest)
    assert letter.reason == (f"oversized message: {len(big)} bytes > {MAX_MESSAGE_BYTES}; "
                             f"payload cut: {len(big)} bytes, sha256 {digest}, "
                             f"first {limit} bytes kept")
    assert dict(letter.headers())["loopwatch-payload-kept"] == str(limit).encode()
    (row,) = work.rows.tables["dead_letters"]
    assert (row["reason"], row["payload"]) == (letter.reason, big[:limit].decode())
    assert_good_row(latest_run_row(harness.rows, good_id), good_id)
    assert insert_all(hostile_db, harness.rows) == len(harness.rows)


def test_a_10_mb_capture_message_is_one_dead_letter_cut_to_the_bound():
    """The captures topic's refusals go through the same bound."""
    from datetime import UTC, datetime

    from loopwatch.processors.capture import CaptureStage

    limit = 50_000
    big = b'{"capture_version": 1, "pad": "' + b"x" * 10_485_760 + b'"}'
    work = CaptureStage(limit).process([RawMessage("loopwatch.captures", 0, 7, big)],
                                       datetime.now(UTC))
    (letter,) = work.dead
    assert (len(letter.payload), letter.size, letter.cut) == (limit, len(big), True)
    assert letter.reason.startswith("capture: ")
    assert letter.reason.endswith(f"; payload cut: {len(big)} bytes, sha256 "
                                  f"{hashlib.sha256(big).hexdigest()}, first {limit} bytes kept")
    assert work.rows.tables["dead_letters"][0]["payload"] == big[:limit].decode()
