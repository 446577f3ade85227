"""``events.payload`` by the cut and by the exact path (store/event_views.py, ``payload``)
in the real chdb engine, on events built to break them.

- the payload is the event's non-null fields less the columns, in its order, as JSON
  values equal to what the processors' encoder wrote, whichever route encoded it (the
  msgspec mirror, or pydantic with nulls written);
- wherever the cut applies, the exact path gives the same bytes from the same text;
- the cut applies to the mirror's plain events and to nothing it would get wrong:
  escapes, ``:null`` inside a string, another field order.
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loopwatch.core.config import Settings
from loopwatch.ingest.events import EventBase, Label, LlmCall, RunEnd, Step, ToolCall
from loopwatch.ingest.wire import decode_message, encode_envelope
from loopwatch.processors.rows import EVENT_COLUMNS, validated_events_json
from loopwatch.store.event_views import payload, render

#: text that JSON must escape, or that looks like the JSON around it
TRICKY = st.lists(st.sampled_from(
    ['a', 'é', '😀', '"', '\\', ':', ',', '}', '{', 'null', '"agent":"x"', ':null',
     '"worker_id":"', '\n', '\x00', ' ']), max_size=8).map("".join)


def _query(client: Any, texts: list[bytes], extras: dict[str, str] | None = None
           ) -> list[tuple[str, str, str, int]]:
    """(payload, the own fields by the cut, by the exact path, whether the cut applied)
    of each text, every one with ``extras``."""
    sql = payload()
    rows = client.query(
        "WITH " + ", ".join(sql.aliases)
        + f" SELECT {sql.expression}, {sql.cut}, {sql.exact}, {sql.cut_applies} FROM (SELECT "
        "arrayJoin({texts:Array(String)}) AS event, CAST(mapFromArrays({keys:Array(String)}, "
        "{values:Array(String)}), 'Map(String, String)') AS event_extra)",
        parameters={"texts": [text.decode() for text in texts], "keys": list(extras or {}),
                    "values": list((extras or {}).values())}
    ).result_rows
    return [(str(one), str(cut), str(exact), int(applied))
            for one, cut, exact, applied in rows]


def _expected(text: bytes) -> list[tuple[str, Any]]:
    return [(name, value) for name, value in orjson.loads(text).items()
            if name not in EVENT_COLUMNS and value is not None]


def _mirror_texts(events: list[EventBase]) -> list[bytes]:
    """Each event's object as the processors hand it to ``events_in`` (the mirror's)."""
    decoded = decode_message(encode_envelope(events), 10**7, structs=True)
    assert decoded.events_json is not None
    return [bytes(raw) for raw in msgspec.json.decode(decoded.events_json,
                                                      type=list[msgspec.Raw])]


def _pydantic_texts(events: list[EventBase]) -> list[bytes]:
    events_json, _ = validated_events_json(events)
    return [bytes(raw) for raw in msgspec.json.decode(events_json, type=list[msgspec.Raw])]


def _check(client: Any, texts: list[bytes]) -> list[int]:
    found = _query(client, texts)
    for text, (one, cut, exact, applied) in zip(texts, found, strict=True):
        assert list(orjson.loads(one).items()) == _expected(text), text
        if applied:
            assert cut == exact, text
    return [applied for *_, applied in found]


def _events(run_id: str, agent: str, worker: str, tool: str, args: str, error: str
            ) -> list[EventBase]:
    common: dict[str, Any] = {"run_id": run_id, "agent": agent, "worker_id": worker}
    return [
        Step(**common, step=1, step_type="act", duration_ms=0.0, cost_usd=1e22),
        ToolCall(**common, tool=tool, args_hash=args, latency_ms=280.06526059821925,
                 timeout_ms=8000.0, error_type=error or None, result_count=None),
        LlmCall(**common, model="gpt-4o", input_tokens=9, cost_usd=1e-7, error_type=error),
        Label(**common, verdict="wrong", quality_score=None),
        RunEnd(**common, terminal_reason="model_done"),
    ]


def test_plain_mirror_events_are_cut_and_the_cut_is_the_exact_path(local_store: Any) -> None:
    _, client = local_store
    texts = _mirror_texts(_events("r1", "agent", "", "grep", "h", ""))
    assert _check(client, texts) == [1, 1, 1, 1, 1]
    assert _query(client, texts)[0][0] == '{"step":1,"step_type":"act","duration_ms":0.0,' \
        '"action_type":"","tokens_in":0,"tokens_out":0,"cost_usd":1e22}'


def test_escapes_nulls_in_strings_and_pydantic_order_take_the_exact_path(local_store: Any) -> None:
    _, client = local_store
    odd = _events('r"2', 'a"gent', 'w"1', '"agent":"x"', "x:null", "a\\b")
    assert _check(client, _mirror_texts(odd)) == [0, 0, 0, 0, 0]
    plain = _events("r3", "agent", "", "grep", "x:null", "")
    assert _check(client, _mirror_texts(plain)) == [1, 0, 1, 1, 1]  # ':null' in a string
    assert _check(client, _pydantic_texts(plain)) == [0, 0, 0, 0, 0]  # nulls written


def test_an_object_with_no_own_fields_is_empty_both_ways(local_store: Any) -> None:
    _, client = local_store
    base = orjson.loads(_mirror_texts([RunEnd(run_id="r", agent="a")])[0])
    columns_only = orjson.dumps({name: base[name] for name in base if name in EVENT_COLUMNS})
    assert _query(client, [columns_only, columns_only.replace(b'"agent"', b'"agent":null,'
                                                              b'"agent"', 1)]) \
        == [("{}", "", "", 1), ("{}", "", "", 0)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(agent=TRICKY.filter(bool), worker=TRICKY, tool=TRICKY.filter(bool), args=TRICKY,
       error=TRICKY)
def test_any_text_in_any_field_is_stored_as_its_value(local_store: Any, agent: str,
                                                      worker: str, tool: str, args: str,
                                                      error: str) -> None:
    _, client = local_store
    events = _events("run", agent, worker, tool, args, error)
    _check(client, _mirror_texts(events) + _pydantic_texts(events))


def test_extras_follow_the_own_fields_on_both_paths(local_store: Any) -> None:
    """An OTLP span's event carries extras (the agent claim, the convention...): they
    are appended after its own fields, in their order, whichever path found those, and
    make the whole payload of an event with no own fields."""
    _, client = local_store
    extras = {"otel_agent_rank": "3", "conversation_id": '"conv-1"', "note": '{"a":[1,null]}'}
    tool = ToolCall(run_id="r", agent="a", tool="grep", latency_ms=1.5, timeout_ms=None)
    texts = _mirror_texts([tool]) + _pydantic_texts([tool]) + _mirror_texts(
        [RunEnd(run_id="r", agent="a")])
    found = _query(client, texts, extras)
    assert [applied for *_, applied in found] == [1, 0, 1]
    tail = ',"otel_agent_rank":3,"conversation_id":"conv-1","note":{"a":[1,null]}}'
    own = orjson.loads(texts[0])
    own_text = orjson.dumps({name: value for name, value in own.items()
                             if name not in EVENT_COLUMNS and value is not None}).decode()
    assert [one for one, *_ in found][:2] == [own_text[:-1] + tail] * 2
    assert [list(orjson.loads(one)) for one, *_ in found][2][-3:] == list(extras)
    run_end_own = [name for name in orjson.loads(texts[2]) if name not in EVENT_COLUMNS]
    assert list(orjson.loads(found[2][0])) == run_end_own + list(extras)


def test_the_view_stores_what_the_expression_gives() -> None:
    """The parse view renders :func:`payload` (not a copy of it)."""
    parse_view = render(Settings()).creates[1]
    assert payload().expression + " AS payload" in parse_view
    assert all(alias in parse_view for alias in payload().aliases)
