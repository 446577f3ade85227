"""msgspec mirrors of the event models: the processors' fastest decode.

pydantic validates an event in ~3.7 µs; msgspec decodes the same JSON into a typed
struct in ~0.9 µs. The mirrors are generated from the models in :mod:`loopwatch.ingest.events`
at import (types, bounds, defaults), so the models stay the only schema, and each
decoded struct becomes an instance of its model without a second validation.

The mirror is strict where pydantic is lenient: unknown fields (extras), epoch-millis
or non-RFC 3339 times, numbers as strings, a schema version other than this build's...
make :func:`mirror_message` return None, and the caller validates the message with
pydantic as before. So the mirror only has to agree with pydantic on what it accepts,
which ``tests/test_struct_mirror.py`` checks on generated input. One known disagreement
is guarded: for a time with more than 6 fractional digits msgspec rounds where pydantic
truncates, so such messages are left to pydantic.
"""

from __future__ import annotations

import itertools
import re
import types
from collections.abc import Callable
from datetime import UTC
from typing import Annotated, Any, NamedTuple, Union, get_args, get_origin

import msgspec
import orjson
from annotated_types import Ge, Gt, Le, MaxLen, MinLen

from loopwatch.ingest.attribution import NAMED_AT_EXTRA, RANK_EXTRA
from loopwatch.ingest.events import EVENT_TYPES, SCHEMA_VERSION, TS_MAX, TS_MIN, EventBase

#: the annotated-types bounds the models use, as msgspec.Meta keywords
_BOUNDS = {Ge: "ge", Gt: "gt", Le: "le", MinLen: "min_length", MaxLen: "max_length"}
#: a 7th fractional digit ending a time string (a float's digits end at ``,`` or ``}``;
#: a string that merely looks like it only costs that message the mirror). One pass
#: over a message, ~0.25 µs per bench event; a prefilter that first looked for "." and 7
#: digits with every digit read as 0 cost 0.2 more, since nearly every envelope holds a
#: float with 7 or more decimals
_SUB_MICROSECOND = re.compile(rb'\.\d{7,}[Zz+"-]')


def _bounded(annotation: Any, metadata: list[Any], where: str) -> Any:
    """``annotation`` with the model's bounds; an optional type gets them inside."""
    bounds: dict[str, Any] = {}
    for item in metadata:
        keyword = _BOUNDS.get(type(item))
        if keyword is None:
            raise TypeError(f"{where}: no msgspec mirror for constraint {item!r}")
        bounds[keyword] = getattr(item, keyword)
    if not bounds:
        return annotation
    meta = msgspec.Meta(**bounds)
    members = get_args(annotation)
    if get_origin(annotation) in (Union, types.UnionType) and type(None) in members:
        (inner,) = (member for member in members if member is not type(None))
        return Annotated[inner, meta] | None
    return Annotated[annotation, meta]


#: factories msgspec treats as an empty collection, which ``omit_defaults`` leaves out
_COLLECTIONS = (list, dict, set, frozenset, tuple, bytearray)


def _always_written(factory: Callable[[], Any]) -> Any:
    """A default msgspec never leaves out of an encoding: with ``omit_defaults`` it
    omits a field equal to a plain default, or an empty collection from a collection
    factory, but never a value from any other factory (so only a collection's is
    wrapped: a struct built with defaults calls each factory, ~9 an event)."""
    if factory in _COLLECTIONS:
        return msgspec.field(default_factory=lambda: factory())
    return msgspec.field(default_factory=factory)


def _constant(value: Any, where: str) -> Callable[[], Any]:
    """A factory of ``value`` called without a Python frame.

    >>> _constant("prod", "Step.traffic_slice")()
    'prod'
    """
    if not isinstance(value, str | int | float | bool):
        raise TypeError(f"{where}: no msgspec mirror for the default {value!r}")
    return itertools.repeat(value).__next__


