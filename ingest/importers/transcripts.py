"""``loopwatch ingest transcript --format openai-chat``: recorded runs to events.

Input: a JSON list of runs, or JSONL with one run per line. A run is an object whose
message list (OpenAI chat form) is under ``messages`` (``messages_key``), or a bare
message list. Assistant messages may carry ``tool_calls`` (``id``, ``function.name``,
``function.arguments``), tool messages answer them by ``tool_call_id``.

Per run: ``run.start``; per assistant message a ``step`` (``act`` when it calls tools,
else ``synthesize``), an ``llm.call`` when the message carries ``usage`` (OpenAI's
``prompt_tokens`` include cached tokens, as OpenTelemetry counts), and a ``tool.call``
per call, matched to its result by ``tool_call_id`` (by position among the calls that
share an id when ids repeat, and by position when the result has no usable id); then a
``run.end`` without terminal reason, which the processors label ``unknown``, plus a
``label`` (``correct``/``wrong``) when the file gives a verdict, which turns that into
``success``/``wrong``. Transcripts carry no timing, so events are stamped at import
time, one millisecond apart in message order.

Ids are deterministic (file digest and record index, or ``run_id_key``), so importing
the same file twice stores every event once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import ValidationError

from loopwatch.ingest.events import (
    EventBase,
    Label,
    LlmCall,
    RunEnd,
    RunStart,
    Step,
    ToolCall,
    canonical_args_hash,
)
from loopwatch.ingest.importers.records import Bad, Good, Record, stable_id

OUTCOME_KEYS = ("outcome", "success", "reward", "resolved")
CORRECT_WORDS = frozenset({"success", "succeeded", "correct", "pass", "passed", "resolved",
                           "true", "yes", "solved"})
WRONG_WORDS = frozenset({"wrong", "incorrect", "fail", "failed", "failure", "false", "no",
                         "unresolved", "unsolved"})
Verdict = Literal["correct", "wrong"]


@dataclass(frozen=True)
class TranscriptOptions:
    """How a file's fields map to loopwatch's (the CLI's options)."""

    agent: str = "transcript-import"
    messages_key: str = "messages"
    run_id_key: str | None = None
    task_id_key: str | None = None
    outcome_key: str | None = None
    reward_threshold: float = 1.0
    task_type: str = ""
    model: str = ""


class BadTranscript(ValueError):
    """This record cannot become a run; the message says why."""


def verdict_of(value: Any, reward_threshold: float = 1.0) -> Verdict | None:
    """A file's outcome value as a verdict; None when it says nothing we can read.

    >>> [verdict_of(v) for v in (True, 0.5, 1, "passed", "FAILED", "maybe", None)]
    ['correct', 'wrong', 'correct', 'correct', 'wrong', None, None]
    """
    if isinstance(value, bool):
        return "correct" if value else "wrong"
    if isinstance(value, int | float):
        return "correct" if value >= reward_threshold else "wrong"
    if isinstance(value, str):
        word = value.strip().lower()
        if word in CORRECT_WORDS:
            return "correct"
        if word in WRONG_WORDS:
            return "wrong"
        try:
            return verdict_of(float(word), reward_threshold)
        except ValueError:
            return None
    return None


def _outcome_value(record: dict[str, Any], options: TranscriptOptions) -> Any:
    if options.outcome_key is not None:
        return record.get(options.outcome_key)
    for key in OUTCOME_KEYS:
        if key in record:
            return record[key]
    return None


@dataclass
class _Call:
    step: int
    call_id: str
    tool: str
    arguments: Any
    result: dict[str, Any] | None = None


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return orjson.loads(raw) if raw.strip() else {}
        except orjson.JSONDecodeError:
            return raw
    return raw if raw is not None else {}


def _calls_of(message: dict[str, Any], step: int, where: str) -> list[_Call]:
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise BadTranscript(f"{where}: tool_calls is not a list")
    calls = []
    for index, raw in enumerate(raw_calls):
        function = raw.get("function") if isinstance(raw, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name or not isinstance(function, dict):
            raise BadTranscript(f"{where}: tool call {index + 1} has no function.name")
        calls.append(_Call(step, str(raw.get("id") or ""), name,
                           _arguments(function.get("arguments"))))
    return calls


def match_results(messages: list[dict[str, Any]]) -> list[_Call]:
    """Every tool call in order, each with the tool message that answered it (or None).

    A result goes to the earliest unanswered call with its ``tool_call_id`` (so when ids
    repeat, position decides); one with no id, or an id no open call has, goes to the
    earliest unanswered call.
    """
    calls: list[_Call] = []
    pending: list[_Call] = []
    step = -1
    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            step += 1
            new = _calls_of(message, step, f"message {index + 1}")
            calls.extend(new)
            pending.extend(new)
        elif role in ("tool", "function") and pending:
            call_id = str(message.get("tool_call_id") or "")
            chosen = next((c for c in pending if call_id and c.call_id == call_id), pending[0])
            chosen.result = message
            pending.remove(chosen)
    return calls


def _result_size(result: dict[str, Any]) -> int:
    content = result.get("content")
    if isinstance(content, str):
        return len(content.encode())
    return len(orjson.dumps(content, default=str)) if content is not None else 0


def _result_error(result: dict[str, Any]) -> str | None:
    if result.get("is_error") is True or result.get("error"):
        error = result.get("error")
        return error if isinstance(error, str) and len(error) <= 64 else "tool_error"
    return None


def _usage_fields(usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0),
        "output_tokens": int(usage.get("completion_tokens") or usage.get("output_tokens")
                             or 0),
        "cache_read_input_tokens": int((details or {}).get("cached_tokens") or 0),
    }


class _RunBuilder:
    """Builds one run's events in order, with ids and times derived from the run."""

    def __init__(self, run_id: str, common: dict[str, Any], base: datetime) -> None:
        self.run_id = run_id
        self.common = common
        self.base = base
        self.events: list[EventBase] = []

    def add(self, model: type[EventBase], **fields: Any) -> None:
        sequence = len(self.events)
        self.events.append(model(
            event_id=stable_id(self.run_id, sequence, model.model_fields["event_type"].default),
            ts=self.base + timedelta(milliseconds=sequence), run_id=self.run_id,
            **{**self.common, **fields}))


def run_events(record: Any, index: int, digest: str, options: TranscriptOptions,
               base: datetime) -> list[EventBase]:
    """One run's events; :class:`BadTranscript` (or pydantic's error) when it cannot be."""
    if isinstance(record, list):
        record = {options.messages_key: record}
    if not isinstance(record, dict):
        raise BadTranscript("a run must be an object or a list of messages")
    messages = record.get(options.messages_key)
    if not isinstance(messages, list):
        raise BadTranscript(f"no {options.messages_key!r} list of messages")
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadTranscript(f"message {number} is not an object with a role")
    given_id = record.get(options.run_id_key) if options.run_id_key else None
    run_id = str(given_id) if given_id not in (None, "") else f"{digest[:16]}-{index}"
    model = options.model or (record["model"] if isinstance(record.get("model"), str) else "")
    common = {"agent": options.agent, "task_type": options.task_type, "model": model}
    builder = _RunBuilder(run_id, common, base)
    task_id = record.get(options.task_id_key) if options.task_id_key else None
    builder.add(RunStart, import_format="openai-chat",
                **({"task_id": str(task_id)} if task_id is not None else {}))
    calls = match_results(messages)
    by_step: dict[int, list[_Call]] = {}
    for call in calls:
        by_step.setdefault(call.step, []).append(call)
    step = -1
    for message in messages:
        if message["role"] != "assistant":
            continue
        step += 1
        step_calls = by_step.get(step, [])
        builder.add(Step, step=step, step_type="act" if step_calls else "synthesize",
                    action_type="tool_calls" if step_calls else "respond",
                    tool=step_calls[0].tool if len(step_calls) == 1 else None)
        usage = _usage_fields(message.get("usage"))
        if usage is not None:
            builder.add(LlmCall, step=step, **usage)
        for call in step_calls:
            result = call.result
            builder.add(ToolCall, step=step, tool=call.tool,
                        args_hash=canonical_args_hash(call.tool, call.arguments),
                        result_size_bytes=None if result is None else _result_size(result),
                        error_type=None if result is None else _result_error(result),
                        **({"tool_call_id": call.call_id} if call.call_id else {}))
    builder.add(RunEnd, terminal_reason=None, total_steps=step + 1)
    verdict = verdict_of(_outcome_value(record, options), options.reward_threshold)
    if verdict is not None:
        builder.add(Label, verdict=verdict, label_source="transcript_import")
    return builder.events


def _runs(path: Path) -> Iterator[tuple[int, str, Any]]:
    """(bytes read, position, parsed run or exception) for a JSON list or JSONL file."""
    with path.open("rb") as handle:
        head = handle.read(1 << 16).lstrip()
    if head.startswith(b"["):
        try:
            document = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError:
            document = None  # JSONL whose lines are message lists
        if isinstance(document, list):
            size = path.stat().st_size
            for index, run in enumerate(document):
                yield size * (index + 1) // max(1, len(document)), f"record {index + 1}", run
            return
    offset = 0
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            offset += len(line)
            if not line.strip():
                continue
            try:
                yield offset, f"line {number}", orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                yield offset, f"line {number}", BadTranscript(f"malformed JSON: {exc}")


def read_transcripts(path: Path, digest: str, options: TranscriptOptions,
                     base: datetime) -> Iterator[tuple[int, Record]]:
    """(bytes read so far, record) per run; a bad run is reported, never fatal."""
    for index, (offset, position, run) in enumerate(_runs(path)):
        if isinstance(run, BadTranscript):
            yield offset, Bad(position, str(run))
            continue
        try:
            yield offset, Good(position, run_events(run, index, digest, options, base))
        except BadTranscript as exc:
            yield offset, Bad(position, str(exc))
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            yield offset, Bad(position, f"{where}: {error['msg']}")
        except (TypeError, ValueError) as exc:
            yield offset, Bad(position, f"{type(exc).__name__}: {exc}")
