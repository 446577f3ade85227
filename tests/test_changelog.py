"""The run-state changelog: what a restarted or new worker recovers its runs from.

The processor sends state changes as record batches of its own rather than through
faust's per-message buffer; these tests read the changelog topic back as faust's
recovery does (last value per key) and check it holds the states the runs table shows.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from pathlib import Path

import orjson
import pytest

from loopwatch.bench.pipeline import read_topic
from loopwatch.core.config import Settings
from loopwatch.core.embedded.broker import EmbeddedBroker
from loopwatch.core.threads import FOLD_THREAD_NAME, os_thread_name
from loopwatch.ingest.events import Step
from loopwatch.ingest.sdk import Emitter, RunContext
from loopwatch.ingest.wire import encode_event
from loopwatch.processors.app import Processor
from loopwatch.processors.pipeline import RawMessage
from loopwatch.processors.runs import RunState, seen_ids
from loopwatch.runtime import _store_reads
from loopwatch.store.reader import ServiceReader, ServiceUnreachable
from tests.conftest import DiscardSink, scalar, wait_for

CHANGELOG_TOPIC = f"{Settings().consumer_group}-runs-changelog"


def latest_changelog_values(bootstrap: str) -> dict[bytes, bytes | None]:
    """The last value of every key on the changelog, read from the beginning."""
    return {record.key: record.value for record in read_topic(bootstrap, CHANGELOG_TOPIC)}


def recovered_state(bootstrap: str, run_id: str) -> RunState | None:
    value = latest_changelog_values(bootstrap).get(run_id.encode())
    return None if value is None else RunState.from_dict(orjson.loads(value))


def seen(state: RunState) -> set[uuid.UUID]:
    return {uuid.UUID(bytes=event_id) for event_id in seen_ids(state)}


def stored_ids(reader, run_id: str) -> set[uuid.UUID]:
    rows = reader.query("SELECT toString(event_id) FROM events FINAL WHERE run_id = {r:String}",
                        {"r": run_id}).rows
    return {uuid.UUID(row[0]) for row in rows}


def test_changelog_holds_the_latest_state_of_open_and_closed_runs(
        broker: EmbeddedBroker, pipeline, reader, emitter: Emitter, agent: str):
    """Guarantee: once a batch is stored, the changelog holds each touched run's state
    as of that batch (raw orjson value, key = run_id), exactly as faust would recover it."""
    with emitter.run(agent=agent, model="gpt-4o") as closed:
        closed.step()
        closed.llm_call(input_tokens=120, output_tokens=7)
        closed.step()
    still_open = RunContext(emitter, f"{agent}-open", {"agent": agent, "model": "gpt-4o"})
    still_open.start()
    still_open.step()
    still_open.tool_call(tool="search")
    assert emitter.flush(30)
    wait_for(lambda: scalar(reader, "SELECT count() FROM runs FINAL WHERE agent = {a:String}",
                            a=agent) == 2, 60, what="both runs stored")

    ended = wait_for(lambda: recovered_state(broker.bootstrap, closed.run_id), 30,
                     what="the closed run on the changelog")
    assert (ended.agent, ended.steps, ended.llm_calls, ended.input_tokens,
            ended.output_tokens) == (agent, 2, 1, 120, 7)
    assert ended.end_ms is not None and ended.terminal_reason == "model_done"
    assert seen(ended) == stored_ids(reader, closed.run_id)
    assert len(seen(ended)) == 5  # start, step, llm call, step, end

    opened = wait_for(lambda: recovered_state(broker.bootstrap, still_open.run_id), 30,
                      what="the open run on the changelog")
    assert (opened.agent, opened.steps, opened.tool_calls, opened.end_ms) == (agent, 1, 1, None)
    assert seen(opened) == stored_ids(reader, still_open.run_id)
    assert len(seen(opened)) == 3

    still_open.step()
    assert emitter.flush(30)
    wait_for(lambda: (state := recovered_state(broker.bootstrap, still_open.run_id))
             and state.steps == 2, 60, what="the open run's next step on the changelog")


@pytest.mark.parametrize("value", [
    b'{"run_id": "damaged", "partition": 0, "ste',
    b'{"run_id": "damaged", "partition": 0, "steps": "three", "last_ms": 2000}',
    b'{"run_id": "damaged", "partition": 0, "recent_actions": [7], "last_ms": 2000}',
], ids=["cut-short", "steps-text", "action-number"])
def test_a_changelogged_state_that_cannot_be_read_is_read_from_the_store_instead(
        tmp_path: Path, value: bytes):
    """A run's value on the changelog that does not decode (cut short) raised on every
    event of that run, and during the sweep's re-index stopped abandonment for every
    run. One that decodes but holds a field of another type (an incompatible build)
    cost each of the run's events a dead letter (a text step count), or its run was
    counted on from the wrong values (a number among the actions read as a state). The processor now
    drops it and takes the run from ClickHouse (``lookup_runs``, as for a run it never
    saw), so counting goes on from the last stored row. The faust table is real (memory
    store, nothing started: no broker is needed to read and write its data)."""
    stored = RunState(run_id="damaged", partition=0, agent="a", first_ms=1_000,
                      last_ms=2_000, steps=4, version=5)
    processor = Processor(Settings(data_dir=tmp_path), "127.0.0.1:1", DiscardSink(),
                          lookup_runs=lambda run_ids: {run_id: stored for run_id in run_ids
                                                       if run_id == "damaged"})
    processor.table.data[b"damaged"] = value
    assert processor.store.get("damaged") is None
    steps = [Step(run_id="damaged", agent="a", step=step) for step in (5, 6)]
    work = processor.pipeline.process([RawMessage("loopwatch.events", 0, offset,
                                                  encode_event(step))
                                       for offset, step in enumerate(steps)])
    assert work.dead == []
    assert processor.pipeline.counters.processing_errors == 0
    (row,) = work.rows.tables["runs"]
    assert (row["run_id"], row["steps"], row["version"]) == ("damaged", 6, 7)


def test_a_sweep_pass_that_cannot_reach_the_store_is_logged_and_tried_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """The sweep runs in a faust timer, where an exception crashes the app (and in
    ``loopwatch up`` the embedded broker and its memory with it). A worker whose store
    service does not answer (a socket nothing listens on: a real refused connection)
    cannot read the open runs it would adopt after an assignment: each pass logs that
    and returns, and the next pass asks again. No faust worker runs here, so the test
    says the table is recovered and which partitions the worker was assigned. Each pass
    reads on the fold thread, with the batches' folds, not on the event loop."""
    gone = tmp_path / "service.sock"  # left by an owner that was killed
    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).bind(str(gone))
    unreachable = ServiceReader(f"unix:{gone}")
    open_runs, lookup_runs = _store_reads(unreachable)
    asked: list[int] = []

    def counted_open_runs() -> list[RunState]:
        asked.append(os_thread_name())
        return open_runs()

    processor = Processor(Settings(data_dir=tmp_path), "127.0.0.1:1", DiscardSink(),
                          open_runs=counted_open_runs, lookup_runs=lookup_runs)
    monkeypatch.setattr(processor, "_ready", lambda: True)
    monkeypatch.setattr(processor.store, "active_partitions", lambda: {0, 1})
    with caplog.at_level(logging.ERROR, logger="loopwatch.processors.app"):
        for _ in range(2):
            asyncio.run(processor._sweep())
    assert asked == [FOLD_THREAD_NAME] * 2  # where every read and change of run state runs
    failures = [record for record in caplog.records
                if record.getMessage().startswith("the sweep failed")]
    assert len(failures) == 2
    assert failures[0].exc_info is not None
    assert isinstance(failures[0].exc_info[1], ServiceUnreachable)
