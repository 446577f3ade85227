"""The msgspec mirror of the event models (``loopwatch.ingest.structs``) agrees with pydantic.

Whatever the mirror accepts, pydantic accepts too, with equal events; whatever it is
unsure of, it hands back (None) and pydantic decides. Inputs are generated per field
from the models' own annotations: valid values, values just outside the bounds, and
the lenient forms pydantic takes and the mirror does not (numbers as strings, epoch
times, extras...). A second property checks that plainly valid events do take the
mirror, so the first cannot pass by the mirror declining everything.
"""

from __future__ import annotations

import functools
import json
import types
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, Literal, Union, get_args, get_origin

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from loopwatch.ingest.events import EVENT_TYPES, SCHEMA_VERSION, TS_MAX, EventBase, Step
from loopwatch.ingest.structs import mirror_message
from loopwatch.ingest.wire import _decode_slow, decode_message

BOUND_NAMES = ("ge", "gt", "le", "min_length", "max_length")


def _bounds(model: type[EventBase], name: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for item in model.model_fields[name].metadata:
        for bound in BOUND_NAMES:
            if hasattr(item, bound):
                found[bound] = getattr(item, bound)
    return found


def _core(annotation: Any) -> tuple[Any, bool]:
    """(type without None, whether None is allowed)."""
    if get_origin(annotation) in (Union, types.UnionType):
        members = [m for m in get_args(annotation) if m is not type(None)]
        return members[0], len(members) < len(get_args(annotation))
    return annotation, False


@functools.cache
def _plain(model: type[EventBase], name: str) -> st.SearchStrategy[Any]:
    """Values a strict reader accepts for the field (one strategy object per field:
    hypothesis validates a strategy the first time it draws from it, and building
    them anew for every draw spent a third of the module's time validating)."""
    kind, optional = _core(model.model_fields[name].annotation)
    bounds = _bounds(model, name)
    if get_origin(kind) is Literal:
        values: st.SearchStrategy[Any] = st.sampled_from(get_args(kind))
    elif kind is bool:
        values = st.booleans()
    elif kind is int:
        values = st.integers(bounds.get("ge", 0), min(bounds.get("le", 2**40), 2**40))
    elif kind is float:
        low = bounds.get("ge", bounds.get("gt", -1e6))
        values = st.floats(low, bounds.get("le", 1e12), allow_nan=False,
                           exclude_min="gt" in bounds)
    elif kind is str:
        values = st.text(min_size=bounds.get("min_length", 0), max_size=12)
    else:
        raise AssertionError(f"no strategy for {model.__name__}.{name}: {kind}")
    return st.one_of(st.none(), values) if optional else values


@functools.cache
def _lenient(model: type[EventBase], name: str) -> st.SearchStrategy[Any]:
    """Values at or past the edges, or of the wrong JSON type."""
    bounds = _bounds(model, name)
    edges = [bounds[b] + d for b in ("ge", "gt", "le") if b in bounds for d in (-1, 0, 1)]
    edges += [bounds[b] + d for b in ("ge", "gt", "le") if b in bounds for d in (-0.5, 0.5)]
    length = [bounds[b] + d for b in ("min_length", "max_length") if b in bounds
              for d in (-1, 0, 1) if bounds[b] + d >= 0]
    return st.one_of(
        st.sampled_from(edges or [0]),
        st.sampled_from(["x" * n for n in length] or ["é" * 3]),
        st.sampled_from(["1", "1.5", "true", True, False, 1, 0, 1.0, -1, 2**70, [], {},
                         None, "", "\u0000"]),
        _plain(model, name),
    )


#: an offset that is not UTC; ``None`` above gives naive times
IST = timezone(timedelta(hours=5, minutes=30))
TIMES = st.one_of(
    st.datetimes(min_value=datetime(1800, 1, 1), max_value=datetime(2400, 1, 1),
                 timezones=st.sampled_from([UTC, None, IST]))
    .map(lambda moment: moment.isoformat()),
    st.sampled_from(["2026-01-01T00:00:00.1234567Z", "2026-01-01T00:00:00.9999995Z",
                     "2026-01-01 00:00:00Z", "2026-01-01t00:00:00z", "2026-01-01T00:00Z",
                     "2026-01-01", "20260101T000000Z", "2026-01-01T24:00:00Z",
                     "2026-01-01T00:00:00+23:59", TS_MAX.isoformat(), "1899-12-31T23:59:59Z",
                     1_700_000_000_000, "1700000000000", "not a time"]),
)
PLAIN_IDS = st.uuids().map(str)
IDS = st.one_of(PLAIN_IDS, st.uuids().map(lambda u: u.hex),
                st.uuids().map(lambda u: "{" + str(u) + "}"), st.just("not-a-uuid"))
PLAIN_TIMES = st.datetimes(min_value=datetime(1990, 1, 1), max_value=datetime(2200, 1, 1),
                           timezones=st.just(UTC)).map(datetime.isoformat)
MODELS = st.sampled_from(EVENT_TYPES)
ONE_IN_16 = st.integers(0, 15)
COIN = st.booleans()
ODD_VERSIONS = st.sampled_from(["1.1", "2.0", "x", 1, "1.0"])
SURPRISES = st.sampled_from([1, {"a": [1]}, None])


@st.composite
def events(draw: st.DrawFn, lenient: bool) -> dict[str, Any]:
    """One event; with ``lenient``, some values (about one in 16) are edge cases."""
    model = draw(MODELS)

    def odd() -> bool:
        return lenient and draw(ONE_IN_16) == 0

    event: dict[str, Any] = {
        "event_type": model.model_fields["event_type"].default,
        "event_id": draw(IDS) if odd() else draw(PLAIN_IDS),
        "ts": draw(TIMES) if odd() else draw(PLAIN_TIMES),
    }
    for name, info in model.model_fields.items():
        if name in event or name in ("event_type", "schema_version"):
            continue
        if info.is_required() or draw(COIN):
            event[name] = draw(_lenient(model, name) if odd() else _plain(model, name))
    if draw(COIN):
        event["schema_version"] = draw(ODD_VERSIONS) if odd() else SCHEMA_VERSION
    if odd():
        event["surprise"] = draw(SURPRISES)
    return event


def _message(items: list[dict[str, Any]], envelope: bool) -> bytes:
    """JSON as a producer might write it (stdlib ``json``: orjson refuses 2**70)."""
    body: Any = {"envelope_version": 1, "events": items} if envelope else items[0]
    return json.dumps(body, ensure_ascii=False).encode()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(events(lenient=True), min_size=1, max_size=4), st.booleans())