def mirror(model: type[EventBase], extras: dict[str, type] | None = None
           ) -> type[msgspec.Struct]:
    """A struct with the model's fields, tagged by its ``event_type``; unknown fields
    are an error (pydantic keeps them as extras, so such events take pydantic's path).

    Encoding a struct leaves out exactly its null fields: the only plain defaults are
    the ``None`` ones, and every other default comes from a factory, which
    ``omit_defaults`` never omits. The ``events_in`` view drops nulls anyway; not
    writing them makes the events ~30 % shorter for ClickHouse to parse."""
    fields: list[tuple[str, Any, Any]] = []
    for name, info in model.model_fields.items():
        if name == "event_type":
            continue
        where = f"{model.__name__}.{name}"
        annotation = _bounded(info.annotation, info.metadata, where)
        if info.default_factory is not None:
            default = _always_written(info.default_factory)  # type: ignore[arg-type]
        elif info.is_required():
            default = msgspec.NODEFAULT
        elif info.default is None:
            default = None
        else:
            default = _always_written(_constant(info.default, where))
        fields.append((name, annotation, default))
    if extras is None:
        return msgspec.defstruct(
            model.__name__, fields, kw_only=True, forbid_unknown_fields=True,
            omit_defaults=True, tag_field="event_type",
            tag=str(model.model_fields["event_type"].default), namespace=_model_reads(model))
    fields.extend((name, kind | None, None) for name, kind in extras.items())
    return msgspec.defstruct(
        f"{model.__name__}Claim", fields, kw_only=True, forbid_unknown_fields=True,
        omit_defaults=True, tag_field="event_type",
        tag=str(model.model_fields["event_type"].default),
        namespace={**_model_reads(model), **_CLAIM_READS}, dict=True)


def _model_reads(model: type[EventBase]) -> dict[str, Any]:
    """What the fold and the row builders read from a model besides its fields, for
    the struct to answer the same: ``event_type``, the model's own properties (their
    code, unchanged: ``is_error``, ``uncached_input_tokens``...) and no extras (the
    mirror refuses unknown fields). So the processors fold a struct as they fold its
    model, without building the model (~1 µs an event)."""
    namespace: dict[str, Any] = {
        "event_type": model.model_fields["event_type"].default,
        "extras": property(lambda self: {}),
    }
    for cls in model.__mro__:
        for name, value in vars(cls).items():
            if isinstance(value, property) and name not in namespace:
                namespace[name] = value
        if cls is EventBase:
            break
    return namespace


def _builder(model: type[EventBase]) -> Callable[[msgspec.Struct], EventBase]:
    """Struct -> model instance, set up as pydantic's own ``model_construct`` does
    (``__dict__``, fields set, extras, private), without validating again. Every field
    counts as set: the struct cannot tell a given default from a filled-in one.

    The instances of a model share one fields-set: the models are frozen, so pydantic
    never adds to it, and ``model_copy`` copies it before an update. A copy per event
    cost 1.2 µs, as much as building its ``__dict__``."""
    tag = model.model_fields["event_type"].default
    every_field = set(model.model_fields)
    new = object.__new__
    assign = object.__setattr__
    asdict = msgspec.structs.asdict

    def build(struct: msgspec.Struct) -> EventBase:
        fields = asdict(struct)
        fields["event_type"] = tag
        ts = fields["ts"]
        if ts.tzinfo is not UTC:
            ts = fields["ts"] = ts.replace(tzinfo=UTC) if ts.tzinfo is None \
                else ts.astimezone(UTC)
        if not TS_MIN <= ts <= TS_MAX:
            raise ValueError("ts out of range")
        event = new(model)
        assign(event, "__dict__", fields)
        assign(event, "__pydantic_fields_set__", every_field)
        assign(event, "__pydantic_extra__", {})
        assign(event, "__pydantic_private__", None)
        return event

    return build


MIRRORS: dict[type[msgspec.Struct], Callable[[msgspec.Struct], EventBase]] = {
    mirror(model): _builder(model) for model in EVENT_TYPES
}
#: the mirrors' classes (a struct is never a model: it has no extras)
STRUCTS = frozenset(MIRRORS)
_ANY_EVENT = Union[tuple(MIRRORS)]  # type: ignore[valid-type]  # noqa: UP007


