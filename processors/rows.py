"""Events and run states as ClickHouse rows (column names match the migrations).

Every row carries ``ingested_at``, the processor's wall clock when it built the row's
batch: retention counts from it (store/retention.py), never from event time.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson

from loopwatch.ingest.attribution import EXPLICIT
from loopwatch.ingest.events import Annotation, EventBase, Label, LlmCall, ToolCall
from loopwatch.ingest.wire import exact_json
from loopwatch.processors.pricing import PricedCall
from loopwatch.processors.runs import RunState
from loopwatch.store import event_views, tables

ENVELOPE_COLUMNS = ("agent_version", "task_type", "model", "prompt_version", "deployment",
                    "traffic_slice", "worker_id")


def utc_ms(epoch_ms: int | None) -> datetime | None:
    return None if epoch_ms is None else datetime.fromtimestamp(epoch_ms / 1000, tz=UTC)


#: event fields the ``events`` table keeps as columns, and so leaves out of ``payload``
#: (stored once, not twice: ``payload`` was half of the table's compressed bytes); the
#: store's generated views read the same names
EVENT_COLUMNS = event_views.EVENT_COLUMNS
#: optional fields whose absence the columns store as ''
_OPTIONAL_IDS = event_views.OPTIONAL_IDS

#: the table ClickHouse splits into ``events``, ``llm_calls``, ``tool_calls`` and ``labels``
#: rows (the views of :mod:`loopwatch.store.event_views`): one row per message
EVENTS_IN_TABLE = tables.EVENTS_IN


def events_in_row(partition: int, offset: int, now: datetime, events_json: bytes,
                  extras: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """One message's events for ``events_in``, whose generated views write their
    ``events`` rows (and their ``llm_calls`` / ``tool_calls`` / ``labels`` rows, but
    for :func:`built_here` events): the column fields as columns, every other non-null
    field (defaults written out: the timeline panel reads e.g. ``step_type``) and the
    extras as the ``payload`` object, the extras once more as a map, and where in Kafka
    they came from.

    ``events_json`` is the events as one JSON array of their fields in the models'
    order, no extras, nulls written or left out alike (the mirror's
    :class:`loopwatch.ingest.structs.Mirrored` leaves them out, :func:`validated_events_json`
    writes them); ``extras``, if any, one map per event of extra
    field -> its JSON. Python's share is that array, which the decoder already
    encoded: building and encoding the rows here took ~3 µs an event of the processor's
    single interpreter thread; the view costs ClickHouse's own threads ~2.6 µs an event
    more than inserting built rows did.
    """
    row = {"kafka_partition": partition, "kafka_offset": offset, "ingested_at": now,
           "event_objects": orjson.Fragment(events_json)}
    if extras is not None:
        row["event_extras"] = extras
    return row


def validated_events_json(events: list[EventBase]) -> tuple[bytes, list[dict[str, str]]]:
    """Events pydantic validated (the mirror refused their message, e.g. for extras) in
    the form :func:`events_in_row` takes.

    >>> from loopwatch.ingest.events import Step
    >>> step = Step(run_id="r", agent="a", step=3, surprise=[1], ts="2026-01-02T03:04:05Z")
    >>> events_json, extras = validated_events_json([step])
    >>> orjson.loads(events_json)[0]["ts"], "surprise" in orjson.loads(events_json)[0], extras
    ('2026-01-02T03:04:05Z', False, [{'surprise': '[1]'}])
    """
    dumped = []
    extras = []
    for event in events:
        extra = event.__pydantic_extra__ or {}
        dumped.append(event.model_dump(mode="json", exclude=set(extra)))
        extras.append({key: exact_json(value).decode() for key, value in extra.items()})
    return orjson.dumps(dumped), extras


def event_json(columns: dict[str, Any], payload: str | bytes) -> bytes:
    """The whole event again, from an ``events`` row's :data:`EVENT_COLUMNS` and its
    ``payload`` (the inverse of ``events_in``'s view; rows written before the payload
    left the column fields out hold them twice, with the same values).
    ``tests/test_fast_paths.py`` rebuilds stored events with it.

    >>> from loopwatch.ingest.events import Step
    >>> step = Step(run_id="r", agent="a", step=2, ts="2026-01-02T03:04:05.678Z")
    >>> row = dict(step.model_dump(include=set(EVENT_COLUMNS)), trace_id="", span_id="",
    ...            parent_span_id="")
    >>> Step.model_validate_json(event_json(row, '{"step":2,"step_type":"act"}')) == step
    True
    """
    fields = orjson.loads(payload)
    for name in EVENT_COLUMNS:
        fields[name] = columns[name]
    for name in _OPTIONAL_IDS:
        if not fields[name]:
            del fields[name]
    return orjson.dumps(fields)


def built_here(event: EventBase) -> bool:
    """Whether the processors build the event's ``llm_calls`` / ``tool_calls`` /
    ``labels`` row themselves: only for an event making an agent claim (an OTLP span's),
    whose row takes its run's agent and rank. Every other event's row is written by the
    store's views from the ``events_in`` row alone (:mod:`loopwatch.store.event_views`,
    which leaves out the events carrying the same extra).

    >>> from loopwatch.ingest.events import Step
    >>> built_here(Step(run_id="r", agent="a", step=1)), built_here(
    ...     Step(run_id="r", agent="a", step=1, otel_agent_rank="not a rank"))
    (False, True)
    """
    extra = event.__pydantic_extra__
    return extra is not None and event_views.CLAIM_EXTRA in extra


def event_row(event: EventBase, priced: PricedCall | None, mismatch: bool,
              near_miss_factor: float, now: datetime, agent_rank: int = EXPLICIT
              ) -> tuple[str, dict[str, Any]] | None:
    """(table, row) of an event's call or label row, None for an event without one:
    the Python twin of the store's views (``priced`` and ``mismatch``: an ``llm.call``'s
    price)."""
    if isinstance(event, LlmCall):
        assert priced is not None
        return tables.LLM_CALLS, llm_call_row(event, priced, mismatch, now, agent_rank)
    if isinstance(event, ToolCall):
        return tables.TOOL_CALLS, tool_call_row(event, near_miss_factor, now, agent_rank)
    if isinstance(event, Label):
        return tables.LABELS, label_row(event, now)
    return None


def llm_call_row(event: LlmCall, priced: PricedCall, mismatch: bool, now: datetime,
                 agent_rank: int = EXPLICIT) -> dict[str, Any]:
    """``agent_rank``: how authoritative the row's agent is (loopwatch.processors.attribution)."""
    return {
        "event_id": event.event_id,
        "ts": event.ts,
        "run_id": event.run_id,
        "agent": event.agent,
        "task_type": event.task_type,
        "model": event.model,
        "response_model": event.response_model,
        "provider": event.provider,
        "purpose": event.purpose,
        "prompt_version": event.prompt_version,
        "deployment": event.deployment,
        "traffic_slice": event.traffic_slice,
        "step": event.step,
        "input_tokens": event.input_tokens,
        "output_tokens": event.output_tokens,
        "cache_read_input_tokens": event.cache_read_input_tokens,
        "cache_creation_input_tokens": event.cache_creation_input_tokens,
        "uncached_input_tokens": event.uncached_input_tokens,
        "cache_ttl": event.cache_ttl,
        "token_convention": event.token_convention,
        "cost_usd": priced.cost_usd,
        "reported_cost_usd": event.cost_usd,
        "cost_mismatch": int(mismatch),
        "price_version": priced.price_version,
        "latency_ms": event.latency_ms,
        "ttft_ms": event.ttft_ms,
        "http_status": event.http_status or 0,
        "error_type": event.error_type or "",
        "rate_limited": int(event.http_status == 429),
        "is_error": int(event.is_error),
        "attempt": event.attempt,
        "logical_op_id": event.logical_op_id or "",
        "stop_reason": event.stop_reason or "",
        "system_prompt_hash": event.system_prompt_hash or "",
        "tools_hash": event.tools_hash or "",
        "history_hash": event.history_hash or "",
        "ingested_at": now,
        "agent_rank": agent_rank,
    }


