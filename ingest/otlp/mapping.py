"""Spans to contract events: pure, deterministic, one batch at a time.

What a span becomes (see :mod:`loopwatch.ingest.otlp.conventions` for the names read):

- a model call (``chat``/``generate_content``/``text_completion``, OpenInference
  ``LLM``) -> ``llm.call`` with its tokens. Tokens are counted **only** here: agent,
  workflow and chain spans may carry totals, which are ignored, and a model-call span
  wrapping another model-call span of the batch (two instrumentations of one call) is
  skipped in favour of the inner one, so nothing is counted twice;
- a tool call (``execute_tool``, OpenInference ``TOOL``) -> ``tool.call``;
- the outermost agent span of a trace (``invoke_agent``, OpenInference ``AGENT``) ->
  ``run.start`` at its start and ``run.end`` at its end: ``model_done``, or ``crash``
  with ``error_type`` when the span failed (as the SDK's ``with run`` does). A trace with
  GenAI spans but no agent span in the batch gets its run boundaries from its root span;
- anything else -> nothing (counted as ignored).

A run is a trace: ``run_id`` is the trace id, because children are exported before
their parents and often in another batch, so only the trace id is known to every span
of a run whenever it arrives. ``gen_ai.conversation.id`` (or OpenInference
``session.id``) is kept as the ``conversation_id`` extra. Event ids are derived from
trace, span and event type, so a client retrying a batch cannot count it twice.

The agent, one rule for every row of a trace (runs, model and tool calls alike),
whatever the batching and the order its spans arrive in: the trace's agent name
(``gen_ai.agent.name``, or ``agent.name``) from its root span first, else from the
span of the trace that carries one and started first (an agent span starts before the
sub-agents it calls); else the root's resource ``service.name``. A span name is never
an agent name (OpenInference's agent span is often just called ``agent``), and a
sub-agent's own name does not split a run. ``loopwatch.<field>`` span or resource
attributes set any context field (agent, task_type, prompt_version, deployment, ...)
explicitly, and win over the rule: the root's explicit agent is the trace's, another
span's is its own rows'.
One request rarely holds a whole trace (``SimpleSpanProcessor`` exports each child
before its root), so the rule is applied over the spans of the request, and every
event says how far that got it: its claim's rank (:mod:`loopwatch.ingest.attribution`), e.g. a
child alone in its request takes its own resource's ``service.name`` at the lowest
rank. The processors keep each run's best claim, store later rows under it and revise
the rows stored before it came (:mod:`loopwatch.processors.attribution`).
Every event records its span's convention in the ``otel_convention`` extra, and
:class:`MappedBatch` counts the batch's spans per convention.

Spans that cannot be mapped (bad ids, a tool span without a tool name, a token count
that is not a non-negative integer, ...) come back as :class:`Unmapped` with the
reason; the rest of the batch is mapped regardless.

Content (docs/capture.md): given a ``capture`` callable (the receiver passes its
emitter's, which redacts and splits), model and tool spans that carry bodies also
become capture messages, and the ``llm.call`` keeps the parts' hashes and sizes. Read,
first found wins: the prompt from ``gen_ai.system_instructions`` +
``gen_ai.input.messages`` (current conventions), ``gen_ai.prompt`` or the indexed
``gen_ai.prompt.N.*``, the ``gen_ai.{system,user,assistant,tool}.message`` span
events, OpenInference ``input.value``; the response from ``gen_ai.output.messages``,
``gen_ai.completion`` / ``gen_ai.completion.N.*``, ``gen_ai.choice`` events,
``output.value``; a tool's ``gen_ai.tool.call.arguments`` and ``.result``.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import msgspec
import orjson
from pydantic import ValidationError

from loopwatch.ingest import attribution
from loopwatch.ingest.attribution import Claim
from loopwatch.ingest.capture import CaptureMessage, part_hash
from loopwatch.ingest.events import (
    EventBase,
    LlmCall,
    RunEnd,
    RunStart,
    ToolCall,
    canonical_args_hash,
    llm_usage_from_exclusive,
)
from loopwatch.ingest.otlp import conventions as c
from loopwatch.ingest.otlp.decode import STATUS_ERROR, BadSpan, Span
from loopwatch.ingest.structs import claim_struct

log = logging.getLogger(__name__)
EVENT_NAMESPACE = uuid.UUID("6f0a6f1e-3c55-4c1b-9d7e-0c7a1d6b2f10")
_NAMESPACE_BYTES = EVENT_NAMESPACE.bytes
_MAX_DEPTH = 256


class Unmappable(ValueError):
    """This span cannot become an event; the message is the dead letter's reason."""


