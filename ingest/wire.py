"""Kafka message format: one event, or an envelope of events bound for one partition.

A message value is JSON. Either a single event object, or::

    {"envelope_version": 1, "events": [event, event, ...]}

Every event in an envelope must hash (by ``run_id``) to the partition the message is
on, so a run's events stay ordered. Envelopes exist because per-message overhead caps
throughput (kafka-python sends ~8.6k messages/s per process here).

Decoding never raises: what cannot be read comes back as :class:`DeadLetter` with a
reason, so one bad event in an envelope does not cost its neighbours.

Decoding is the processors' hot path, so it has three routes to one result. Most
messages decode in one msgspec pass into structs mirrored from the models
(:mod:`loopwatch.ingest.structs`). A message the mirror does not plainly accept (extras, epoch
times, lenient numbers) is split into its events' raw bytes and validated in one
pydantic call (``TypeAdapter(list[Event]).validate_json``). If that fails too, the
original per-event route decides and words every dead letter exactly as before.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson
from pydantic import TypeAdapter, ValidationError

from loopwatch.ingest.events import (
    SCHEMA_VERSION,
    Event,
    EventBase,
    SchemaVersionError,
    check_schema_version,
    parse_event,
)
from loopwatch.ingest.structs import mirror_claims, mirror_message, mirror_structs

ENVELOPE_VERSION = 1
#: the deepest nesting orjson writes back
MAX_NESTING = 254


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Input that could not become an event, kept verbatim with why."""

    reason: str
    payload: bytes
    run_id: str = ""


@dataclass(frozen=True, slots=True)
class Decoded:
    """A message's valid events and dead letters. ``events_json``: the events as one
    JSON array (:class:`loopwatch.ingest.structs.Mirrored`) when the msgspec mirror decoded the
    whole message, else None; their extras apart
    (:func:`loopwatch.ingest.structs.mirror_claims`)."""

    events: list[EventBase]
    dead: list[DeadLetter]
    events_json: bytes | None = None
    #: with ``events_json``, each event's extras (field -> its JSON), if they have any
    events_extras: list[dict[str, str]] | None = None


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    """The envelope's shape, with each event left as its raw JSON bytes."""

    envelope_version: int
    events: list[msgspec.Raw]


_ENVELOPE = msgspec.json.Decoder(_Envelope)
_EVENT_LIST: TypeAdapter[list[Event]] = TypeAdapter(list[Event])


def nesting_depth(value: Any) -> int:
    """How many lists and objects the deepest path through ``value`` passes, counted
    without recursion: it tells orjson's refusal of depth from its refusal of a number
    past 64 bits by the value itself, not by the words of the error.

    >>> nesting_depth(1), nesting_depth([]), nesting_depth({"a": [1, {"b": []}], "c": {}})
    (0, 1, 4)
    """
    deepest = 0
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth + 1)
        pending.extend((child, depth + 1) for child in node)
    return deepest


def exact_json(value: Any) -> bytes:
    """``value`` as JSON, with orjson, or with the standard library when it holds an
    integer beyond 64 bits (which orjson refuses and pydantic keeps as it was given in
    an unknown field, e.g. a 30-digit id): such a number travels digit for digit.

    >>> exact_json({"id": 123456789012345678901234567890, "name": "é"})
    b'{"id":123456789012345678901234567890,"name":"\xc3\xa9"}'
    """
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode()


def encode_event(event: EventBase) -> bytes:
    return exact_json(event.model_dump(mode="json", exclude_none=True))


#: what :func:`message_value` wraps around a message's events, at most
ENVELOPE_OVERHEAD_BYTES = 64


def message_value(lines: list[bytes]) -> bytes:
    """The Kafka message for encoded events of one partition (see :func:`envelope_chunks`):
    the event itself when alone, else an envelope of them, as :func:`decode_message`
    reads either.

    >>> message_value([b'{"a":1}'])
    b'{"a":1}'
    >>> message_value([b'{"a":1}', b'{"b":2}'])
    b'{"envelope_version":1,"events":[{"a":1},{"b":2}]}'
    >>> len(message_value([b"", b""])) <= ENVELOPE_OVERHEAD_BYTES
    True
    """
    if len(lines) == 1:
        return lines[0]
    return (b'{"envelope_version":' + str(ENVELOPE_VERSION).encode()
            + b',"events":[' + b",".join(lines) + b"]}")


def envelope_chunks(lines: Iterable[bytes], max_events: int,
                    max_bytes: int) -> Iterator[list[bytes]]:
    """One partition's encoded events, in order, as the chunks that each become one
    message: at most ``max_events`` events, and no more than ``max_bytes`` of them
    unless a single event is that large.

    >>> [len(chunk) for chunk in envelope_chunks([b"x" * 10] * 7, 3, 1000)]
    [3, 3, 1]
    >>> [len(chunk) for chunk in envelope_chunks([b"x" * 10] * 4, 10, 25)]
    [2, 2]
    """
    chunk: list[bytes] = []
    size = 0
    for line in lines:
        if chunk and (size + len(line) > max_bytes or len(chunk) >= max_events):
            yield chunk
            chunk, size = [], 0
        chunk.append(line)
        size += len(line) + 1
    if chunk:
        yield chunk