def near_miss(event: ToolCall, factor: float) -> int | None:
    """1 if a timed-out call's true duration was within ``factor`` x its timeout.

    >>> near_miss(ToolCall(run_id="r", agent="a", tool="t", timed_out=True,
    ...                    timeout_ms=1000, late_completion_ms=1250), 1.3)
    1
    """
    if not event.timed_out or event.timeout_ms is None or event.late_completion_ms is None:
        return None
    return int(event.late_completion_ms <= factor * event.timeout_ms)


def tool_call_row(event: ToolCall, near_miss_factor: float, now: datetime,
                  agent_rank: int = EXPLICIT) -> dict[str, Any]:
    return {
        "event_id": event.event_id,
        "ts": event.ts,
        "run_id": event.run_id,
        "agent": event.agent,
        "task_type": event.task_type,
        "model": event.model,
        "prompt_version": event.prompt_version,
        "deployment": event.deployment,
        "traffic_slice": event.traffic_slice,
        "tool": event.tool,
        "args_hash": event.args_hash,
        "step": event.step,
        "latency_ms": event.latency_ms,
        "timeout_ms": event.timeout_ms,
        "timed_out": int(event.timed_out),
        "late_completion_ms": event.late_completion_ms,
        "near_miss": near_miss(event, near_miss_factor),
        "error_type": event.error_type or "",
        "http_status": event.http_status or 0,
        "is_error": int(event.is_error),
        "result_count": event.result_count,
        "result_size_bytes": event.result_size_bytes,
        "attempt": event.attempt,
        "ingested_at": now,
        "agent_rank": agent_rank,
    }