def _decoders(events: Any) -> tuple[msgspec.json.Decoder[Any], msgspec.json.Decoder[Any]]:
    """Decoders of an envelope of ``events`` (a union of structs) and of one event."""
    envelope = msgspec.defstruct("Envelope", [("envelope_version", int),
                                              ("events", list[events])],
                                 forbid_unknown_fields=True)
    return msgspec.json.Decoder(envelope), msgspec.json.Decoder(events)


_ENVELOPE, _EVENT = _decoders(_ANY_EVENT)


_ENCODER = msgspec.json.Encoder()


class Mirrored(NamedTuple):
    """A message's events, and the same events as one JSON array: every non-null field,
    defaults written out, in the models' field order (what the ``events_in`` table
    reads). ``events`` are model instances (:func:`mirror_message`) or the structs
    themselves (:func:`mirror_structs`)."""

    events: list[Any]
    as_json: bytes


def _decoded(value: bytes, envelope_version: int, envelope: msgspec.json.Decoder[Any],
             event: msgspec.json.Decoder[Any]) -> list[Any] | None:
    """A message's structs (an envelope's events, or one event), or None where the fast
    path does not apply: sub-microsecond times, another envelope version, anything the
    decoders refuse, an empty envelope."""
    if _SUB_MICROSECOND.search(value):
        return None
    try:
        if b'"envelope_version"' in value:
            decoded = envelope.decode(value)
            if decoded.envelope_version != envelope_version:
                return None
            structs: list[Any] = decoded.events
        else:
            structs = [event.decode(value)]
    except (msgspec.DecodeError, ValueError, RecursionError):
        return None
    return structs or None


def mirror_structs(value: bytes, envelope_version: int) -> Mirrored | None:
    """Every event of a message (an envelope or one event) as its validated struct, in
    one msgspec pass, and the same events re-encoded (~0.3 µs an event: the processors
    hand ClickHouse this array instead of building rows); None if anything in the
    message is not plainly valid (the caller then asks pydantic).

    A struct reads as its model does (:func:`_model_reads`), with ``ts`` in UTC and
    inside the models' range, as the model's validator makes it; it is not a model
    instance: the processors' fold reads it directly, and :func:`mirror_message` builds
    the models for everyone else.

    >>> mirrored = mirror_structs(b'{"event_type":"llm.call","run_id":"r","agent":"a",'
    ...     b'"ts":"2026-01-02T03:04:05+01:00","input_tokens":9,"cache_read_input_tokens":4}', 1)
    >>> (event,) = mirrored.events
    >>> event.event_type, event.uncached_input_tokens, event.is_error, event.ts.isoformat()
    ('llm.call', 5, False, '2026-01-02T02:04:05+00:00')
    >>> mirrored.as_json[-30:]
    b'"latency_ms":0.0,"attempt":1}]'
    >>> mirror_structs(b'{"event_type":"step","run_id":"r","agent":"a","step":1,'
    ...     b'"ts":"1899-12-31T23:59:59Z"}', 1)
    """
    structs = _decoded(value, envelope_version, _ENVELOPE, _EVENT)
    if structs is None:
        return None
    as_json = _ENCODER.encode(structs)  # as given: before ts is turned to UTC
    for struct in structs:
        if struct.schema_version != SCHEMA_VERSION:
            return None
        ts = struct.ts
        if ts.tzinfo is not UTC:
            ts = struct.ts = ts.replace(tzinfo=UTC) if ts.tzinfo is None \
                else ts.astimezone(UTC)
        if not TS_MIN <= ts <= TS_MAX:
            return None
    return Mirrored(structs, as_json)