def encode_envelope(events: list[EventBase]) -> bytes:
    """One message for many events; use :func:`encode_event` for a single one."""
    return exact_json(
        {
            "envelope_version": ENVELOPE_VERSION,
            "events": [event.model_dump(mode="json", exclude_none=True) for event in events],
        }
    )


def _validation_reason(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors()[:5]:
        where = ".".join(str(p) for p in error["loc"]) or "event"
        parts.append(f"{where}: {error['msg']}")
    return "schema violation: " + "; ".join(parts)


def decode_one(item: Any, message: bytes = b"") -> EventBase | DeadLetter:
    """One decoded JSON value as an event, or a dead letter saying why.

    ``message`` is what the item came in, kept as the dead letter's payload when the
    item cannot be re-encoded on its own (nested deeper than orjson writes).
    """
    try:
        raw = orjson.dumps(item) if not isinstance(item, bytes) else item
    except RecursionError:
        return DeadLetter(f"nested deeper than {MAX_NESTING} levels", message)
    except TypeError:  # orjson's two refusals here: depth, or integers past 64 bits
        if nesting_depth(item) > MAX_NESTING:
            return DeadLetter(f"nested deeper than {MAX_NESTING} levels", message)
        raw = exact_json(item)
    if not isinstance(item, dict):
        return DeadLetter("not a JSON object", raw)
    run_id = str(item.get("run_id", ""))[:256]
    try:
        check_schema_version(str(item.get("schema_version", SCHEMA_VERSION)))
    except SchemaVersionError as exc:
        return DeadLetter(str(exc), raw, run_id)
    try:
        return parse_event(item)
    except ValidationError as exc:
        return DeadLetter(_validation_reason(exc), raw, run_id)


def decode_message(value: bytes | None, max_bytes: int, *, structs: bool = False) -> Decoded:
    """Decode a message value into events and dead letters (never raises).

    ``structs``: a message the msgspec mirror accepts whole comes back as its validated
    structs (:func:`loopwatch.ingest.structs.mirror_structs`, or
    :func:`loopwatch.ingest.structs.mirror_claims` for the OTLP receiver's events, which
    carry extras), which read as the models do, instead of model instances: the
    processors' fold, which reads fields only, saves building a model per event (and
    pydantic's validation: ~8 µs an OTLP event). Any other message decodes as without it.

    >>> d = decode_message(b'{"envelope_version":1,"events":[{"event_type":"step",'
    ...     b'"run_id":"r","agent":"a","step":1},{"event_type":"nope"}]}', 10_000)
    >>> [e.event_type for e in d.events], d.dead[0].reason[:16]
    (['step'], 'schema violation')
    """
    if value is None:
        return Decoded([], [DeadLetter("empty message (no value)", b"")])
    if len(value) > max_bytes:
        return Decoded(
            [], [DeadLetter(f"oversized message: {len(value)} bytes > {max_bytes}", value)]
        )
    mirrored = (mirror_structs if structs else mirror_message)(value, ENVELOPE_VERSION)
    if mirrored is not None:
        return Decoded(mirrored.events, [], mirrored.as_json)
    if structs:  # the OTLP receiver's events: their extras are known
        claimed = mirror_claims(value, ENVELOPE_VERSION)
        if claimed is not None:
            return Decoded(claimed.events, [], claimed.as_json, claimed.extras)
    fast = _decode_in_one_call(value)
    if fast is not None:
        return fast
    return _decode_slow(value)


def _decode_in_one_call(value: bytes) -> Decoded | None:
    """All events of a well-formed message in one validation; None if anything is off."""
    if value[:1] != b"{":
        return None
    try:
        envelope = _ENVELOPE.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        raws = [value] if b'"envelope_version"' not in value else None
    else:
        if envelope.envelope_version != ENVELOPE_VERSION:
            return None
        raws = [bytes(item) for item in envelope.events]
    if not raws:
        return None
    try:
        events = _EVENT_LIST.validate_json(b"[" + b",".join(raws) + b"]")
    except (ValueError, RecursionError):
        return None
    return Decoded(events, [])  # type: ignore[arg-type]


def parse_exact(value: bytes) -> Any:
    """A JSON document's value with integers beyond 64 bits kept exact (msgspec; orjson
    reads them as floats). A document msgspec refuses is read by orjson, for its value
    or its error, whose reasons (what, line and column) were the dead letters' all
    along."""
    try:
        return msgspec.json.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return orjson.loads(value)


def _decode_slow(value: bytes) -> Decoded:
    """Event by event, with a precise reason for each dead letter."""
    try:
        body = parse_exact(value)
    except (orjson.JSONDecodeError, RecursionError) as exc:
        return Decoded([], [DeadLetter(f"malformed JSON: {exc}", value)])
    if isinstance(body, dict) and "events" in body and "event_type" not in body:
        version = body.get("envelope_version")
        if version != ENVELOPE_VERSION:
            return Decoded([], [DeadLetter(f"unsupported envelope_version {version!r}", value)])
        items = body["events"]
        if not isinstance(items, list):
            return Decoded([], [DeadLetter("envelope 'events' is not a list", value)])
    else:
        items = [body]
    events: list[EventBase] = []
    dead: list[DeadLetter] = []
    for item in items:
        result = decode_one(item, value)
        if isinstance(result, DeadLetter):
            dead.append(result)
        else:
            events.append(result)
    return Decoded(events, dead)
