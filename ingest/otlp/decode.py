"""OTLP trace requests (protobuf or OTLP/JSON) to one internal span form.

Both encodings end as the same :class:`Span`, so the mapping is written once. IDs are
lower-case hex (as OTLP/JSON spells them), times are integer nanoseconds, attribute
values are plain Python (str, int, float, bool, list, dict; bytes as hex).

A body that cannot be read at all raises :class:`PayloadError` (the receiver answers
400 with its message). In OTLP/JSON one malformed span does not cost the batch: it
comes back as a :class:`BadSpan` with the reason, and the receiver dead-letters it.
Protobuf has no such middle ground: it parses whole or not at all.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any

import orjson
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2
_STATUS_NAMES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


#: the protobuf integer types OTLP uses, as (lowest, highest)
_INT_RANGES = {"int64": (-(2**63), 2**63 - 1), "fixed64": (0, 2**64 - 1)}


class PayloadError(ValueError):
    """The request body is not an OTLP trace request; the message says why."""


@dataclass(slots=True)
class SpanEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(slots=True)
class Span:
    """One span, whatever encoding it arrived in. ``resource`` is shared by its siblings."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""
    status_code: int = STATUS_UNSET
    status_message: str = ""
    kind: int = 0
    events: list[SpanEvent] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """A readable OTLP/JSON-like rendering, kept in dead letters."""
        return {
            "traceId": self.trace_id, "spanId": self.span_id,
            "parentSpanId": self.parent_span_id, "name": self.name, "kind": self.kind,
            "startTimeUnixNano": str(self.start_ns), "endTimeUnixNano": str(self.end_ns),
            "status": {"code": self.status_code, "message": self.status_message},
            "attributes": self.attributes, "resource": self.resource, "scope": self.scope,
            "events": [{"name": e.name, "timeUnixNano": str(e.time_ns),
                        "attributes": e.attributes} for e in self.events],
        }


@dataclass(frozen=True, slots=True)
class BadSpan:
    """A span the decoder could not read (OTLP/JSON only), with why."""

    reason: str
    raw: Any
    trace_id: str = ""


@dataclass(slots=True)
class DecodedRequest:
    spans: list[Span]
    bad: list[BadSpan]


# -- protobuf -------------------------------------------------------------------------


def _pb_value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "string_value":
        return value.string_value
    if which == "int_value":
        return value.int_value
    if which == "double_value":
        return value.double_value
    if which == "bool_value":
        return value.bool_value
    if which == "array_value":
        return [_pb_value(item) for item in value.array_value.values]
    if which == "kvlist_value":
        return _pb_attributes(value.kvlist_value.values)
    if which == "bytes_value":
        return value.bytes_value.hex()
    return None


def _pb_attributes(pairs: Any) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for pair in pairs:
        kv: KeyValue = pair
        result[kv.key] = _pb_value(kv.value)
    return result


def decode_protobuf(body: bytes) -> DecodedRequest:
    """``application/x-protobuf``: an ``ExportTraceServiceRequest``."""
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise PayloadError(f"malformed protobuf ExportTraceServiceRequest: {exc}") from None
    spans: list[Span] = []
    for resource_spans in request.resource_spans:
        resource = _pb_attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope.name
            for span in scope_spans.spans:
                events = [SpanEvent(e.name, e.time_unix_nano, _pb_attributes(e.attributes))
                          for e in span.events] if len(span.events) else []
                spans.append(Span(
                    span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                    span.name, span.start_time_unix_nano, span.end_time_unix_nano,
                    _pb_attributes(span.attributes), resource, scope, span.status.code,
                    span.status.message, span.kind, events,
                ))
    return DecodedRequest(spans, [])


# -- OTLP/JSON ------------------------------------------------------------------------


def _get(obj: dict[str, Any], camel: str, snake: str, default: Any = None) -> Any:
    """Protobuf JSON accepts lowerCamelCase and the original field names alike."""
    value = obj.get(camel)
    if value is None:
        value = obj.get(snake, default)
    return default if value is None else value


def _json_id(value: Any, size: int, what: str) -> str:
    """OTLP/JSON ids are hex; base64 (a generic protobuf JSON encoder's output) is
    accepted too, since the byte length tells them apart."""
    if value in (None, ""):
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{what} is not a string: {value!r}")
    if len(value) == 2 * size:
        try:
            bytes.fromhex(value)
            return value.lower()
        except ValueError:
            pass
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) == size:
        return raw.hex()
    raise ValueError(f"{what} {value!r} is neither {2 * size} hex digits nor base64 of "
                     f"{size} bytes")


def _json_int(value: Any, what: str, kind: str = "int64") -> int:
    """64-bit fields are decimal strings in OTLP/JSON; plain numbers are accepted too.
    A value outside the field's protobuf type (``int64``, or ``fixed64`` for times) is
    refused, as a protobuf body could not carry it.

    >>> _json_int("-9223372036854775808", "intValue"), _json_int(2**64 - 1, "t", "fixed64")
    (-9223372036854775808, 18446744073709551615)
    >>> _json_int("9223372036854775808", "intValue")
    Traceback (most recent call last):
    ValueError: intValue '9223372036854775808' is outside int64
    """
    if isinstance(value, bool):
        raise ValueError(f"{what} is not an integer: {value!r}")
    integral = isinstance(value, int) \
        or (isinstance(value, str) and value.lstrip("-").isdigit()) \
        or (isinstance(value, float) and value.is_integer())
    if not integral:
        raise ValueError(f"{what} is not an integer: {value!r}")
    number = int(value)
    low, high = _INT_RANGES[kind]
    if not low <= number <= high:
        raise ValueError(f"{what} {value!r:.40} is outside {kind}")
    return number


