"""The lean fold (msgspec structs, kind dispatch) against the fold before it
(:mod:`loopwatch.bench.fold_reference`: pydantic models, ``isinstance`` dispatch), on the bench's
event mix plus what the mix lacks (redeliveries, labels before their run, times with
offsets or none, extras, finer than microseconds, hostile events): every field of every
run state (changelog form, seen ids included), every ``runs`` row, every other row and
dead letter, and the counters must be identical. And a state the build before wrote to
the changelog is adopted: folding on from it ends where the old fold ends.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest

from loopwatch.bench.fold import bench_messages, changelogged_store
from loopwatch.bench.fold_reference import ReferencePipeline
from loopwatch.core.config import Settings
from loopwatch.processors import FOLD_BUILD
from loopwatch.processors.app import chunks
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.native import PURE_ENV
from loopwatch.processors.pipeline import Pipeline, RawMessage, Work
from loopwatch.processors.rows import run_row
from loopwatch.processors.runs import RunState

NOW = datetime(2026, 12, 2, tzinfo=UTC)
RUN = "0" * 8 + "-identity"


def _event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"event_type": kind, "run_id": RUN, "agent": "edge-agent", **fields}


def _edge_messages(offset: int) -> list[RawMessage]:
    """What the bench mix lacks, one run: a label before any event, times with an
    offset, none, and finer than microseconds, an extra field, a redelivered event, a
    schema violation and malformed JSON beside valid events."""
    ts = (datetime.now(UTC) - timedelta(minutes=30)).replace(microsecond=0)
    at = [(ts + timedelta(seconds=n)) for n in range(12)]
    label = _event("label", verdict="wrong", label_source="human",
                   event_id="0190d5a4-0000-7000-8000-00000000000a", ts=at[0].isoformat())
    start = _event("run.start", task_type="triage", model="m1", time_cap_s=60,
                   event_id="0190d5a4-0000-7000-8000-000000000001",
                   ts=at[1].astimezone(__import__("zoneinfo").ZoneInfo("Europe/Paris"))
                   .isoformat())
    naive = _event("step", step=1, event_id="0190d5a4-0000-7000-8000-000000000002",
                   ts=at[2].replace(tzinfo=None).isoformat())
    fine = _event("tool.call", tool="grep", args_hash="h", error_type="boom",
                  event_id="0190d5a4-0000-7000-8000-000000000003",
                  ts=at[3].isoformat().replace("+00:00", ".1234567Z"))
    extra = _event("llm.call", model="claude-sonnet-4", input_tokens=900, output_tokens=40,
                   cache_read_input_tokens=300, cost_usd=0.01, some_extra={"k": [1, 2]},
                   event_id="0190d5a4-0000-7000-8000-000000000004", ts=at[4].isoformat())
    calls = [_event("tool.call", tool="grep", args_hash="same", ts=at[5 + n].isoformat(),
                    event_id=f"0190d5a4-0000-7000-8000-00000000001{n}") for n in range(3)]
    end = _event("run.end", terminal_reason="model_done",
                 event_id="0190d5a4-0000-7000-8000-000000000009", ts=at[9].isoformat())
    bad = _event("step", step=-1)
    envelope = {"envelope_version": 1, "events": [start, naive, fine, *calls]}
    values = [orjson.dumps(label), orjson.dumps(envelope), orjson.dumps(extra),
              orjson.dumps({"envelope_version": 1, "events": [calls[1], end, bad]}),
              b'{"event_type": "step", "run_id": ', orjson.dumps(end)]
    return [RawMessage("loopwatch.events", 0, offset + n, value)
            for n, value in enumerate(values)]


def _messages(events: int) -> list[RawMessage]:
    settings = Settings(data_dir=Path("/nonexistent-identity"))
    messages = bench_messages(events, settings)
    # the first 20 messages come again after the rest (a redelivery after a rebalance)
    redelivered = messages[:20]
    return [*messages, *_edge_messages(10_000), *redelivered]


def _fold(build: type[Pipeline], messages: list[RawMessage], store: Any = None,
          python_rows: bool = False) -> tuple[Pipeline, list[bytes]]:
    """``python_rows``: the lean fold builds the call and label rows too, as the build
    before did (else the store's views write them from the ``events_in`` rows)."""
    pipeline = build(Settings(data_dir=Path("/nonexistent-identity")), store or MemoryRunStore(),
                     python_rows=python_rows)
    produced: list[bytes] = []
    for chunk in chunks(messages):
        touched: dict[str, RunState] = {}
        work = pipeline.fold(chunk, touched)
        work.rows.extend(pipeline.settle(touched).rows)
        produced.extend(_comparable(work))
    return pipeline, produced


def _comparable(work: Work) -> list[bytes]:
    """Every row (bar its insert and receipt times) and dead letter of a fold, as exact bytes."""
    out = []
    for table, rows in sorted(work.rows.tables.items()):
        for row in rows:
            kept = {key: value for key, value in row.items()
                    if key not in ("ingested_at", "received_at")}
            out.append(table.encode() + b" " + orjson.dumps(kept))
    out.extend(orjson.dumps([letter.letter_id, letter.source, letter.reason, letter.run_id,
                             letter.payload.decode(errors="replace")]) for letter in work.dead)
    return out


def _states(pipeline: Pipeline) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    return {state.run_id: (state.to_dict(), run_row(state, NOW))
            for state in pipeline.store.states()}


@pytest.fixture(scope="module")
def messages() -> list[RawMessage]:
    return _messages(20_000)


def test_lean_fold_reaches_the_same_states_rows_and_counters(messages: list[RawMessage]
                                                              ) -> None:
    before, before_rows = _fold(ReferencePipeline, messages)
    after, after_rows = _fold(Pipeline, messages, python_rows=True)
    old, new = _states(before), _states(after)
    assert len(old) > 1000 and RUN in old  # the mix and the edge run were both folded
    assert old[RUN][0]["verdict"] == "wrong" and old[RUN][0]["loop_detected"]
    assert before.counters.duplicates > 0 and before.counters.dead_letters == 2
    assert sorted(old) == sorted(new)
    for run_id, (state, row) in old.items():
        assert new[run_id] == (state, row), run_id  # every field, exactly
    assert after.counters == before.counters
    assert after_rows == before_rows
    # by default the views build the call and label rows (tests/test_event_views.py
    # compares them with these Python rows): the fold hands over all the rest
    _, lean_rows = _fold(Pipeline, messages)
    assert lean_rows == [row for row in before_rows
                         if not row.startswith((b"llm_calls ", b"tool_calls ", b"labels "))]


def test_a_state_the_build_before_changelogged_is_adopted(messages: list[RawMessage]) -> None:
    """The old fold folds the first half into the real ``TableRunStore`` (its changelog
    values as bytes, as recovery puts them in the table); the lean fold takes that table
    over and folds the rest: every state ends as the old fold's over all of it."""
    half = len(messages) // 2
    old_store = changelogged_store()
    _fold(ReferencePipeline, messages[:half], old_store)
    recovered = changelogged_store()
    for key, state in old_store._table.data.items():
        recovered._table.data[key] = orjson.dumps(state.to_dict())  # as recovery reads it
    assert recovered._table.data and all(isinstance(value, bytes)
                                         for value in recovered._table.data.values())
    _fold(Pipeline, messages[half:], recovered)
    whole, _ = _fold(ReferencePipeline, messages)
    adopted = {key.decode(): recovered.get(key.decode())
               for key in list(recovered._table.data)}  # every partition's, not the owned
    assert {run_id: (state.to_dict(), run_row(state, NOW))
            for run_id, state in adopted.items() if state is not None} == _states(whole)


def test_a_changelog_value_of_the_build_before_reads_back() -> None:
    """A literal changelog value written by the build before the lean fold (its
    ``TableRunStore.put``: ``orjson.dumps(state.to_dict())``) reads into the same state."""
    value = (b'{"run_id":"r1","partition":3,"agent":"support-bot","agent_version":"",'
             b'"task_type":"triage","model":"claude-sonnet-4","prompt_version":"v2",'
             b'"deployment":"","traffic_slice":"prod","worker_id":"","started_ms":1000,'
             b'"first_ms":1000,"last_ms":4000,"end_ms":null,"abandoned_ms":null,'
             b'"time_cap_s":null,"terminal_reason":"","cap":"","verdict":"","label_source":"",'
             b'"steps":1,"llm_calls":1,"tool_calls":2,"tool_errors":1,"llm_errors":0,'
             b'"input_tokens":900,"output_tokens":40,"cache_read_tokens":300,'
             b'"cache_creation_tokens":0,"cost_usd":0.0042,"reported_cost_usd":0.01,'
             b'"loop_detected":false,"loop_summary":"","recent_actions":["grep:h","grep:h"],'
             b'"seen":"AZDVpAAAcACAAAAAAAAAAQGQ1aQAAHAAgAAAAAAAAAI=","version":5,'
             b'"agent_rank":-1,"agent_named_at":0,"awaiting_run":false}')
    store = changelogged_store()
    store._table.data[b"r1"] = value
    state = store.get("r1")
    assert state is not None
    # fields added since take their defaults: ``folded_offset`` -1, unknown, which the
    # store's read-back takes as "every stored event folded", as that build did
    assert orjson.dumps(state.to_dict()) == value[:-1] + (
        b',"folded_offset":-1,"folded_since_ms":0}')
    assert copy.copy(state).outcome == ""


_FOLD_FROM_FILE = """
import dataclasses, sys, msgspec, orjson
from loopwatch.processors import FOLD_BUILD
from loopwatch.processors.pipeline import Pipeline, RawMessage
from tests.test_fold_identity import _fold, _states
with open(sys.argv[1], "rb") as file:
    messages = [RawMessage(*fields) for fields in msgspec.msgpack.decode(file.read())]
pipeline, rows = _fold(Pipeline, messages)
sys.stdout.buffer.write(orjson.dumps({
    "build": FOLD_BUILD, "rows": [row.decode() for row in rows], "states": _states(pipeline),
    "counters": dataclasses.asdict(pipeline.counters)}))
"""


def _fold_elsewhere(messages: list[RawMessage], tmp_path: Path, pure: bool) -> dict[str, Any]:
    path = tmp_path / "messages.msgpack"
    path.write_bytes(msgspec.msgpack.encode([(message.topic, message.partition, message.offset,
                                              message.value) for message in messages]))
    env = {key: value for key, value in os.environ.items() if key != PURE_ENV}
    done = subprocess.run([sys.executable, "-c", _FOLD_FROM_FILE, str(path)],
                          env={**env, PURE_ENV: "1"} if pure else env,
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                          check=True, timeout=300)
    return dict(orjson.loads(done.stdout))


@pytest.mark.skipif(os.environ.get(PURE_ENV) == "1", reason="installed without compiling")
def test_this_install_folds_with_the_compiled_build() -> None:
    """The README's install compiles the fold (setup.py); a stale build would say so."""
    assert FOLD_BUILD == "compiled"


def test_the_compiled_fold_and_its_sources_fold_alike(messages: list[RawMessage],
                                                      tmp_path: Path) -> None:
    """The same messages folded by the compiled modules and by their sources
    (``LOOPWATCH_PURE_PYTHON=1``), each in a process of its own: every row, state and
    counter is identical."""
    compiled = _fold_elsewhere(messages, tmp_path, pure=False)
    sources = _fold_elsewhere(messages, tmp_path, pure=True)
    assert sources["build"] == "sources (LOOPWATCH_PURE_PYTHON=1)"
    assert compiled["build"] == FOLD_BUILD
    assert len(compiled["states"]) > 1000 and compiled["counters"]["duplicates"] > 0
    assert compiled["rows"] == sources["rows"]
    assert compiled["states"] == sources["states"]
    assert compiled["counters"] == sources["counters"]
