"""The event contract: what an agent emits, version 1.

One pydantic model per ``event_type``; all share :class:`EventBase`. The contract is
additive: unknown fields are kept (``model_extra``, stored as the ``extras`` map), a
newer *minor* ``schema_version`` is accepted, an unknown *major* is rejected (the
processors send it to the dead letters).

Token semantics follow OpenTelemetry GenAI: ``input_tokens`` *includes* cache reads and
cache writes, so uncached input = input - cache_read - cache_creation. Sources that
count the other way (Anthropic's API reports ``input_tokens`` without the cache) are
converted by :func:`llm_usage_from_exclusive`, and the event records which convention
the source used in ``token_convention``.

>>> e = parse_event({"event_type": "tool.call", "run_id": "r1", "agent": "a",
...                  "tool": "search", "latency_ms": 12, "surprise": 1})
>>> e.event_type, e.tool, e.model_extra
('tool.call', 'search', {'surprise': 1})
"""

from __future__ import annotations

import hashlib
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from loopwatch.ingest.ids import time_ordered_uuid

SCHEMA_MAJOR = 1
SCHEMA_MINOR = 0
SCHEMA_VERSION = f"{SCHEMA_MAJOR}.{SCHEMA_MINOR}"

Outcome = Literal[
    "success", "hard_error", "budget_exhausted", "gave_up", "looped", "wrong", "abandoned",
    "unknown",
]
OUTCOMES: tuple[str, ...] = (
    "success",
    "hard_error",
    "budget_exhausted",
    "gave_up",
    "looped",
    "wrong",
    "abandoned",
    "unknown",
)
SILENT_FAILURES: tuple[str, ...] = ("budget_exhausted", "gave_up", "looped", "wrong")
#: ``traffic_slice`` values of traffic that is not production's: stored and shown like any
#: other, but kept out of the alert rules so a load test or a chaos drill never pages
#: (requirements §1.0, "keeping test traffic out of prod SLOs"). ``prod`` and ``canary``
#: are production; a slice not named here counts as production too.
TEST_TRAFFIC_SLICES: tuple[str, ...] = (
    "shadow", "staging", "load_test", "chaos", "eval", "replay",
)
TerminalReason = Literal[
    "model_done", "cannot_complete", "cap", "budget", "loop_detector", "drift_monitor",
    "cancelled", "crash",
]
Cap = Literal["step", "token", "time", "cost", "retry"]

