"""A run's recorded trajectory, read from the store: every LLM and tool call in order,
with the bodies capture kept (docs/capture.md).

Metrics come from the rows every run has (``events``, ``llm_calls``, ``tool_calls``,
``runs FINAL``); bodies come from the capture tables, chosen by the run's capture
decision: kept runs read ``capture_parts``/``capture_blobs``, runs not decided yet read
the staging tables (their payloads may still be kept), and discarded runs have no
bodies but say why. One query per table, whatever the number of steps, so that a long
run replays as fast as a short one, also through a running ``loopwatch up``.

>>> step = Step(index=0, step=0, type="llm", prompt="hi", response="hello")
>>> sorted(step.to_json())  # doctest: +NORMALIZE_WHITESPACE
['args', 'cost', 'latency_ms', 'output', 'prompt', 'response', 'step', 'timed_out', 'tokens',
 'tool', 'true_duration_ms', 'type']
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from loopwatch.ingest.capture import Blob, PartRef, assemble_part

if TYPE_CHECKING:  # the CLI imports this module at every start: the store client waits
    from loopwatch.store.reader import Reader

StepType = Literal["llm", "tool"]
CaptureState = Literal["kept", "pending", "discarded"]
TOKEN_KEYS: Final = ("input", "output", "cache_read", "cache_creation")
_TYPE_OF: Final[dict[str, StepType]] = {"llm.call": "llm", "tool.call": "tool"}
_RANK: Final = {"llm": 0, "tool": 1}


class RunNotFound(LookupError):
    """No run with this id in the store."""


def zero_tokens() -> dict[str, int]:
    return dict.fromkeys(TOKEN_KEYS, 0)


@dataclass(frozen=True)
class Step:
    """One recorded call. ``index`` is its position in the trajectory (what replay and
    diff align on); ``step`` is the agent's own step number (the position when the
    event had none). ``truncated`` names parts stored cut at ``CAPTURE_MAX_PART_BYTES``;
    ``missing`` names parts whose blobs are gone (expired or not yet written)."""

    index: int
    step: int
    type: StepType
    prompt: Any = None
    response: Any = None
    tool: str | None = None
    args: Any = None
    output: Any = None
    tokens: dict[str, int] = field(default_factory=zero_tokens)
    cost: float = 0.0
    latency_ms: float = 0.0
    event_id: str = ""
    truncated: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    #: a tool call that timed out: ``latency_ms`` is then its timeout, and
    #: ``true_duration_ms`` how long it really ran (None when nobody waited to know)
    timed_out: bool = False
    true_duration_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        """Exactly the step shape of ``loopwatch replay --json`` (issue 9)."""
        return {"step": self.step, "type": self.type, "prompt": self.prompt,
                "response": self.response, "tool": self.tool, "args": self.args,
                "output": self.output, "tokens": dict(self.tokens), "cost": self.cost,
                "latency_ms": self.latency_ms, "timed_out": self.timed_out,
                "true_duration_ms": self.true_duration_ms}


@dataclass(frozen=True)
class CaptureStatus:
    """Where the bodies came from, and why there are none when there are none."""

    status: CaptureState
    reason: str
    parts: int = 0
    bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "parts": self.parts,
                "bytes": self.bytes}


@dataclass(frozen=True)
class Recording:
    """A run's trajectory. ``outcome`` is the run's outcome, or its status while open."""

    run_id: str
    outcome: str
    steps: tuple[Step, ...]
    capture: CaptureStatus
    agent: str = ""
    status: str = "closed"

    def to_json(self, with_capture: bool = True) -> dict[str, Any]:
        """``{"run_id", "outcome", "steps"}`` plus ``capture`` (status, reason)."""
        body: dict[str, Any] = {"run_id": self.run_id, "outcome": self.outcome,
                                "steps": [step.to_json() for step in self.steps]}
        if with_capture:
            body["capture"] = self.capture.to_json()
        return body

    @property
    def has_bodies(self) -> bool:
        return self.capture.status != "discarded" and self.capture.parts > 0


# --- queries --------------------------------------------------------------------------

RUN_SQL: Final = """SELECT agent, status, outcome
FROM runs FINAL WHERE run_id = {run_id:String}"""

EVENTS_SQL: Final = """SELECT toString(event_id) AS event_id, event_type,
       toUnixTimestamp64Milli(ts) AS ts_ms, kafka_offset,
       JSONExtract(payload, 'step', 'Nullable(Int64)') AS step,
       JSONExtractString(payload, 'tool') AS tool
