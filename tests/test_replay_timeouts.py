"""A timed-out tool call in replay and in the drill-down timeline (issue 26, item 13).

The SDK emits a timed-out call when it really ends, to carry its true duration, so its
event can come after the run's end. Scripted run: an LLM call, a tool call that timed
out after 500 ms (true duration 550 ms), the agent's next LLM call 10 ms after the
timeout, ``run.end`` 20 ms after it; the tool's event is stamped at its true end, 30 ms
after ``run.end``. Stored through the real pipeline into the in-process chdb store.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from typer.testing import CliRunner

from loopwatch.cli import app
from loopwatch.dashboards.web.api import WebApi
from loopwatch.ingest.events import EventBase, LlmCall, RunEnd, RunStart, ToolCall
from loopwatch.ingest.wire import encode_envelope
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.processors.replay import load_recording
from loopwatch.store.reader import DirectReader
from loopwatch.store.sink import ClickHouseSink


@pytest.fixture(scope="module")
def timed_out_run(local_store) -> str:
    settings, client = local_store
    run_id = f"timeout-{uuid.uuid4().hex[:10]}"
    common = {"run_id": run_id, "agent": f"timeout-agent-{uuid.uuid4().hex[:6]}",
              "model": "gpt-4o"}
    t0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=20)
    ms = lambda n: t0 + timedelta(milliseconds=n)  # noqa: E731
    events: list[EventBase] = [
        RunStart(ts=ms(0), **common),
        LlmCall(ts=ms(2000), step=0, input_tokens=100, output_tokens=10, latency_ms=400,
                **common),
        # started at 3000, timed out at 3500, really ended at 3550
        ToolCall(ts=ms(3550), step=1, tool="search", args_hash="search-1", latency_ms=500,
                 timeout_ms=500, timed_out=True, error_type="timeout",
                 late_completion_ms=550, **common),
        LlmCall(ts=ms(3510), step=2, input_tokens=120, output_tokens=12, latency_ms=5,
                **common),
        RunEnd(ts=ms(3520), terminal_reason="cannot_complete", **common),
    ]
    # emitted in the order an SDK run sends them: the late tool call last
    order = [events[0], events[1], events[3], events[4], events[2]]
    pipeline = Pipeline(settings, MemoryRunStore())
    work = pipeline.process([RawMessage("timeouts", 0, 0, encode_envelope(order))])
    ClickHouseSink(client).write_batch(work.rows)
    return run_id


def test_replay_shows_the_timeout_and_the_true_duration_in_order(local_store, timed_out_run):
    settings, client = local_store
    steps = load_recording(DirectReader(client), timed_out_run).steps
    assert [(s.type, s.step, s.latency_ms, s.timed_out, s.true_duration_ms) for s in steps] == [
        ("llm", 0, 400.0, False, None), ("tool", 1, 500.0, True, 550.0),
        ("llm", 2, 5.0, False, None)]
    result = CliRunner().invoke(app, ["replay", timed_out_run,
                                      "--data-dir", str(settings.data_dir)])
    assert result.exit_code == 0, result.output
    heads = [line for line in result.stdout.splitlines() if "· step " in line]
    assert len(heads) == 3 and "#1 · step 1 · tool search · " in heads[1]
    assert "timed out after 500 ms, true duration 550 ms" in heads[1]


def test_the_timeline_puts_a_late_tool_call_when_it_timed_out(local_store, timed_out_run):
    body = WebApi(DirectReader(local_store[1])).panel("run_timeline",
                                                      {"run_id": [timed_out_run]})
    time, event = body["columns"].index("time"), body["columns"].index("event")
    moments = [datetime.fromisoformat(row[time].replace("Z", "+00:00")) for row in body["rows"]]
    assert [(round((moment - moments[0]).total_seconds() * 1000), row[event])
            for moment, row in zip(moments, body["rows"], strict=True)] == [
        (0, "run.start"), (2000, "llm.call"), (3500, "tool.call"), (3510, "llm.call"),
        (3520, "run.end")]