def mirror_message(value: bytes, envelope_version: int) -> Mirrored | None:
    """:func:`mirror_structs` with the events as model instances (built from the
    structs without validating again).

    >>> mirrored = mirror_message(b'{"envelope_version":1,"events":[{"event_type":"step",'
    ...     b'"run_id":"r","agent":"a","step":1,"ts":"2026-01-02T03:04:05+01:00",'
    ...     b'"event_id":"0190d5a4-0000-7000-8000-000000000000"}]}', 1)
    >>> (event,) = mirrored.events
    >>> type(event).__name__, event.step, event.ts.isoformat()
    ('Step', 1, '2026-01-02T02:04:05+00:00')
    >>> mirrored.as_json[:64]
    b'[{"event_type":"step","event_id":"0190d5a4-0000-7000-8000-000000'
    >>> mirror_message(b'{"event_type":"step","run_id":"r","agent":"a","step":1,"x":2}', 1)
    """
    mirrored = mirror_structs(value, envelope_version)
    if mirrored is None:
        return None
    try:
        events = [MIRRORS[type(struct)](struct) for struct in mirrored.events]
    except ValueError:
        return None
    return Mirrored(events, mirrored.as_json)


# -- events with the OTLP receiver's extras --------------------------------------------

#: the extras the OTLP receiver writes (loopwatch.ingest.otlp.mapping), as JSON gives them
OTLP_EXTRAS: dict[str, type] = {"agent_id": str, "conversation_id": str, RANK_EXTRA: int,
                                NAMED_AT_EXTRA: int, "otel_convention": str,
                                "otel_operation": str, "tool_call_id": str}
_EXTRA_NAMES = tuple(OTLP_EXTRAS)
#: an extra's key in compact JSON, after another field: only a key is preceded by a
#: comma and a quote (inside a JSON string a quote is escaped), and an accepted message
#: has no objects inside its events (the contract's fields and these extras are scalars)
_EXTRA_KEY = re.compile(rb',"(' + b"|".join(re.escape(name.encode()) for name in OTLP_EXTRAS)
                        + rb')":')


def _claim_copy(self: Any, update: dict[str, Any] | None = None) -> Any:
    """``model_copy`` as the fold calls it (``attribute`` sets a run's agent)."""
    copy = msgspec.structs.replace(self, **(update or {}))
    copy.__pydantic_extra__ = self.__pydantic_extra__
    return copy


_CLAIM_READS: dict[str, Any] = {
    "extras": property(lambda self: dict(self.__pydantic_extra__)),
    "model_copy": _claim_copy,
}

#: struct -> its model, for the events that carry the receiver's extras
CLAIM_MIRRORS: dict[type[msgspec.Struct], type[EventBase]] = {
    mirror(model, OTLP_EXTRAS): model for model in EVENT_TYPES}
_ANY_CLAIM = Union[tuple(CLAIM_MIRRORS)]  # type: ignore[valid-type]  # noqa: UP007


_CLAIM_ENVELOPE, _CLAIM_EVENT = _decoders(_ANY_CLAIM)


class Claimed(NamedTuple):
    """:class:`Mirrored` for events with extras: ``as_json`` leaves the extras out, and
    ``extras`` has each event's, field -> its JSON, in the order the message gave them
    (what ``events_in.event_extras`` takes, as :func:`validated_events_json` makes it)."""

    events: list[Any]
    as_json: bytes
    extras: list[dict[str, str]]