@dataclass(frozen=True, slots=True)
class Unmapped:
    """A span (or undecodable span) that goes to the dead letters, with why."""

    reason: str
    run_id: str
    span: Any

    def to_message(self) -> bytes:
        """An item the processors dead-letter themselves: its ``event_type`` is no
        contract type, and carries the reason so it shows in ``dead_letters.reason``."""
        return orjson.dumps({
            "event_type": f"unmapped OTLP span: {self.reason}",
            "reason": self.reason,
            "run_id": self.run_id,
            "source": "otlp",
            "otlp_span": self.span,
        }, default=str)


#: Builds an event's capture message from part name -> value (redacting on the way).
CaptureBuilder = Callable[[EventBase, dict[str, Any]], CaptureMessage]


@dataclass(slots=True)
class MappedBatch:
    events: list[EventBase] = field(default_factory=list)
    unmapped: list[Unmapped] = field(default_factory=list)
    conventions: dict[str, int] = field(default_factory=dict)
    ignored: int = 0
    captures: list[CaptureMessage] = field(default_factory=list)


# -- attribute helpers ----------------------------------------------------------------


def first(attributes: dict[str, Any], names: Sequence[str]) -> Any:
    """The value of the first of ``names`` present (and not empty)."""
    for name in names:
        value = attributes.get(name)
        if value is not None and value != "":
            return value
    return None


def _first_named(attributes: dict[str, Any], names: Sequence[str]) -> tuple[str, Any]:
    for name in names:
        value = attributes.get(name)
        if value is not None and value != "":
            return name, value
    return "", None


def token_count(attributes: dict[str, Any], names: Sequence[str]) -> int:
    """A non-negative integer count, or :class:`Unmappable` saying which attribute."""
    name, value = _first_named(attributes, names)
    if value is None:
        return 0
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif ((isinstance(value, float) and value.is_integer())
          or (isinstance(value, str) and value.strip().isdigit())):
        number = int(value)
    if number is None or number < 0:
        raise Unmappable(f"{name} is not a non-negative integer: {value!r}")
    return number


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _ts(nanos: int) -> datetime:
    """A span time; one beyond any date makes the span unmappable (a dead letter)."""
    try:
        return datetime.fromtimestamp(nanos / 1e9, tz=UTC)
    except (OverflowError, OSError, ValueError):
        raise Unmappable(f"span time {nanos} ns is not a date") from None


