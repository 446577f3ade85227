"""Imports: JSONL in the event contract and OpenAI chat transcripts, read exactly, then
through the CLI into the real pipeline (and with no `loopwatch up` running at all)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from loopwatch.ingest.events import canonical_args_hash
from loopwatch.ingest.importers.jsonl import read_jsonl
from loopwatch.ingest.importers.records import Bad, Good, file_digest, stable_id
from loopwatch.ingest.importers.transcripts import (
    TranscriptOptions,
    match_results,
    read_transcripts,
    run_events,
)
from tests.conftest import PIPELINE_ENV

BASE = datetime(2026, 1, 1, tzinfo=UTC)


def assistant(*calls: tuple[str, str, dict[str, Any]], usage: dict[str, Any] | None = None,
              content: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": orjson.dumps(args).decode()}}
            for call_id, name, args in calls]
    if usage is not None:
        message["usage"] = usage
    return message


def tool(call_id: str | None, content: str, **extra: Any) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content, **extra}


RUN = {
    "id": "swe-1", "task": "django-1234", "reward": 0.5, "model": "gpt-4o",
    "messages": [
        {"role": "system", "content": "You fix bugs."},
        {"role": "user", "content": "Fix the failing test."},
        assistant(("call_a", "grep", {"pattern": "def save"}),
                  ("call_b", "read_file", {"path": "models.py"}),
                  usage={"prompt_tokens": 1200, "completion_tokens": 40,
                         "prompt_tokens_details": {"cached_tokens": 1000}}),
        tool("call_b", "class Model: ..."),             # answers arrive out of order
        tool("call_a", "models.py:12", is_error=True),
        assistant(content="Done: the save() signature was wrong."),
    ],
}


def test_a_transcript_becomes_exactly_these_events():
    options = TranscriptOptions(agent="swe-agent", run_id_key="id", task_id_key="task",
                                task_type="bugfix")
    events = run_events(RUN, 0, "f" * 64, options, BASE)
    seen = [(e.event_type, getattr(e, "step", None), getattr(e, "tool", None))
            for e in events]
    assert seen == [("run.start", None, None), ("step", 0, None), ("llm.call", 0, None),
                    ("tool.call", 0, "grep"), ("tool.call", 0, "read_file"),
                    ("step", 1, None), ("run.end", None, None), ("label", None, None)]
    assert {e.run_id for e in events} == {"swe-1"}
    assert {(e.agent, e.task_type, e.model) for e in events} == {("swe-agent", "bugfix",
                                                                 "gpt-4o")}
    start, step0, call, grep, read, step1, end, label = events
    assert start.extras == {"import_format": "openai-chat", "task_id": "django-1234"}
    assert (step0.step_type, step0.action_type) == ("act", "tool_calls")  # type: ignore[attr-defined]
    assert (step1.step_type, step1.action_type) == ("synthesize", "respond")  # type: ignore[attr-defined]
    assert (call.input_tokens, call.output_tokens, call.cache_read_input_tokens) == (  # type: ignore[attr-defined]
        1200, 40, 1000)
    assert (grep.args_hash, grep.result_size_bytes, grep.error_type,  # type: ignore[attr-defined]
            grep.extras) == (canonical_args_hash("grep", {"pattern": "def save"}), 12,
                             "tool_error", {"tool_call_id": "call_a"})
    assert (read.args_hash, read.result_size_bytes, read.error_type) == (  # type: ignore[attr-defined]
        canonical_args_hash("read_file", {"path": "models.py"}), 16, None)
    assert (end.terminal_reason, end.total_steps) == (None, 2)  # type: ignore[attr-defined]
    assert (label.verdict, label.label_source) == ("wrong", "transcript_import")  # type: ignore[attr-defined]
    assert [e.event_id for e in events] == [stable_id("swe-1", i, e.event_type)
                                            for i, e in enumerate(events)]
    assert [e.ts - BASE for e in events] == [timedelta(milliseconds=i) for i in range(8)]


def test_tool_results_match_by_id_and_by_position_when_ids_repeat():
    messages = [
        assistant(("call_0", "search", {"q": 1}), ("call_0", "search", {"q": 2})),
        tool("call_0", "first"), tool("call_0", "second-result"),
        assistant(("call_0", "open", {"n": 3})),
        tool(None, "third"),  # no id at all: the earliest open call
        assistant(("call_9", "close", {})),
    ]
    calls = match_results(messages)
    assert [(c.tool, c.arguments, c.result and c.result["content"]) for c in calls] == [
        ("search", {"q": 1}, "first"), ("search", {"q": 2}, "second-result"),
        ("open", {"n": 3}, "third"), ("close", {}, None)]


def test_outcomes_become_labels_or_stay_unknown():
    def verdicts(record: dict[str, Any], **options: Any) -> list[str]:
        events = run_events({"messages": [assistant(content="ok")], **record}, 0, "0" * 64,
                            TranscriptOptions(**options), BASE)
        assert events[-1 if events[-1].event_type == "run.end" else -2].event_type == "run.end"
        return [e.verdict for e in events if e.event_type == "label"]  # type: ignore[attr-defined]

    assert verdicts({"reward": 1}) == ["correct"]
    assert verdicts({"reward": 0.99}) == ["wrong"]
    assert verdicts({"reward": 0.7}, reward_threshold=0.5) == ["correct"]
    assert verdicts({"success": True}) == ["correct"]
    assert verdicts({"outcome": "failed"}) == ["wrong"]
    assert verdicts({"score": 0}) == []
    assert verdicts({"score": 0}, outcome_key="score") == ["wrong"]
    assert verdicts({"outcome": "partially"}) == []


def test_bad_transcript_records_are_reported_by_position_and_skipped(tmp_path: Path):
    path = tmp_path / "runs.jsonl"
    lines = [orjson.dumps(RUN), b"{not json", orjson.dumps({"conversation": []}),
             orjson.dumps({"messages": [{"role": "assistant", "tool_calls": [
                 {"id": "x", "function": {"arguments": "{}"}}]}]}),
             b"", orjson.dumps([{"role": "user", "content": "a bare message list"}])]
    path.write_bytes(b"\n".join(lines) + b"\n")
    digest = file_digest(path)
    records = [record for _, record in read_transcripts(path, digest, TranscriptOptions(),
                                                        BASE)]
    assert [(r.position, r.reason if isinstance(r, Bad) else len(r.events))
            for r in records] == [
        ("line 1", 8),
        ("line 2", records[1].reason),
        ("line 3", "no 'messages' list of messages"),
        ("line 4", "message 1: tool call 1 has no function.name"),
        ("line 6", 2),
    ]
    assert records[1].reason.startswith("malformed JSON: ")  # type: ignore[union-attr]
    first = records[0]
    assert isinstance(first, Good)
    assert first.events[0].run_id == f"{digest[:16]}-0"  # no --run-id-key: file + index
    last = records[-1]
    assert isinstance(last, Good) and last.events[0].run_id == f"{digest[:16]}-4"


def test_jsonl_records_are_validated_like_the_processors_do(tmp_path: Path):
    path = tmp_path / "events.jsonl"
    good = {"event_type": "step", "run_id": "r1", "agent": "a", "step": 0}
    path.write_bytes(b"\n".join([
        orjson.dumps(good),
        b'{"event_type": "step", "run_id": "r1"',
        orjson.dumps({"event_type": "tool.call", "run_id": "r1", "agent": "a"}),
        orjson.dumps({"envelope_version": 1, "events": [good, {"event_type": "nope"}]}),
        orjson.dumps({**good, "schema_version": "2.0"}),
    ]) + b"\n")
    digest = file_digest(path)
    records = [record for _, record in read_jsonl(path, digest)]
    expected = [
        ("line 1", ""),
        ("line 2", "malformed JSON: "),
        ("line 3", "schema violation: tool.call.tool: Field required"),
        ("line 4 event 1", ""),
        ("line 4 event 2", "schema violation: event: Input tag 'nope'"),
        ("line 5", "unsupported schema_version major 2"),
    ]
    assert [r.position for r in records] == [position for position, _ in expected]
    for record, (_, reason) in zip(records, expected, strict=True):
        assert isinstance(record, Good) if not reason else record.reason.startswith(reason)
    first = records[0]
    assert isinstance(first, Good)
    assert first.events[0].event_id == stable_id(digest, 1, 0)  # stable across imports


# -- through the CLI into the real pipeline ---------------------------------------------


def ingest(*args: str, env: dict[str, str], timeout: float = 300
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loopwatch.ingest.cli", "ingest", *args],
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout)


def test_ingest_file_exits_once_every_event_is_stored(pipeline, reader, agent, tmp_path):
    run_ids = [f"{agent}-{n}" for n in range(3)]
    lines = []
    for n, run_id in enumerate(run_ids):
        common = {"run_id": run_id, "agent": agent, "model": "gpt-4o"}
        lines += [{"event_type": "run.start", **common},
                  {"event_type": "llm.call", "input_tokens": 1000 * (n + 1),
                   "output_tokens": 10, **common},
                  {"event_type": "tool.call", "tool": "search", **common},
                  {"event_type": "run.end", "terminal_reason": "model_done", **common}]
    raw = [orjson.dumps(line) for line in lines]
    raw.insert(5, b'{"event_type": "step", "broken')
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"\n".join(raw) + b"\n")
    result = ingest("file", str(path), env=pipeline.env)
    assert result.returncode == 0, result.stderr
    assert "skipped line 6: malformed JSON" in result.stderr
    assert "12 events (12 stored, 0 dead-lettered), 1 bad records skipped" in result.stderr
    # captured, not a terminal: the progress bars' plain lines (loopwatch.liveline)
    assert re.search(rf"^sending events.jsonl  \d+ of {path.stat().st_size} bytes$",
                     result.stderr, re.M)
    assert re.search(r"^waiting until stored  \d+ of 12 events$", result.stderr, re.M)
    # no waiting here: the command returned only once everything was stored
    stored = reader.query("SELECT count() FROM events FINAL WHERE agent = {a:String}",
                          {"a": agent}).scalar()
    assert stored == 12
    again = ingest("file", str(path), env=pipeline.env)  # re-import: same ids, no doubles
    assert again.returncode == 0, again.stderr
    assert reader.query("SELECT count() FROM events FINAL WHERE agent = {a:String}",
                        {"a": agent}).scalar() == 12


def test_ingest_transcript_labels_runs_by_their_reward(pipeline, reader, agent, tmp_path):
    runs = [{**RUN, "id": f"{agent}-wrong"},
            {**RUN, "id": f"{agent}-right", "reward": 1},
            {"id": f"{agent}-unknown", "messages": RUN["messages"]},
            {"id": f"{agent}-bad", "messages": "not a list"}]
    path = tmp_path / "runs.json"
    path.write_bytes(orjson.dumps(runs))
    result = ingest("transcript", "--format", "openai-chat", str(path), "--agent", agent,
                    "--run-id-key", "id", "--task-id-key", "task", env=pipeline.env)
    assert result.returncode == 0, result.stderr
    assert "skipped record 4: no 'messages' list of messages" in result.stderr
    rows = reader.query("SELECT run_id, outcome, steps, tool_calls, tool_errors, llm_calls, "
                        "input_tokens, cache_read_input_tokens FROM runs FINAL "
                        "WHERE agent = {a:String} ORDER BY run_id", {"a": agent}).rows
    assert rows == [[f"{agent}-right", "success", 2, 2, 1, 1, 1200, 1000],
                    [f"{agent}-unknown", "unknown", 2, 2, 1, 1, 1200, 1000],
                    [f"{agent}-wrong", "wrong", 2, 2, 1, 1, 1200, 1000]]
    tools = reader.query("SELECT tool, args_hash FROM tool_calls FINAL "
                         "WHERE run_id = {r:String} ORDER BY tool",
                         {"r": f"{agent}-right"}).rows
    assert tools == [["grep", canonical_args_hash("grep", {"pattern": "def save"})],
                     ["read_file", canonical_args_hash("read_file", {"path": "models.py"})]]


@pytest.mark.stack  # starts its own broker / `loopwatch up`
def test_ingest_without_loopwatch_up_starts_one_for_the_import(tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_bytes(orjson.dumps({"messages": RUN["messages"], "success": True}) + b"\n")
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("LOOPWATCH_")}
    env.update(PIPELINE_ENV)
    env["LOOPWATCH_DATA_DIR"] = str(tmp_path / "data")
    result = subprocess.run(
        [sys.executable, "-m", "loopwatch.ingest.cli", "ingest", "transcript", str(path)],
        env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "starting one for the import" in result.stderr
    assert "8 events (8 stored, 0 dead-lettered), 0 bad records skipped" in result.stderr
    assert not (tmp_path / "data" / "service.json").exists()  # and stopped it again