def test_what_the_mirror_accepts_pydantic_accepts_as_the_same_events(items, envelope):
    value = _message(items, envelope)
    mirrored = mirror_message(value, 1)
    if mirrored is None:
        return
    reference = _decode_slow(value)
    assert reference.dead == []
    assert mirrored.events == reference.events
    assert [type(event) for event in mirrored.events] == [
        type(event) for event in reference.events]


@settings(max_examples=200, deadline=None)
@given(st.lists(events(lenient=False), min_size=1, max_size=4), st.booleans())
def test_plainly_valid_events_take_the_mirror(items, envelope):
    value = _message(items, envelope)
    mirrored = mirror_message(value, 1)
    assert mirrored is not None
    assert mirrored.events == _decode_slow(value).events
    # what events_in reads: every non-null field, defaults too ("ts" keeps its offset)
    written = [dict(fields, ts=None) for fields in json.loads(mirrored.as_json)]
    assert written == [dict(event.model_dump(mode="json", exclude_none=True), ts=None)
                       for event in mirrored.events]


def test_what_the_mirror_declines_still_decodes_with_pydantic_reasons():
    base = {"event_type": "step", "run_id": "r", "agent": "a", "step": 1}
    cases = {
        "epoch millis": dict(base, ts=1_700_000_000_000),
        "extras": dict(base, surprise={"kept": 1}),
        "7 fractional digits": dict(base, ts="2026-01-01T00:00:00.9999995Z"),
        "minor version": dict(base, schema_version="1.3"),
        "number as string": dict(base, step="4"),
    }
    for why, event in cases.items():
        value = orjson.dumps(event)
        assert mirror_message(value, 1) is None, why
        decoded = decode_message(value, 10_000)
        assert decoded.dead == [] and len(decoded.events) == 1, why
    late = decode_message(orjson.dumps(cases["7 fractional digits"]), 10_000).events[0]
    assert late.ts == datetime(2026, 1, 1, 0, 0, 0, 999999, tzinfo=UTC)  # truncated
    bad = decode_message(orjson.dumps(dict(base, step=-1)), 10_000)
    assert [letter.reason for letter in bad.dead] == [
        "schema violation: step.step: Input should be greater than or equal to 0"]