def label_row(event: Label, now: datetime) -> dict[str, Any]:
    return {
        "event_id": event.event_id,
        "ts": event.ts,
        "run_id": event.run_id,
        "agent": event.agent,
        "verdict": event.verdict,
        "label_source": event.label_source,
        "quality_score": event.quality_score,
        "hallucination": None if event.hallucination is None else int(event.hallucination),
        "ingested_at": now,
    }


def annotation_row(event: Annotation, now: datetime) -> dict[str, Any]:
    return {
        "event_id": event.event_id,
        "ts": event.ts,
        "kind": event.kind,
        "agent": event.agent,
        "deployment": event.deployment,
        "model": event.model,
        "prompt_version": event.prompt_version,
        "old_value": event.old_value,
        "new_value": event.new_value,
        "actor": event.actor,
        "message": event.message,
        "ingested_at": now,
    }


def run_row(state: RunState, now: datetime) -> dict[str, Any]:
    closed_ms = state.closed_ms
    started = state.started_ms if state.started_ms is not None else state.first_ms
    return {
        "run_id": state.run_id,
        "agent": state.agent,
        "agent_version": state.agent_version,
        "task_type": state.task_type,
        "model": state.model,
        "prompt_version": state.prompt_version,
        "deployment": state.deployment,
        "traffic_slice": state.traffic_slice,
        "worker_id": state.worker_id,
        "status": "closed" if state.closed else "running",
        "outcome": state.outcome,
        "terminal_reason": state.terminal_reason,
        "cap": state.cap,
        "label_source": state.label_source,
        "started_ts": utc_ms(started),
        "last_event_ts": utc_ms(state.last_ms),
        "closed_ts": utc_ms(closed_ms),
        "steps": state.steps,
        "llm_calls": state.llm_calls,
        "tool_calls": state.tool_calls,
        "tool_errors": state.tool_errors,
        "llm_errors": state.llm_errors,
        "input_tokens": state.input_tokens,
        "output_tokens": state.output_tokens,
        "cache_read_input_tokens": state.cache_read_tokens,
        "cache_creation_input_tokens": state.cache_creation_tokens,
        "cost_usd": state.cost_usd,
        "reported_cost_usd": state.reported_cost_usd,
        "loop_detected": int(state.loop_detected),
        "loop_summary": state.loop_summary,
        "version": state.version,
        "state": orjson.dumps(state.to_dict(with_seen=False)).decode(),
        "ingested_at": now,
    }