FROM events FINAL
WHERE run_id = {run_id:String} AND event_type IN ('llm.call', 'tool.call')"""

LLM_SQL: Final = """SELECT toString(event_id) AS event_id, toUnixTimestamp64Milli(ts) AS ts_ms,
       step, input_tokens, output_tokens, cache_read_input_tokens, cache_creation_input_tokens,
       cost_usd, latency_ms
FROM llm_calls FINAL
WHERE agent = {agent:String} AND run_id = {run_id:String}"""

TOOL_SQL: Final = """SELECT toString(event_id) AS event_id, toUnixTimestamp64Milli(ts) AS ts_ms,
       step, tool, latency_ms, timed_out, late_completion_ms
FROM tool_calls FINAL
WHERE agent = {agent:String} AND run_id = {run_id:String}"""

DECISION_SQL: Final = """SELECT keep, reason
FROM capture_decisions FINAL WHERE run_id = {run_id:String}"""

# Table names come from this fixed map, never from input.
_CAPTURE_TABLES: Final = {"kept": ("capture_parts", "capture_blobs"),
                          "pending": ("capture_staging", "capture_staging_blobs")}

PARTS_SQL: Final = """SELECT toString(event_id) AS event_id, part, encoding, hashes, bytes,
       truncated, redactions
FROM {parts} FINAL WHERE run_id = {{run_id:String}}"""

BLOBS_SQL: Final = """SELECT hash, encoding, body
FROM {blobs} FINAL
WHERE hash IN (SELECT arrayJoin(hashes) FROM {parts} WHERE run_id = {{run_id:String}})"""


def _records(reader: Reader, sql: str, parameters: dict[str, Any]) -> list[dict[str, Any]]:
    return reader.query(sql, parameters).records()


def _optional_int(value: Any) -> int | None:
    return None if value is None or value == "" else int(value)


def load_recording(reader: Reader, run_id: str) -> Recording:
    """The run's recording; :class:`RunNotFound` when the store has no such run.

    Seven queries at most, whatever the run's length: the run, its events, its LLM and
    tool calls, its capture decision, and its parts and blobs.
    """
    found = _records(reader, RUN_SQL, {"run_id": run_id})
    if not found:
        raise RunNotFound(f"no run {run_id!r} in the store")
    run = found[0]
    agent, status = str(run["agent"]), str(run["status"])
    outcome = str(run["outcome"] or "") or status
    parameters = {"run_id": run_id, "agent": agent}
    events = _records(reader, EVENTS_SQL, parameters)
    llm = {str(row["event_id"]): row for row in _records(reader, LLM_SQL, parameters)}
    tools = {str(row["event_id"]): row for row in _records(reader, TOOL_SQL, parameters)}
    capture, parts, blobs = _capture(reader, run_id, status)
    steps = _steps(events, llm, tools, parts, blobs)
    return Recording(run_id=run_id, outcome=outcome, steps=tuple(steps), capture=capture,
                     agent=agent, status=status)


def _capture(reader: Reader, run_id: str, run_status: str
             ) -> tuple[CaptureStatus, list[dict[str, Any]], dict[str, Blob]]:
    """The decision, and the parts and blobs of the table it points at."""
    decided = _records(reader, DECISION_SQL, {"run_id": run_id})
    state: CaptureState
    if decided and not int(decided[0]["keep"]):
        return CaptureStatus("discarded", f"not kept: {decided[0]['reason']}"), [], {}
    if decided:
        state, reason = "kept", str(decided[0]["reason"])
    else:
        state = "pending"
        reason = ("run still open: not decided yet" if run_status == "running"
                  else "not decided yet (successes wait for the label window)")
    parts_table, blobs_table = _CAPTURE_TABLES[state]
    parameters = {"run_id": run_id}
    parts = _records(reader, PARTS_SQL.format(parts=parts_table), parameters)
    blobs = {str(row["hash"]): Blob(encoding=row["encoding"], body=str(row["body"]))
             for row in _records(reader, BLOBS_SQL.format(parts=parts_table, blobs=blobs_table),
                                 parameters)} if parts else {}
    total = sum(int(part["bytes"]) for part in parts)
    return CaptureStatus(state, reason, len(parts), total), parts, blobs


def seen_at_ms(ts_ms: int, tool: Mapping[str, Any]) -> int:
    """When the agent saw a tool call end. A timed-out call's event is emitted when
    the call really ends (to carry its true duration), possibly after the run ended;
    the agent saw it at its timeout: the true duration earlier, plus the timeout.

    >>> seen_at_ms(10_550, {"timed_out": 1, "late_completion_ms": 550, "latency_ms": 500})
    10500
    """
    late = tool.get("late_completion_ms")
    if not tool.get("timed_out") or late is None:
        return ts_ms
    return ts_ms - round(float(late) - float(tool.get("latency_ms") or 0.0))


def _order_key(row: Mapping[str, Any]) -> tuple[int, int, int, int, str]:
    """Event time (a timed-out tool call's: when it timed out, see :func:`seen_at_ms`),
    then emission order within the run's partition, then step (a step's LLM call before
    its tool call), then the id so ties are stable."""
    step = _optional_int(row.get("step"))
    return (int(row.get("ts_ms") or 0), int(row.get("kafka_offset") or 0),
            step if step is not None else 1 << 62, _RANK[_TYPE_OF[row["event_type"]]],
            str(row["event_id"]))


def _steps(events: Iterable[Mapping[str, Any]], llm: Mapping[str, Mapping[str, Any]],
           tools: Mapping[str, Mapping[str, Any]], parts: Iterable[Mapping[str, Any]],
           blobs: Mapping[str, Blob]) -> list[Step]:
    calls: dict[str, dict[str, Any]] = {str(row["event_id"]): dict(row) for row in events}
    # An llm/tool row whose raw event is gone (shorter TTL, say) still is a step.
    for table, event_type in ((llm, "llm.call"), (tools, "tool.call")):
        for event_id, row in table.items():
            calls.setdefault(event_id, {**row, "event_type": event_type, "kafka_offset": 0})
    for event_id, row in tools.items():
        if event_id in calls and row.get("timed_out"):
            call = calls[event_id]
            call["ts_ms"] = seen_at_ms(int(call.get("ts_ms") or 0), row)
    bodies: dict[str, dict[str, Any]] = {}
    truncated: dict[str, list[str]] = {}
    missing: dict[str, list[str]] = {}
    for part in parts:
        event_id, name = str(part["event_id"]), str(part["part"])
        ref = PartRef(encoding=part["encoding"], hashes=list(part["hashes"]),
                      bytes=int(part["bytes"]), truncated=bool(part["truncated"]),
                      redactions=int(part["redactions"]))
        try:
            bodies.setdefault(event_id, {})[name] = assemble_part(ref, blobs)
        except (KeyError, IndexError):
            missing.setdefault(event_id, []).append(name)
        if ref.truncated:
            truncated.setdefault(event_id, []).append(name)
    steps = []
    for index, row in enumerate(sorted(calls.values(), key=_order_key)):
        event_id = str(row["event_id"])
        kind = _TYPE_OF[row["event_type"]]
        body = bodies.get(event_id, {})
        number = _optional_int(row.get("step"))
        common: dict[str, Any] = {
            "index": index, "step": index if number is None else number, "type": kind,
            "event_id": event_id, "truncated": tuple(sorted(truncated.get(event_id, ()))),
            "missing": tuple(sorted(missing.get(event_id, ())))}
        if kind == "llm":
            metrics = llm.get(event_id, {})
            steps.append(Step(
                **common, prompt=body.get("prompt"), response=body.get("response"),
                tokens={"input": int(metrics.get("input_tokens") or 0),
                        "output": int(metrics.get("output_tokens") or 0),
                        "cache_read": int(metrics.get("cache_read_input_tokens") or 0),
                        "cache_creation": int(metrics.get("cache_creation_input_tokens") or 0)},
                cost=float(metrics.get("cost_usd") or 0.0),
                latency_ms=float(metrics.get("latency_ms") or 0.0)))
        else:
            metrics = tools.get(event_id, {})
            tool_name = str(metrics.get("tool") or row.get("tool") or "") or None
            late = metrics.get("late_completion_ms")
            steps.append(Step(**common, tool=tool_name, args=body.get("args"),
                              output=body.get("output"),
                              latency_ms=float(metrics.get("latency_ms") or 0.0),
                              timed_out=bool(metrics.get("timed_out")),
                              true_duration_ms=None if late is None else float(late)))
    return steps