def _json_value(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    for key in ("stringValue", "string_value"):
        if key in value:
            return value[key]
    for key in ("intValue", "int_value"):
        if key in value:
            return _json_int(value[key], "intValue")
    for key in ("doubleValue", "double_value"):
        if key in value:
            raw = value[key]
            return float(raw) if isinstance(raw, int | float | str) else raw
    for key in ("boolValue", "bool_value"):
        if key in value:
            return bool(value[key])
    for key in ("arrayValue", "array_value"):
        if key in value:
            return [_json_value(item) for item in (value[key] or {}).get("values", [])]
    for key in ("kvlistValue", "kvlist_value"):
        if key in value:
            return _json_attributes((value[key] or {}).get("values", []))
    for key in ("bytesValue", "bytes_value"):
        if key in value:
            return base64.b64decode(value[key]).hex()
    return None


def _json_attributes(pairs: Any) -> dict[str, Any]:
    if not isinstance(pairs, list):
        raise ValueError(f"attributes is not a list: {pairs!r:.80}")
    result: dict[str, Any] = {}
    for pair in pairs:
        if not isinstance(pair, dict) or not isinstance(pair.get("key"), str):
            raise ValueError(f"attribute is not {{key, value}}: {pair!r:.80}")
        result[pair["key"]] = _json_value(pair.get("value"))
    return result


def _json_status(status: Any) -> tuple[int, str]:
    if not isinstance(status, dict):
        return STATUS_UNSET, ""
    code = status.get("code", 0)
    if isinstance(code, str):
        code = _STATUS_NAMES.get(code, int(code) if code.isdigit() else 0)
    return int(code), str(status.get("message", "") or "")


def _json_span(raw: Any, resource: dict[str, Any], scope: str) -> Span:
    if not isinstance(raw, dict):
        raise ValueError("span is not a JSON object")
    events = []
    for event in _get(raw, "events", "events", []):
        events.append(SpanEvent(
            str(event.get("name", "")),
            _json_int(_get(event, "timeUnixNano", "time_unix_nano", 0), "timeUnixNano",
                      "fixed64"),
            _json_attributes(event.get("attributes", [])),
        ))
    code, message = _json_status(raw.get("status"))
    kind = raw.get("kind", 0)
    return Span(
        trace_id=_json_id(_get(raw, "traceId", "trace_id"), 16, "traceId"),
        span_id=_json_id(_get(raw, "spanId", "span_id"), 8, "spanId"),
        parent_span_id=_json_id(_get(raw, "parentSpanId", "parent_span_id"), 8,
                                "parentSpanId"),
        name=str(raw.get("name", "")),
        start_ns=_json_int(_get(raw, "startTimeUnixNano", "start_time_unix_nano", 0),
                           "startTimeUnixNano", "fixed64"),
        end_ns=_json_int(_get(raw, "endTimeUnixNano", "end_time_unix_nano", 0),
                         "endTimeUnixNano", "fixed64"),
        attributes=_json_attributes(raw.get("attributes", [])),
        resource=resource, scope=scope, status_code=code, status_message=message,
        kind=kind if isinstance(kind, int) else 0, events=events,
    )


def _list(obj: dict[str, Any], camel: str, snake: str, where: str) -> list[Any]:
    value = _get(obj, camel, snake, [])
    if not isinstance(value, list):
        raise PayloadError(f"{where}.{camel} is not a list")
    return value


def decode_json(body: bytes) -> DecodedRequest:
    """``application/json``: OTLP/JSON (hex ids, int64 as strings, camelCase keys)."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise PayloadError(f"malformed JSON: {exc}") from None
    if not isinstance(document, dict):
        raise PayloadError("OTLP/JSON body must be an object with resourceSpans")
    spans: list[Span] = []
    bad: list[BadSpan] = []
    for r_index, resource_spans in enumerate(
            _list(document, "resourceSpans", "resource_spans", "request")):
        where = f"resourceSpans[{r_index}]"
        if not isinstance(resource_spans, dict):
            raise PayloadError(f"{where} is not an object")
        resource_object = resource_spans.get("resource") or {}
        if not isinstance(resource_object, dict):
            raise PayloadError(f"{where}.resource is not an object")
        try:
            resource = _json_attributes(resource_object.get("attributes", []))
        except ValueError as exc:
            raise PayloadError(f"{where}.resource: {exc}") from None
        for s_index, scope_spans in enumerate(
                _list(resource_spans, "scopeSpans", "scope_spans", where)):
            if not isinstance(scope_spans, dict):
                raise PayloadError(f"{where}.scopeSpans[{s_index}] is not an object")
            scope_object = scope_spans.get("scope") or {}
            if not isinstance(scope_object, dict):
                raise PayloadError(f"{where}.scopeSpans[{s_index}].scope is not an object")
            scope = str(scope_object.get("name", ""))
            for index, raw in enumerate(_list(scope_spans, "spans", "spans",
                                              f"{where}.scopeSpans[{s_index}]")):
                try:
                    spans.append(_json_span(raw, resource, scope))
                except (ValueError, TypeError, AttributeError) as exc:
                    trace = raw.get("traceId", "") if isinstance(raw, dict) else ""
                    bad.append(BadSpan(
                        f"{where}.scopeSpans[{s_index}].spans[{index}]: {exc}", raw,
                        trace if isinstance(trace, str) else ""))
    return DecodedRequest(spans, bad)