#: What ClickHouse can store: DateTime64(3) spans 1900-01-01 .. 2299-12-31, counts are
#: UInt16/UInt32/UInt64 columns. An event outside these is refused (a dead letter), never
#: accepted and then mangled or refused by the store, which would stall the pipeline.
TS_MIN = datetime(1900, 1, 1, tzinfo=UTC)
TS_MAX = datetime(2299, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
#: the bounds as a dead letter's reason names them
TS_RANGE = (f"{TS_MIN.isoformat(timespec='milliseconds')} .. "
            f"{TS_MAX.isoformat(timespec='milliseconds')}")
U16_MAX = 2**16 - 1
U32_MAX = 2**32 - 1
I64_MAX = 2**63 - 1
#: unknown fields (extras) may nest this deep; orjson writes at most 254 levels
MAX_EXTRA_NESTING = 64
#: per event; a run's sums of these must still fit 64 bits
TOKENS_MAX = 10**12


class SchemaVersionError(ValueError):
    """The event's major schema version is not one this build understands."""


def check_schema_version(version: str) -> str:
    """Accept ``1`` and any ``1.x``; reject other majors and garbage.

    >>> check_schema_version("1.7")
    '1.7'
    >>> check_schema_version("2.0")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ...
    SchemaVersionError: unsupported schema_version major 2 (this build reads 1.x)
    """
    major_text = str(version).split(".", 1)[0]
    if not major_text.isdigit():
        raise SchemaVersionError(f"schema_version {version!r} is not MAJOR.MINOR")
    major = int(major_text)
    if major != SCHEMA_MAJOR:
        raise SchemaVersionError(
            f"unsupported schema_version major {major} (this build reads {SCHEMA_MAJOR}.x)"
        )
    return str(version)


def canonical_args_hash(tool: str, args: Any) -> str:
    """sha256 over ``tool`` and canonical JSON of ``args`` (sorted keys), first 16 hex.

    >>> h = canonical_args_hash
    >>> h("grep", {"b": 1, "a": 2}) == h("grep", {"a": 2, "b": 1}) != h("grep", {"a": 3, "b": 1})
    True
    """
    body = orjson.dumps(args, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    return hashlib.sha256(tool.encode() + b":" + body).hexdigest()[:16]


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether a decoded JSON value nests more than ``limit`` containers deep.

    >>> _deeper_than([[1]], 2), _deeper_than([[[1]]], 2), _deeper_than({"a": 1}, 0)
    (False, True, True)
    """
    if not isinstance(value, dict | list):
        return False
    if limit <= 0:
        return True
    children = value.values() if isinstance(value, dict) else value
    return any(_deeper_than(child, limit - 1) for child in children)


def _now() -> datetime:
    return datetime.now(UTC)


class EventBase(BaseModel):
    """Fields every event carries. OTel names are in :data:`loopwatch.ingest.otel.FIELD_TO_OTEL`."""

    #: numbers must be finite: JSON has no NaN or infinity, but ``1e999`` parses as
    #: infinity, and an infinite latency or cost would poison every aggregate over it
    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True,
                              allow_inf_nan=False)

    #: each event type's tag (a ``Literal`` there). Declared first so that every event
    #: serializes with it first: a tagged union's decoder (the processors' msgspec
    #: mirror) then knows the type before the other fields, without a look-ahead
    event_type: str
    event_id: uuid.UUID = Field(default_factory=time_ordered_uuid,
                                description="dedup key (time-ordered UUIDv7 when generated)")
    schema_version: str = SCHEMA_VERSION
    ts: datetime = Field(default_factory=_now, description=f"event time (UTC), {TS_RANGE}",
                         json_schema_extra={"formatMinimum": TS_MIN.isoformat(),
                                            "formatMaximum": TS_MAX.isoformat()})
    run_id: str = Field(min_length=1, max_length=256)
    trace_id: str | None = None
    span_id: str | None = None
    parent_span_id: str | None = None
    agent: str = Field(min_length=1, max_length=256)
    agent_version: str = ""
    task_type: str = ""
    model: str = ""
    prompt_version: str = ""
    deployment: str = ""
    traffic_slice: str = "prod"
    worker_id: str = ""

    @field_validator("schema_version", mode="before")
    @classmethod
    def _supported_major(cls, value: Any) -> str:
        if value == SCHEMA_VERSION:  # the common case, without parsing (hot path)
            return SCHEMA_VERSION
        return check_schema_version(str(value))

    @field_validator("ts", mode="before")
    @classmethod
    def _epoch_millis(cls, value: Any) -> Any:
        """Accept ISO-8601 strings or epoch milliseconds; naive times are UTC."""
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                return datetime.fromtimestamp(value / 1000.0, tz=UTC)
            except (OverflowError, OSError, ValueError):
                raise ValueError(f"epoch milliseconds {value!r} is not a date") from None
        return value

    @field_validator("ts")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        if not TS_MIN <= value <= TS_MAX:
            raise ValueError(f"ts {value.isoformat()} is outside {TS_RANGE}")
        return value

    @model_validator(mode="after")
    def _shallow_extras(self) -> EventBase:
        """Unknown fields may hold any JSON, but not nested deeper than
        :data:`MAX_EXTRA_NESTING`: deeper values cannot be re-encoded for storage."""
        if self.model_extra:
            for name, value in self.model_extra.items():
                if _deeper_than(value, MAX_EXTRA_NESTING):
                    raise ValueError(
                        f"{name}: nested deeper than {MAX_EXTRA_NESTING} levels")
        return self

    @property
    def extras(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class RunStart(EventBase):
    event_type: Literal["run.start"] = "run.start"
    step_cap: int | None = Field(None, ge=1, le=U32_MAX)
    token_cap: int | None = Field(None, ge=1, le=TOKENS_MAX)
    time_cap_s: float | None = Field(None, gt=0)
    max_cost_usd: float | None = Field(None, ge=0)
    expected_steps: int | None = Field(None, ge=1, le=U32_MAX)
    interactive: bool | None = None
    job_id: str | None = Field(None, max_length=256, description="the work item this run "
                               "serves: runs an orchestrator re-queues share it (the "
                               "retry amplification advisor's job layer)")
    job_attempt: int | None = Field(None, ge=1, le=U16_MAX,
                                    description="which attempt at job_id this run is")


class Step(EventBase):
    event_type: Literal["step"] = "step"
    step: int = Field(ge=0, le=U32_MAX)
    step_type: Literal["plan", "act", "observe", "synthesize"] = "act"
    duration_ms: float = Field(0.0, ge=0)
    action_type: str = ""
    tool: str | None = None
    args_hash: str | None = None
    tokens_in: int = Field(0, ge=0, le=TOKENS_MAX)
    tokens_out: int = Field(0, ge=0, le=TOKENS_MAX)
    cost_usd: float = Field(0.0, ge=0)


class LlmCall(EventBase):
    event_type: Literal["llm.call"] = "llm.call"
    step: int | None = Field(None, ge=0, le=U32_MAX)
    provider: str = ""
    response_model: str = Field("", description="resolved model version the provider returned")
    purpose: str = "agent"
    input_tokens: int = Field(
        0, ge=0, le=TOKENS_MAX, description="OTel: includes cache reads and writes")
    output_tokens: int = Field(0, ge=0, le=TOKENS_MAX)
    cache_read_input_tokens: int = Field(0, ge=0, le=TOKENS_MAX)
    cache_creation_input_tokens: int = Field(0, ge=0, le=TOKENS_MAX)
    cache_ttl: Literal["5m", "1h"] = "5m"
    token_convention: Literal["otel", "exclusive"] = "otel"
    cost_usd: float | None = Field(None, ge=0, description="what the agent reported")
    latency_ms: float = Field(0.0, ge=0)
    ttft_ms: float | None = Field(None, ge=0)
    http_status: int | None = Field(None, ge=100, le=599)
    error_type: str | None = None
    retry_after_s: float | None = Field(None, ge=0)
    attempt: int = Field(1, ge=1, le=U16_MAX)
    logical_op_id: str | None = None
    stop_reason: str | None = None
    system_prompt_hash: str | None = Field(
        None, description="prompt-cache prefix hash, first breakpoint: the system prompt")
    tools_hash: str | None = Field(
        None, max_length=128, description="prompt-cache prefix hash, second breakpoint: "
        "the tool definitions as sent (OTel gen_ai.tool.definitions, hashed)")
    history_hash: str | None = Field(
        None, max_length=128, description="prompt-cache prefix hash, last breakpoint: the "
        "conversation re-sent before this call's newest turn (system and tools stable, "
        "nothing read from the cache, within the TTL: the history part changed)")
    prompt_hash: str | None = None
    prompt_bytes: int | None = Field(None, ge=0, le=I64_MAX)
    response_hash: str | None = None
    response_bytes: int | None = Field(None, ge=0, le=I64_MAX)

    @property
    def uncached_input_tokens(self) -> int:
        return max(
            0, self.input_tokens - self.cache_read_input_tokens - self.cache_creation_input_tokens
        )

    @property
    def is_error(self) -> bool:
        """A failed call. A 429 is not one: rate limits are counted apart and must not
        feed error rates or breakers (D3)."""
        return self.error_type is not None and self.http_status != 429


class ToolCall(EventBase):
    event_type: Literal["tool.call"] = "tool.call"
    step: int | None = Field(None, ge=0, le=U32_MAX)
    tool: str = Field(min_length=1)
    args_hash: str = ""
    latency_ms: float = Field(0.0, ge=0)
    timeout_ms: float | None = Field(None, gt=0)
    timed_out: bool = False
    late_completion_ms: float | None = Field(
        None, ge=0, description="true duration, learned after the caller timed out"
    )
    error_type: str | None = None
    http_status: int | None = Field(None, ge=100, le=599)
    result_count: int | None = Field(None, ge=0, le=U32_MAX)
    result_size_bytes: int | None = Field(None, ge=0, le=I64_MAX)
    attempt: int = Field(1, ge=1, le=U16_MAX)

    @property
    def is_error(self) -> bool:
        """Failed or timed out. A 429 alone is not a failure (D3), as for model calls.

        >>> ToolCall(run_id="r", agent="a", tool="t", http_status=429,
        ...          error_type="rate_limited").is_error
        False
        """
        return self.timed_out or (self.error_type is not None and self.http_status != 429)


class RunEnd(EventBase):
    event_type: Literal["run.end"] = "run.end"
    terminal_reason: TerminalReason | None = None
    cap: Cap | None = None
    step_cap: int | None = Field(None, ge=1, le=U32_MAX)
    token_cap: int | None = Field(None, ge=1, le=TOKENS_MAX)
    total_steps: int | None = Field(None, ge=0, le=U32_MAX)
    total_cost_usd: float | None = Field(None, ge=0)
    error_type: str | None = None


class Label(EventBase):
    """A verdict that arrives after the run, e.g. a sampled post-hoc check."""

    event_type: Literal["label"] = "label"
    verdict: Literal["wrong", "correct"]
    label_source: str = "post_hoc_check"
    quality_score: float | None = Field(None, ge=0, le=1)
    hallucination: bool | None = None
    position_flipped: bool | None = Field(
        None, description="a pairwise judge's verdict changed when the candidates' order "
        "was swapped (label_source judge; the judge-agreement advisor's flip rate)")


class Annotation(EventBase):
    """A change worth drawing on every time series: deploy, model or prompt change."""

    event_type: Literal["annotation"] = "annotation"
    run_id: str = Field("", max_length=256)
    agent: str = Field("*", min_length=1, max_length=256)
    kind: str = Field(min_length=1)
    old_value: str = ""
    new_value: str = ""
    actor: str = ""
    message: str = ""


Event = Annotated[
    RunStart | Step | LlmCall | ToolCall | RunEnd | Label | Annotation,
    Field(discriminator="event_type"),
]
EVENT_TYPES: tuple[type[EventBase], ...] = (
    RunStart,
    Step,
    LlmCall,
    ToolCall,
    RunEnd,
    Label,
    Annotation,
)
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def parse_event(data: dict[str, Any]) -> EventBase:
    """Validate one decoded event; raises ``pydantic.ValidationError`` with the reason."""
    return EVENT_ADAPTER.validate_python(data)  # type: ignore[return-value]


def llm_usage_from_exclusive(
    input_tokens: int, cache_read: int, cache_creation: int
) -> dict[str, Any]:
    """Convert a source that counts ``input_tokens`` *without* the cache to OTel counts.

    >>> llm_usage_from_exclusive(400, 6000, 0)["input_tokens"]
    6400
    """
    return {
        "input_tokens": input_tokens + cache_read + cache_creation,
        "cache_read_input_tokens": cache_read,
        "cache_creation_input_tokens": cache_creation,
        "token_convention": "exclusive",
    }
