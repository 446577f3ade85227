"""The throughput work's shortcuts give the same answers as the plain paths they skip.

- decoding: a plainly valid message decodes through the msgspec mirror
  (``tests/test_struct_mirror.py``); one with extras is validated in one pydantic call;
  anything off falls back to event-by-event decoding with exact reasons;
- stored payloads: the event's fields less the columns, whichever route decoded it;
- run state: the compact seen-id form, and states written in the older list form;
- the sweep's deadline index: abandons exactly what a full scan would, also after the
  store changed behind it (a rebalance) and the index was rebuilt.
"""

from __future__ import annotations

import sys
import uuid
from datetime import UTC, datetime, timedelta

import orjson

from loopwatch.core.config import Settings
from loopwatch.ingest.events import LlmCall, RunStart, Step
from loopwatch.ingest.structs import mirror_message
from loopwatch.ingest.wire import _decode_in_one_call, _decode_slow, decode_message, encode_envelope
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.processors.rows import EVENT_COLUMNS, event_json
from loopwatch.processors.runs import (
    SEEN_EVENT_IDS,
    SEEN_PACKED_IDS,
    RunState,
    remember,
    seen_ids,
)
from loopwatch.store.sink import ClickHouseSink

T0 = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)


def _events(run_id: str) -> list[dict[str, object]]:
    common = {"run_id": run_id, "agent": "fast", "ts": T0.isoformat()}
    events: list[dict[str, object]] = [
        {"event_type": "run.start", **common, "step_cap": 5},
        {"event_type": "step", **common, "step": 0, "step_type": "plan"},
        {"event_type": "llm.call", **common, "step": 0, "input_tokens": 100,
         "output_tokens": 7, "surprise": {"kept": [1, 2]}},
    ]
    return [dict(event, event_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"{run_id}:{index}")))
            for index, event in enumerate(events)]


def test_an_envelope_with_extras_is_validated_in_one_call_with_the_same_events():
    value = orjson.dumps({"envelope_version": 1, "events": _events("r-fast")})
    assert mirror_message(value, 1) is None  # the mirror leaves extras to pydantic
    fast = _decode_in_one_call(value)
    slow = _decode_slow(value)
    assert fast is not None and not fast.dead and not slow.dead
    assert [e.model_dump() for e in fast.events] == [e.model_dump() for e in slow.events]
    assert fast.events[2].model_extra == {"surprise": {"kept": [1, 2]}}


def test_one_bad_event_falls_back_and_keeps_each_reason():
    events = _events("r-mixed")
    events.insert(1, {"event_type": "step", "run_id": "r-mixed", "agent": "fast",
                      "step": -1})
    value = orjson.dumps({"envelope_version": 1, "events": events})
    assert mirror_message(value, 1) is None and _decode_in_one_call(value) is None
    decoded = decode_message(value, 1_000_000)
    assert [e.event_type for e in decoded.events] == ["run.start", "step", "llm.call"]
    assert [letter.reason for letter in decoded.dead] == [
        "schema violation: step.step: Input should be greater than or equal to 0"]
    assert decoded.dead[0].run_id == "r-mixed"


def test_the_stored_payload_is_the_event_less_its_columns_and_rebuilds_it_whole(local_store):
    """The payload is every field with a value less the fields ``events`` keeps as
    columns, defaults written out, extras included, whichever route decoded the event
    (the first two through ``events_in``, the third through pydantic and Python rows).
    Columns + payload give back the same event (what ``reprocess`` reads)."""
    _, client = local_store
    run_id = f"payload-{uuid.uuid4().hex[:8]}"
    complete = Step(run_id=run_id, agent="a", step=1, ts=T0)
    complete_bytes = orjson.dumps(complete.model_dump(mode="json"))
    partial_bytes = orjson.dumps({"event_type": "step", "run_id": run_id, "agent": "a",
                                  "step": 1})
    extra_bytes = orjson.dumps(dict(complete.model_dump(mode="json"), step=2,
                                    event_id=str(uuid.uuid4()), surprise={"kept": [1]}))
    assert mirror_message(complete_bytes, 1) is not None
    assert mirror_message(extra_bytes, 1) is None
    pipeline = Pipeline(Settings(), MemoryRunStore(), clock=lambda: T0.timestamp())
    work = pipeline.process([RawMessage("t", 0, 0, complete_bytes),
                             RawMessage("t", 0, 1, partial_bytes),
                             RawMessage("t", 0, 2, extra_bytes)])
    ClickHouseSink(client).write_batch(work.rows)
    rows = list(client.query(
        "SELECT * FROM events WHERE run_id = {r:String} ORDER BY kafka_offset",
        parameters={"r": run_id}).named_results())
    payloads = [orjson.loads(row["payload"]) for row in rows]
    incoming = orjson.loads(complete_bytes)
    assert payloads[0] == {name: value for name, value in incoming.items()
                           if name not in EVENT_COLUMNS and value is not None}
    assert set(payloads[0]) == {"step", "step_type", "duration_ms", "action_type",
                                "tokens_in", "tokens_out", "cost_usd"}
    assert payloads[1]["step_type"] == "act"  # the default, written out for the dashboards
    assert payloads[2] == dict(payloads[0], step=2, surprise={"kept": [1]})
    assert [row["extras"] for row in rows] == [{}, {}, {"surprise": '{"kept":[1]}'}]
    again = [Step.model_validate_json(event_json(row, row["payload"])) for row in rows]
    assert again[0] == complete
    assert again[2].model_extra == {"surprise": {"kept": [1]}} and again[2].step == 2
    # the partial event got its id and time when decoded: the pipeline's own decode
    assert (again[1].event_id, again[1].ts) == (rows[1]["event_id"],
                                                rows[1]["ts"].replace(tzinfo=UTC))
    generated = {"event_id", "ts"}
    rebuilt = decode_message(partial_bytes, 10_000)
    assert again[1].model_dump(exclude=generated) == rebuilt.events[0].model_dump(
        exclude=generated)