def mirror_claims(value: bytes, envelope_version: int) -> Claimed | None:
    """:func:`mirror_structs` for messages whose events carry the OTLP receiver's
    extras (:data:`OTLP_EXTRAS`, each of the type it writes): validated structs that
    read as their model does, extras included (``__pydantic_extra__``, so the fold
    reads the claim as from a model). None if anything is not plainly so (another
    extra, a null one, JSON with spaces...): the caller asks pydantic.

    >>> claimed = mirror_claims(b'{"event_type":"tool.call","run_id":"r","agent":"a",'
    ...     b'"ts":"2026-01-02T03:04:05Z","tool":"t","otel_agent_rank":1,'
    ...     b'"otel_agent_named_at":0,"otel_convention":"gen_ai"}', 1)
    >>> (event,) = claimed.events
    >>> event.__pydantic_extra__, claimed.extras
    ({'otel_agent_rank': 1, 'otel_agent_named_at': 0, 'otel_convention': 'gen_ai'}, \
[{'otel_agent_rank': '1', 'otel_agent_named_at': '0', 'otel_convention': '"gen_ai"'}])
    >>> b"otel" in claimed.as_json, event.model_copy(update={"agent": "b"}).extras == event.extras
    (False, True)
    """
    structs = _decoded(value, envelope_version, _CLAIM_ENVELOPE, _CLAIM_EVENT)
    if structs is None:
        return None
    keys = [key.decode() for key in _EXTRA_KEY.findall(value)]
    at = 0
    every: list[dict[str, str]] = []
    for struct in structs:
        given = {}
        for name in _EXTRA_NAMES:
            item = getattr(struct, name)
            if item is not None:
                given[name] = item
                setattr(struct, name, None)  # encoded apart, as events_in takes them
        order = keys[at:at + len(given)]
        at += len(given)
        if len(order) != len(given) or given.keys() != set(order):
            return None  # a null or repeated extra, or one no comma precedes
        extra = struct.__pydantic_extra__ = {name: given[name] for name in order}
        every.append({name: _extra_json(item) for name, item in extra.items()})
    if at != len(keys):
        return None
    as_json = _ENCODER.encode(structs)
    for struct in structs:
        if struct.schema_version != SCHEMA_VERSION:
            return None
        ts = struct.ts
        if ts.tzinfo is not UTC:
            ts = struct.ts = ts.replace(tzinfo=UTC) if ts.tzinfo is None \
                else ts.astimezone(UTC)
        if not TS_MIN <= ts <= TS_MAX:
            return None
    return Claimed(structs, as_json, every)


def _extra_json(value: str | int) -> str:
    """An extra's JSON as ``validated_events_json`` writes it (orjson's)."""
    return str(value) if type(value) is int else orjson.dumps(value).decode()


#: each model's claim struct (:data:`CLAIM_MIRRORS` the other way round)
CLAIM_STRUCT_OF: dict[type[EventBase], type[msgspec.Struct]] = {
    model: struct for struct, model in CLAIM_MIRRORS.items()}


def claim_struct(model: type[EventBase], fields: dict[str, Any]) -> Any:
    """The OTLP receiver's event built as :func:`mirror_claims` reads it: ``fields``
    (the model's, and extras of :data:`OTLP_EXTRAS`) validated by msgspec against the
    contract's types and bounds, the extras kept apart in their order. Raises
    :class:`msgspec.ValidationError` (the caller asks pydantic, for its reason) or
    ValueError for a time outside the contract's range.

    >>> from loopwatch.ingest.events import ToolCall
    >>> event = claim_struct(ToolCall, {"run_id": "r", "agent": "a", "tool": "t",
    ...     "otel_convention": "gen_ai", "otel_agent_rank": 0, "ts": TS_MIN})
    >>> encode_claim(event)[-59:]
    b'"attempt":1,"otel_convention":"gen_ai","otel_agent_rank":0}'
    """
    struct: Any = msgspec.convert(fields, CLAIM_STRUCT_OF[model])
    ts = struct.ts
    if ts.tzinfo is not UTC:
        ts = struct.ts = ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)
    if not TS_MIN <= ts <= TS_MAX:
        raise ValueError("ts out of range")
    extras = {name: fields[name] for name in fields if name in OTLP_EXTRAS}
    for name in extras:
        setattr(struct, name, None)
    struct.__pydantic_extra__ = extras
    return struct


def encode_claim(struct: Any) -> bytes:
    """A :func:`claim_struct` (or :func:`mirror_claims`) event as JSON: its fields, then
    its extras in their order (which the store keeps)."""
    body = _ENCODER.encode(struct)
    extras = struct.__pydantic_extra__
    if not extras:
        return body
    return body[:-1] + b"," + orjson.dumps(extras)[1:]
