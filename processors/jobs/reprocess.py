"""Recompute derived rows from stored raw events (after a price-table or config change).

For every run closed since a time: re-fold its stored events through a fresh
:class:`loopwatch.processors.pipeline.Pipeline` (current prices and settings), and rewrite its
``llm_calls``, ``tool_calls`` and ``runs`` rows. Runs still open are left to the live
processors, which own their state. Rewritten rows replace the old ones through the
tables' dedup keys, so reprocessing twice changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import orjson
from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.processors.rows import EVENT_COLUMNS, EVENTS_IN_TABLE, event_json, run_row
from loopwatch.processors.runs import RunState
from loopwatch.store import tables
from loopwatch.store.clickhouse import connect, run_query
from loopwatch.store.reader import ServiceReader, running_service
from loopwatch.store.sink import ClickHouseSink

RUNS_SQL = """
SELECT run_id, state FROM runs FINAL
WHERE status = 'closed' AND closed_ts >= {since:DateTime64(3, 'UTC')}
"""
EVENTS_SQL = f"""
SELECT kafka_partition, kafka_offset, payload, {", ".join(EVENT_COLUMNS)} FROM events FINAL
WHERE run_id IN {{run_ids:Array(String)}} ORDER BY run_id, ts, kafka_offset
"""


class MemoryRunStore:
    """A plain dict of run states (one reprocess pass needs nothing more)."""

    def __init__(self) -> None:
        self.runs: dict[str, RunState] = {}

    def get(self, run_id: str) -> RunState | None:
        return self.runs.get(run_id)

    def put(self, state: RunState) -> None:
        self.runs[state.run_id] = state

    def delete(self, state: RunState) -> None:
        self.runs.pop(state.run_id, None)

    def states(self) -> Iterator[RunState]:
        return iter(list(self.runs.values()))


def reprocess_with(client: Client, settings: Settings, since: datetime,
                   chunk: int = 500) -> dict[str, Any]:
    closed = run_query(client, RUNS_SQL, {"since": since}).rows
    stored: dict[str, RunState] = {}
    skipped = 0
    for run_id, state in closed:
        try:
            stored[run_id] = RunState.from_dict(orjson.loads(state))
        except (orjson.JSONDecodeError, TypeError, KeyError, ValueError):
            skipped += 1  # a row without its state (written by hand or an older build)
    sink = ClickHouseSink(client)
    run_ids = sorted(stored)
    events = 0
    for start in range(0, len(run_ids), chunk):
        batch = run_ids[start:start + chunk]
        store = MemoryRunStore()
        # its rows priced with these settings, not the store's views' (which would
        # price them with the running processors' table): no events_in rows are written
        pipeline = Pipeline(settings, store, python_rows=True)
        messages = [
            RawMessage(settings.events_topic, int(partition), int(offset),
                       event_json(dict(zip(EVENT_COLUMNS, columns, strict=True)), payload))
            for partition, offset, payload, *columns in
            run_query(client, EVENTS_SQL, {"run_ids": batch}).rows
        ]
        events += len(messages)
        work = pipeline.process(messages)
        work.rows.tables.pop(EVENTS_IN_TABLE, None)
        work.rows.tables.pop(tables.DEAD_LETTERS, None)
        work.rows.tables[tables.RUNS] = []
        now = datetime.now(UTC)
        for run_id in batch:
            state = store.get(run_id)
            if state is None:
                continue
            original = stored[run_id]
            if state.end_ms is None and original.abandoned_ms is not None:
                state.abandoned_ms = original.abandoned_ms
                state.version += 1
            work.rows.add(tables.RUNS, run_row(state, now))
        sink.write_batch(work.rows)
    return {"runs": len(run_ids), "events": events, "skipped": skipped}


def reprocess_since(settings: Settings, since: datetime) -> dict[str, Any]:
    announced = running_service(settings)
    if announced is not None:
        return ServiceReader(announced["url"]).post("/admin/reprocess",
                                                    {"since": since.isoformat()})
    return reprocess_with(connect(settings), settings, since)