def test_run_state_round_trips_and_reads_older_and_newer_builds_states():
    ids = [uuid.uuid4() for _ in range(3)]
    state = RunState(run_id="r", partition=2, agent="a")
    for event_id in ids:
        assert remember(state, event_id.bytes)
    again = RunState.from_dict(orjson.loads(orjson.dumps(state.to_dict())))
    assert seen_ids(again) == [event_id.bytes for event_id in ids]
    assert again.to_dict() == state.to_dict()
    older = dict(state.to_dict(), seen=[str(event_id) for event_id in ids])
    assert seen_ids(RunState.from_dict(older)) == [event_id.bytes for event_id in ids]
    newer = dict(state.to_dict(), retries_by_tool={"search": 2})
    del newer["loop_summary"]
    assert RunState.from_dict(newer).to_dict() == state.to_dict()


def test_run_states_share_their_dimension_strings_however_they_were_built():
    """A run folded from a mirrored event and a run read back from its changelog hold
    the interned copy of each shared string, not one of their own."""
    model = "".join(["claude-", "shared-", "model"])  # built at run time: not interned
    value = orjson.dumps({"event_type": "run.start", "run_id": "r-shared", "agent": "fast",
                          "model": model})
    pipeline = Pipeline(Settings(), MemoryRunStore(), clock=lambda: T0.timestamp())
    pipeline.process([RawMessage("t", 0, 0, value)])
    folded = pipeline.store.get("r-shared")
    assert folded is not None and folded.model is sys.intern(model)
    recovered = RunState.from_dict(orjson.loads(orjson.dumps(folded.to_dict())))
    assert recovered.model is sys.intern(model) and recovered.agent is sys.intern("fast")


def test_a_long_run_switches_its_seen_ids_to_a_dict_and_keeps_the_newest():
    """Packed bytes up to SEEN_PACKED_IDS ids, then an ordered dict capped at
    SEEN_EVENT_IDS; both forms round-trip through the changelog's dict."""
    state = RunState(run_id="r", partition=0)
    ids = [uuid.uuid4().bytes for _ in range(SEEN_EVENT_IDS + 10)]
    for count, event_id in enumerate(ids, start=1):
        assert remember(state, event_id)
        if count == SEEN_PACKED_IDS:
            assert isinstance(state.seen, bytes)
            assert RunState.from_dict(state.to_dict()).seen == state.seen
    assert isinstance(state.seen, dict)
    assert seen_ids(state) == ids[10:]
    assert not remember(state, ids[-1]) and remember(state, ids[0])
    assert seen_ids(RunState.from_dict(state.to_dict())) == seen_ids(state)


def _open_run(pipeline: Pipeline, run_id: str, at: datetime, offset: int) -> None:
    start = RunStart(run_id=run_id, agent="fast", ts=at)
    call = LlmCall(run_id=run_id, agent="fast", ts=at + timedelta(seconds=1))
    pipeline.process([RawMessage("t", 0, offset, encode_envelope([start, call]))])


def test_the_deadline_index_abandons_exactly_the_expired_runs_even_after_a_rebuild():
    settings = Settings(abandon_ttl_s=60, late_allowance_s=0, idle_advance_s=1)
    clock = {"now": T0.timestamp()}
    store = MemoryRunStore()
    pipeline = Pipeline(settings, store, clock=lambda: clock["now"])
    _open_run(pipeline, "early", T0, 0)
    _open_run(pipeline, "late", T0 + timedelta(seconds=50), 1)
    # a run the index never saw: put straight into the store, as changelog recovery does
    recovered = RunState.from_dict(store.get("early").to_dict())  # type: ignore[union-attr]
    recovered.run_id = "recovered"
    store.put(recovered)
    pipeline.invalidate_index()

    clock["now"] = (T0 + timedelta(seconds=90)).timestamp()  # idle: the clock leads
    swept = pipeline.sweep()
    abandoned = sorted(row["run_id"] for row in swept.rows.tables["runs"])
    assert abandoned == ["early", "recovered"]
    assert all(row["outcome"] == "abandoned" for row in swept.rows.tables["runs"])

    clock["now"] = (T0 + timedelta(seconds=200)).timestamp()
    assert [row["run_id"] for row in pipeline.sweep().rows.tables["runs"]] == ["late"]
    assert pipeline.counters.runs_abandoned == 3


def test_run_state_field_types_are_read_from_the_source_as_python_reads_them() -> None:
    """A compiled build keeps ``type`` for RunState's annotations, so the changelog's type
    check reads them from runs.py: the same as ``get_type_hints`` of the source."""
    import typing

    from loopwatch.processors import native, runs

    hints = typing.get_type_hints(native.load_source(runs.__name__).RunState)
    assert runs._declared_types() == {name: hints[name] for name in runs._declared_types()}
    assert hints["started_ms"] == int | None and set(hints) == set(runs._FIELD_TYPES)