def _event_id(span: Span, kind: str) -> str:
    """``uuid5(EVENT_NAMESPACE, "trace:span:kind")`` as 32 hex digits, which the event's
    struct and model take as its UUID: ``uuid.UUID``'s constructor alone cost ~1.3 µs
    an event of the receiver's one interpreter.

    >>> s = Span("ab" * 16, "cd" * 8, "", "x", 1, 2, {})
    >>> uuid.UUID(_event_id(s, "llm.call")) == uuid.uuid5(
    ...     EVENT_NAMESPACE, f"{'ab'*16}:{'cd'*8}:llm.call")
    True
    """
    digest = bytearray(hashlib.sha1(
        _NAMESPACE_BYTES + f"{span.trace_id}:{span.span_id}:{kind}".encode()).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # RFC 4122 variant
    return digest.hex()


def _is_hex_id(value: str, size: int) -> bool:
    if len(value) != 2 * size or value.strip("0") == "":
        return False
    try:
        int(value, 16)
    except ValueError:
        return False
    return True


# -- classification -------------------------------------------------------------------


def classify(span: Span) -> tuple[str | None, str | None]:
    """(role, convention) of a span; (None, None) when it is no GenAI span at all."""
    attributes = span.attributes
    kind = attributes.get(c.OPENINFERENCE_KIND)
    if kind is not None:
        return c.OPENINFERENCE_ROLES.get(str(kind).upper(), c.WRAPPER), c.OPENINFERENCE
    operation = attributes.get(c.OPERATION)
    deprecated = not c.DEPRECATED_NAMES.isdisjoint(attributes)
    if operation is None:
        if not deprecated:
            return None, None
        word = span.name.split(" ", 1)[0]
        operation = word if word in c.OPERATION_ROLES else "chat"
    role = c.OPERATION_ROLES.get(str(operation), c.WRAPPER)
    return role, c.GEN_AI_DEPRECATED if deprecated else c.GEN_AI


def _name_after_operation(span: Span, operation: str) -> str:
    head, _, rest = span.name.partition(" ")
    return rest.strip() if head == operation else ""


class _Batch:
    """The batch's span tree: who is whose agent, and which model calls wrap others."""

    def __init__(self, spans: Sequence[Span]) -> None:
        self.spans = spans
        self.by_key = {span.trace_id + span.span_id: span for span in spans}
        self.kinds = [classify(span) for span in spans]
        self.role_of = {span.trace_id + span.span_id: kind[0]
                        for span, kind in zip(spans, self.kinds, strict=True)}
        self.wrapped_models: set[str] = set()
        self.traces_with_agent: set[str] = set()
        self.traces_with_genai: set[str] = set()
        self.trace_convention: dict[str, str] = {}
        self._agent_memo: dict[str, Span | None] = {}
        self.roots: dict[str, Span] = {}
        root_named: dict[str, str] = {}
        named: dict[str, tuple[int, str, str]] = {}
        for span in spans:
            if not span.parent_span_id:
                self.roots.setdefault(span.trace_id, span)
            name = first(span.attributes, c.AGENT_NAME)
            if name is None:
                continue
            if not span.parent_span_id:
                root_named.setdefault(span.trace_id, str(name))
            else:
                earliest = (span.start_ns, span.span_id, str(name))
                if span.trace_id not in named or earliest < named[span.trace_id]:
                    named[span.trace_id] = earliest
        #: each trace's agent claim by the module doc's rule (root first, then earliest)
        self.trace_claim: dict[str, Claim] = {
            trace: Claim(name, attribution.SPAN_AGENT_NAME, start)
            for trace, (start, _, name) in named.items()}
        self.trace_claim.update({trace: Claim(name, attribution.ROOT_AGENT_NAME)
                                 for trace, name in root_named.items()})
        for span, (role, kind) in zip(spans, self.kinds, strict=True):
            if role is None or kind is None:
                continue
            self.traces_with_genai.add(span.trace_id)
            self.trace_convention.setdefault(span.trace_id, kind)
            if role == c.AGENT:
                self.traces_with_agent.add(span.trace_id)
            elif role == c.MODEL:
                for ancestor in self.ancestors(span):
                    key = ancestor.trace_id + ancestor.span_id
                    if self.role_of[key] == c.MODEL:
                        self.wrapped_models.add(key)

    def trace_agent(self, span: Span) -> Claim:
        """The agent of ``span``'s trace by the module doc's rule, as far as this batch
        tells: its agent name, else the root's ``service.name``, else the span's own."""
        claim = self.trace_claim.get(span.trace_id)
        if claim is not None:
            return claim
        root = self.roots.get(span.trace_id)
        service = None if root is None else root.resource.get("service.name")
        if service:
            return Claim(str(service), attribution.ROOT_SERVICE)
        service = span.resource.get("service.name")
        return Claim(str(service) if service else "unknown", attribution.CHILD_SERVICE)

    def ancestors(self, span: Span) -> Iterator[Span]:
        current = span
        for _ in range(_MAX_DEPTH):
            if not current.parent_span_id:
                return
            parent = self.by_key.get(current.trace_id + current.parent_span_id)
            if parent is None or parent is span:
                return
            yield parent
            current = parent

    def agent_of(self, span: Span) -> Span | None:
        """The outermost agent span above ``span`` in this batch: the run's agent, to
        which a sub-agent's calls belong too (as every event of an SDK run does)."""
        key = span.trace_id + span.span_id
        if key not in self._agent_memo:
            found = None
            for ancestor in self.ancestors(span):
                if self.role_of[ancestor.trace_id + ancestor.span_id] == c.AGENT:
                    found = ancestor
            self._agent_memo[key] = found
        return self._agent_memo[key]


# -- context --------------------------------------------------------------------------


def _own_fields(attributes: dict[str, Any], into: dict[str, Any]) -> None:
    for name in c.CONTEXT_FIELDS:
        value = attributes.get(c.OWN_PREFIX + name)
        if value is not None and value != "":
            into[name] = str(value)


def _resource_context(resource: dict[str, Any]) -> dict[str, Any]:
    """The resource's context fields; ``agent`` only when set explicitly
    (``loopwatch.agent``): ``service.name`` is the trace rule's fallback."""
    context: dict[str, Any] = {}
    instance = resource.get("service.instance.id")
    if instance:
        context["worker_id"] = str(instance)
    _own_fields(resource, context)
    return context


class _Mapper:
    def __init__(self, spans: Sequence[Span], structs: bool = False) -> None:
        self.batch = _Batch(spans)
        self.structs = structs
        self._resources: dict[int, dict[str, Any]] = {}
        self._shared: dict[tuple[int, str | None], dict[str, Any]] = {}

    def _apply(self, layer: Span, context: dict[str, Any]) -> None:
        """One span's say on the context: agent version and id, conversation id, and
        ``loopwatch.*`` fields (the agent's name is the trace's, see :meth:`context`)."""
        if c.CONTEXT_NAMES.isdisjoint(layer.attributes):
            return  # most model and tool spans: nothing to read
        for field_name, names in (("agent_version", c.AGENT_VERSION),
                                  ("agent_id", c.AGENT_ID),
                                  ("conversation_id", c.CONVERSATION_ID)):
            value = first(layer.attributes, names)
            if value is not None:
                context[field_name] = str(value)
        _own_fields(layer.attributes, context)

    def context(self, span: Span, agent: Span | None) -> dict[str, Any]:
        """Resource, then the run's agent span, then the span itself (later wins), and
        the trace's agent unless one of them named it explicitly. The first two are
        shared by a run's spans, so they are computed once."""
        run_key = (id(span.resource), None if agent is None else agent.trace_id + agent.span_id)
        shared = self._shared.get(run_key)
        if shared is None:
            shared = self._resources.get(id(span.resource))
            if shared is None:
                shared = _resource_context(span.resource)
                self._resources[id(span.resource)] = shared
            shared = dict(shared)
            if agent is not None:
                self._apply(agent, shared)
            self._shared[run_key] = shared
        context = shared
        if not c.CONTEXT_NAMES.isdisjoint(span.attributes):
            context = dict(shared)
            self._apply(span, context)
        if "agent" in context:  # explicit: the root's decides the trace, another's its own
            return context if span.parent_span_id else {
                **context, **attribution.extras(attribution.EXPLICIT)}
        claim = self.batch.trace_agent(span)
        return {**context, "agent": claim.agent,
                **attribution.extras(claim.rank, claim.named_at)}

    def common(self, span: Span, convention: str, kind: str) -> dict[str, Any]:
        if not _is_hex_id(span.trace_id, 16):
            raise Unmappable(f"invalid trace id {span.trace_id!r}")
        if not _is_hex_id(span.span_id, 8):
            raise Unmappable(f"invalid span id {span.span_id!r}")
        if span.end_ns <= 0:
            raise Unmappable("span has no end time")
        return {
            "event_id": _event_id(span, kind),
            "run_id": span.trace_id,
            "trace_id": span.trace_id,
            "span_id": span.span_id,
            "parent_span_id": span.parent_span_id or None,
            **self.context(span, self.batch.agent_of(span)),
            "otel_convention": convention,
        }


E = TypeVar("E", bound=EventBase)


def _build(mapper: _Mapper, model: type[E], fields: dict[str, Any]) -> E:
    """The event, validated against the contract (a violation dead-letters the span):
    for the receiver, its msgspec struct (:func:`loopwatch.ingest.structs.claim_struct`,
    ~1.5 µs against pydantic's ~6, and encoded in ~0.5 against ~4), which reads as the
    model does; what msgspec refuses is pydantic's to decide, and to word."""
    if mapper.structs:
        try:
            return claim_struct(model, fields)  # type: ignore[no-any-return]
        except (msgspec.ValidationError, ValueError):
            pass
    return model.model_validate(fields)


def error_type(span: Span) -> str | None:
    """``error.type``; for a failed span without it the exception's type, else ``_OTHER``."""
    value = first(span.attributes, c.ERROR_TYPE)
    if value is not None:
        return str(value)
    if span.status_code != STATUS_ERROR:
        return None
    for event in span.events:
        if event.name == "exception" and event.attributes.get("exception.type"):
            return str(event.attributes["exception.type"])
    return "_OTHER"


def _latency_ms(span: Span) -> float:
    return max(0, span.end_ns - span.start_ns) / 1e6


def _http_status(attributes: dict[str, Any]) -> int | None:
    value = first(attributes, c.HTTP_STATUS)
    if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
        return value
    return None


def _llm_call(mapper: _Mapper, span: Span, convention: str) -> LlmCall:
    attributes = span.attributes
    fields = mapper.common(span, convention, "llm.call")
    input_tokens = token_count(attributes, c.INPUT_TOKENS)
    cache_read = token_count(attributes, c.CACHE_READ_TOKENS)
    cache_creation = token_count(attributes, c.CACHE_CREATION_TOKENS)
    if input_tokens < cache_read + cache_creation:
        # Impossible if input included the cache, so the source counted it apart.
        fields.update(llm_usage_from_exclusive(input_tokens, cache_read, cache_creation))
    else:
        fields.update(input_tokens=input_tokens, cache_read_input_tokens=cache_read,
                      cache_creation_input_tokens=cache_creation)
    reasons = first(attributes, c.FINISH_REASONS)
    if isinstance(reasons, list):
        reasons = ",".join(str(reason) for reason in reasons) or None
    ttft_s = _number(first(attributes, c.TIME_TO_FIRST_CHUNK_S))
    operation = attributes.get(c.OPERATION) or attributes.get(c.OPENINFERENCE_KIND)
    fields.update(
        ts=_ts(span.end_ns),
        output_tokens=token_count(attributes, c.OUTPUT_TOKENS),
        model=str(first(attributes, c.REQUEST_MODEL) or ""),
        response_model=str(first(attributes, c.RESPONSE_MODEL) or ""),
        provider=str(first(attributes, c.PROVIDER) or ""),
        latency_ms=_latency_ms(span),
        ttft_ms=None if ttft_s is None else ttft_s * 1000,
        error_type=error_type(span),
        http_status=_http_status(attributes),
        stop_reason=None if reasons is None else str(reasons),
        cost_usd=_number(first(attributes, c.REPORTED_COST)),
        otel_operation=str(operation or "chat"),
    )
    return _build(mapper, LlmCall, fields)


def _tool_arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def _size(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())
    return len(orjson.dumps(value, default=str))


def _tool_call(mapper: _Mapper, span: Span, convention: str) -> ToolCall:
    attributes = span.attributes
    tool = first(attributes, c.TOOL_NAME) or _name_after_operation(span, "execute_tool")
    if not tool:
        raise Unmappable("tool span without a tool name (gen_ai.tool.name / tool.name)")
    tool = str(tool)
    fields = mapper.common(span, convention, "tool.call")
    arguments = first(attributes, c.TOOL_ARGUMENTS)
    # Without recorded arguments every call must look different, or the loop detector
    # (same tool, same args hash) would see a loop in any tool used three times.
    args_hash = (f"?{span.span_id[:15]}" if arguments is None
                 else canonical_args_hash(tool, _tool_arguments(arguments)))
    result = first(attributes, c.TOOL_RESULT)
    call_id = first(attributes, c.TOOL_CALL_ID)
    if call_id is not None:
        fields["tool_call_id"] = str(call_id)
    fields.update(
        ts=_ts(span.end_ns), tool=tool, args_hash=args_hash, latency_ms=_latency_ms(span),
        error_type=error_type(span), http_status=_http_status(attributes),
        result_size_bytes=None if result is None else _size(result),
    )
    return _build(mapper, ToolCall, fields)


def _run_boundaries(mapper: _Mapper, span: Span, convention: str) -> tuple[RunStart, RunEnd]:
    start = mapper.common(span, convention, "run.start")
    end = {**start, "event_id": _event_id(span, "run.end")}
    model = str(first(span.attributes, c.REQUEST_MODEL) or "")
    failure = error_type(span)
    return (
        _build(mapper, RunStart, {**start, "ts": _ts(span.start_ns or span.end_ns),
                                  "model": model}),
        _build(mapper, RunEnd, {**end, "ts": _ts(span.end_ns), "model": model,
                                "terminal_reason": "crash" if failure else "model_done",
                                "error_type": failure}),
    )


# -- content (capture) -----------------------------------------------------------------

_PROMPT_EVENTS = {"gen_ai.system.message": "system", "gen_ai.user.message": "user",
                  "gen_ai.assistant.message": "assistant", "gen_ai.tool.message": "tool"}


def _json_value(value: Any) -> Any:
    """A JSON-typed attribute: structured already, or a string holding JSON."""
    if isinstance(value, str) and value[:1] in ("[", "{"):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def _indexed(attributes: dict[str, Any], prefix: str) -> list[dict[str, Any]] | None:
    """``prefix.N.key`` attributes (the older flattened form) as a list of dicts."""
    found: dict[int, dict[str, Any]] = {}
    for name, value in attributes.items():
        if not name.startswith(prefix):
            continue
        index, _, key = name[len(prefix):].partition(".")
        if index.isdigit() and key:
            found.setdefault(int(index), {})[key] = value
    return [found[index] for index in sorted(found)] if found else None


def _event_message(event: Any, role: str) -> dict[str, Any]:
    attributes = event.attributes
    content = _json_value(attributes.get("content", attributes.get("gen_ai.event.content")))
    if isinstance(content, dict) and ("content" in content or "role" in content):
        return {"role": role, **content}
    message = {"role": str(attributes.get("role") or role)}
    if content is not None:
        message["content"] = content
    for key in ("tool_calls", "id"):
        if key in attributes:
            message[key] = _json_value(attributes[key])
    return message


def span_prompt(span: Span) -> Any:
    """The prompt a model span carries, or None (see the module doc for the order)."""
    attributes = span.attributes
    messages = _json_value(attributes.get("gen_ai.input.messages"))
    if messages is not None:
        instructions = _json_value(attributes.get("gen_ai.system_instructions"))
        if instructions is not None and isinstance(messages, list):
            return [{"role": "system", "parts": instructions}, *messages]
        return messages
    prompt = attributes.get("gen_ai.prompt")
    if prompt is not None:
        return _json_value(prompt)
    indexed = _indexed(attributes, "gen_ai.prompt.")
    if indexed is not None:
        return indexed
    events = [_event_message(event, _PROMPT_EVENTS[event.name]) for event in span.events
              if event.name in _PROMPT_EVENTS]
    if events:
        return events
    instructions = _json_value(attributes.get("gen_ai.system_instructions"))
    if instructions is not None:
        return [{"role": "system", "parts": instructions}]
    return _json_value(attributes.get("input.value"))


def span_response(span: Span) -> Any:
    """The response a model span carries, or None."""
    attributes = span.attributes
    for name in ("gen_ai.output.messages", "gen_ai.completion"):
        value = attributes.get(name)
        if value is not None:
            return _json_value(value)
    indexed = _indexed(attributes, "gen_ai.completion.")
    if indexed is not None:
        return indexed
    choices = [{key: _json_value(value) for key, value in event.attributes.items()}
               for event in span.events if event.name == "gen_ai.choice"]
    if choices:
        return choices
    return _json_value(attributes.get("output.value"))


def _with_capture(event: E, values: dict[str, Any], capture: CaptureBuilder,
                  captures: list[CaptureMessage]) -> E:
    """Build the capture message; an ``llm.call`` keeps its parts' hashes and sizes."""
    values = {name: value for name, value in values.items() if value is not None}
    if not values:
        return event
    try:
        message = capture(event, values)
    except Exception:  # content is a bonus: never lose the span's event over it
        log.exception("could not capture the content of span %s", event.span_id)
        return event
    captures.append(message)
    if getattr(event, "event_type", None) != "llm.call":  # a model or its struct
        return event
    update: dict[str, Any] = {}
    for name in ("prompt", "response"):
        ref = message.parts.get(name)  # type: ignore[call-overload]
        if ref is not None:
            update[f"{name}_hash"] = part_hash(ref)
            update[f"{name}_bytes"] = ref.bytes
    return event.model_copy(update=update)


def _validation_reason(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "event"
    return f"{where}: {error['msg']}"


def map_spans(spans: Sequence[Span], bad: Sequence[BadSpan] = (),
              capture: CaptureBuilder | None = None, *, structs: bool = False) -> MappedBatch:
    """Map one batch as far as possible; see the module doc for what becomes what.
    With ``capture``, span content also becomes ``MappedBatch.captures``. With
    ``structs`` (the receiver) the events are msgspec structs that read as their models
    (:func:`loopwatch.ingest.structs.claim_struct`; the emitter encodes either), where
    the contract allows: the same fields, the same JSON for the processors."""
    mapper = _Mapper(spans, structs)
    batch = mapper.batch
    result = MappedBatch(unmapped=[Unmapped(b.reason, b.trace_id, b.raw) for b in bad])
    starts: list[EventBase] = []
    calls: list[EventBase] = []
    ends: list[EventBase] = []

    def llm(span: Span, convention: str) -> EventBase:
        event = _llm_call(mapper, span, convention)
        if capture is None:
            return event
        return _with_capture(event, {"prompt": span_prompt(span),
                                     "response": span_response(span)},
                             capture, result.captures)

    def tool(span: Span, convention: str) -> EventBase:
        event = _tool_call(mapper, span, convention)
        if capture is None:
            return event
        attributes = span.attributes
        return _with_capture(
            event, {"args": _tool_arguments(first(attributes, c.TOOL_ARGUMENTS)),
                    "output": first(attributes, c.TOOL_RESULT)},
            capture, result.captures)

    for span, (role, convention) in zip(spans, batch.kinds, strict=True):
        is_root_boundary = (not span.parent_span_id and span.trace_id in batch.traces_with_genai
                            and span.trace_id not in batch.traces_with_agent)
        if role is None and not is_root_boundary:
            result.ignored += 1
            continue
        if convention is not None:
            result.conventions[convention] = result.conventions.get(convention, 0) + 1
        convention = convention or batch.trace_convention.get(span.trace_id, c.GEN_AI)
        key = span.trace_id + span.span_id
        try:
            if (role == c.AGENT and batch.agent_of(span) is None) or is_root_boundary:
                start, end = _run_boundaries(mapper, span, convention)
                starts.append(start)
                ends.append(end)
                if role == c.MODEL and key not in batch.wrapped_models:
                    calls.append(llm(span, convention))
                elif role == c.TOOL:
                    calls.append(tool(span, convention))
            elif role == c.MODEL and key not in batch.wrapped_models:
                calls.append(llm(span, convention))
            elif role == c.TOOL:
                calls.append(tool(span, convention))
        except Unmappable as exc:
            result.unmapped.append(Unmapped(str(exc), span.trace_id, span.to_json()))
        except ValidationError as exc:
            result.unmapped.append(Unmapped(_validation_reason(exc), span.trace_id,
                                            span.to_json()))
    result.events = starts + calls + ends
    return result
