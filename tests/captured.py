"""Scripted runs with captured bodies, written into an in-process store the way the
pipeline writes them: events, LLM and tool calls and runs through the real engine-free
pipeline (``loopwatch.processors.pipeline.Pipeline``), capture rows exactly as docs/capture.md
lays them out (every part staged; kept runs copied into ``capture_parts`` and
``capture_blobs``; a ``capture_decisions`` row once decided).

Costs are known in advance: claude-sonnet-4 at $3 / $15 per million input / output
tokens, no cache, so an LLM call costs ``(input * 3.0 + output * 15.0) / 1e6``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
from loopwatch.ingest.capture import CaptureMessage, build_capture_message
from loopwatch.ingest.events import EventBase, LlmCall, RunEnd, RunStart, ToolCall
from loopwatch.ingest.wire import encode_envelope
from loopwatch.processors.capture import BLOBS_TABLE, PARTS_TABLE, staging_rows
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.store.sink import ClickHouseSink, RowBatch

MODEL = "claude-sonnet-4"
Capture = Literal["kept", "pending", "discarded", "none"]


def llm_cost(input_tokens: int, output_tokens: int) -> float:
    return (input_tokens * 3.0 + output_tokens * 15.0) / 1_000_000


@dataclass(frozen=True)
class Call:
    type: Literal["llm", "tool"]
    step: int
    prompt: Any = None
    response: Any = None
    tool: str | None = None
    args: Any = None
    output: Any = None
    input_tokens: int = 0
    output_tokens: int = 0
    latency_ms: float = 0.0

    def expected(self) -> dict[str, Any]:
        """The step as ``loopwatch replay --json`` must print it."""
        llm = self.type == "llm"
        return {"step": self.step, "type": self.type, "prompt": self.prompt,
                "response": self.response, "tool": self.tool, "args": self.args,
                "output": self.output,
                "tokens": {"input": self.input_tokens, "output": self.output_tokens,
                           "cache_read": 0, "cache_creation": 0},
                "cost": llm_cost(self.input_tokens, self.output_tokens) if llm else 0.0,
                "latency_ms": self.latency_ms, "timed_out": False, "true_duration_ms": None}


def llm(step: int, prompt: Any, response: Any, input_tokens: int = 1000,
        output_tokens: int = 100, latency_ms: float = 800.0) -> Call:
    return Call("llm", step, prompt=prompt, response=response, input_tokens=input_tokens,
                output_tokens=output_tokens, latency_ms=latency_ms)


def tool(step: int, name: str, args: Any, output: Any, latency_ms: float = 120.0) -> Call:
    return Call("tool", step, tool=name, args=args, output=output, latency_ms=latency_ms)


def parts_rows(message: CaptureMessage, at: datetime, stamp: str
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The processors' own staging rows of ``message`` (parts, blobs), stamped ``stamp``:
    ``staged_at`` for the staging tables, ``kept_at`` for the kept ones."""
    tables = staging_rows(message, at)

    def stamped(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**{k: v for k, v in row.items() if k != "staged_at"}, stamp: at}
                for row in rows]

    return stamped(tables[PARTS_TABLE]), stamped(tables[BLOBS_TABLE])


def all_parts_rows(messages: list[CaptureMessage], at: datetime, stamp: str
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """:func:`parts_rows` of every message, concatenated."""
    parts: list[dict[str, Any]] = []
    blobs: list[dict[str, Any]] = []
    for message in messages:
        more_parts, more_blobs = parts_rows(message, at, stamp)
        parts += more_parts
        blobs += more_blobs
    return parts, blobs


def insert_rows(client: Client, table: str, rows: list[dict[str, Any]]) -> None:
    ClickHouseSink(client).write_batch(RowBatch({table: rows}))


def write_run(client: Client, settings: Settings, run_id: str, agent: str,
              calls: list[Call], *, start: datetime | None = None,
              terminal_reason: str | None = "model_done", capture: Capture = "kept",
              reason: str | None = None, max_part_bytes: int = 256 * 1024,
              step_seconds: float = 2.0) -> list[CaptureMessage]:
    """Store one run: ``terminal_reason=None`` leaves it open. Returns the capture
    messages its emitter would have sent."""
    start = start or datetime.now(UTC) - timedelta(minutes=30)
    common = {"run_id": run_id, "agent": agent, "model": MODEL, "task_type": "replay-test"}
    events: list[EventBase] = [RunStart(ts=start, **common)]
    messages: list[CaptureMessage] = []
    at = start
    for call in calls:
        at += timedelta(seconds=step_seconds)
        event: EventBase
        if call.type == "llm":
            event = LlmCall(ts=at, step=call.step, provider="anthropic",
                            input_tokens=call.input_tokens, output_tokens=call.output_tokens,
                            latency_ms=call.latency_ms, **common)
            values = {"prompt": call.prompt, "response": call.response}
        else:
            assert call.tool is not None
            event = ToolCall(ts=at, step=call.step, tool=call.tool, latency_ms=call.latency_ms,
                             args_hash=f"{call.tool}-{call.step}", **common)
            values = {"args": call.args, "output": call.output}
        events.append(event)
        messages.append(build_capture_message(
            event_id=str(event.event_id), run_id=run_id, agent=agent,
            ts=at.isoformat().replace("+00:00", "Z"), event_type=event.event_type,
            step=call.step, tool=call.tool, values=values, max_part_bytes=max_part_bytes))
    if terminal_reason is not None:
        events.append(RunEnd(ts=at + timedelta(seconds=1), terminal_reason=terminal_reason,
                             **common))
    pipeline = Pipeline(settings, MemoryRunStore())
    work = pipeline.process([RawMessage("replay-test", 0, 0, encode_envelope(events))])
    ClickHouseSink(client).write_batch(work.rows)
    if capture == "none":
        return messages
    now = datetime.now(UTC)
    staged_parts, staged_blobs = all_parts_rows(messages, now, "staged_at")
    insert_rows(client, "capture_staging", staged_parts)
    insert_rows(client, "capture_staging_blobs", staged_blobs)
    if capture == "pending":
        return messages
    outcome = client.query("SELECT outcome FROM runs FINAL WHERE run_id = {r:String}",
                           parameters={"r": run_id}).result_rows[0][0]
    keep = capture == "kept"
    total = sum(row["bytes"] for row in staged_parts)
    insert_rows(client, "capture_decisions", [{
        "run_id": run_id, "agent": agent, "outcome": outcome, "keep": int(keep),
        "reason": reason or (f"failure:{outcome}" if outcome != "success" else
                             "sampled_success" if keep else "success_not_sampled"),
        "parts": len(staged_parts), "bytes": total, "decided_at": now}])
    if keep:
        kept_parts, kept_blobs = all_parts_rows(messages, now, "kept_at")
        insert_rows(client, "capture_parts", kept_parts)
        insert_rows(client, "capture_blobs", kept_blobs)
    return messages