def test_the_tag_anywhere_decodes_alike_and_a_repeated_tag_is_left_to_pydantic():
    """The SDK writes ``event_type`` first (its models declare it first); earlier SDKs
    wrote it after the base fields, and a producer may put it anywhere: the mirror
    decodes each to the same struct and the same canonical JSON (tag first). A tag
    given twice is not plainly valid: the mirror declines and pydantic's reading (the
    last value) decides, so the two never disagree."""
    step = Step(run_id="r", agent="a", step=1, ts="2026-01-02T03:04:05Z")
    first = step.__pydantic_serializer__.to_json(step, exclude_none=True)
    assert first.startswith(b'{"event_type":"step","event_id":')
    fields = orjson.loads(first)
    tag = fields.pop("event_type")
    orders = {"first": first, "last": orjson.dumps({**fields, "event_type": tag}),
              "middle": orjson.dumps({"run_id": "r", "event_type": tag, **fields})}
    decoded = {where: decode_message(value, 10_000, structs=True)
               for where, value in orders.items()}
    for where, result in decoded.items():
        assert result.dead == [] and result.events_json is not None, where
        (event,) = result.events
        assert (type(event).__name__, event.event_type, event.step, event.event_id,
                event.ts) == ("Step", "step", 1, step.event_id, step.ts), where
        assert result.events_json == decoded["first"].events_json, where
    assert decoded["first"].events_json is not None
    assert decoded["first"].events_json.startswith(b'[{"event_type":"step","event_id":')
    twice = first[:-1] + b',"event_type":"label"}'
    assert mirror_message(twice, 1) is None
    again = decode_message(twice, 10_000, structs=True)
    assert again.events == [] and [letter.reason for letter in again.dead] == [
        "schema violation: label.verdict: Field required"]


def test_mirrored_events_behave_as_validated_ones():
    """Frozen, generated ids and times, fields set, extras: as pydantic builds them."""
    value = b'{"event_type":"step","run_id":"r","agent":"a","step":2}'
    mirrored = mirror_message(value, 1)
    assert mirrored is not None
    (event,) = mirrored.events
    assert isinstance(event, Step) and event.step_type == "act"
    assert event.event_id.version == 7 and event.ts.tzinfo is UTC
    assert event.model_extra == {} and "step" in event.model_fields_set
    assert event.model_copy(update={"step": 3}).step == 3 and event.step == 2
    assert Step.model_validate_json(event.model_dump_json()) == event
    try:
        event.step = 5  # type: ignore[misc]
    except Exception as exc:
        assert "frozen" in str(exc)
    else:
        raise AssertionError("a mirrored event must be frozen like a validated one")
    assert uuid.UUID(str(event.event_id)) == event.event_id


def test_mirrored_events_of_a_model_share_a_fields_set_nothing_changes():
    """The builder hands every instance of a model one fields-set (a copy per event cost
    as much as the event's ``__dict__``): copies, dumps and refused assignments must
    leave it as it was."""
    value = (b'{"envelope_version":1,"events":[{"event_type":"step","run_id":"r","agent":"a",'
             b'"step":1},{"event_type":"step","run_id":"s","agent":"a","step":2}]}')
    mirrored = mirror_message(value, 1)
    assert mirrored is not None
    first, second = mirrored.events
    every_field = set(Step.model_fields)
    copied = first.model_copy(update={"step": 7})
    first.model_copy(deep=True)
    first.model_dump(exclude_unset=True)
    with pytest.raises(ValidationError, match="frozen"):
        second.step = 5  # type: ignore[misc]
    assert copied.step == 7 and copied.model_fields_set is not first.model_fields_set
    assert first.model_fields_set == second.model_fields_set == every_field
    assert (first.step, second.step) == (1, 2)
