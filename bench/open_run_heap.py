"""Processor memory per open run: the Python heap an open run keeps.

Folds batches of ``run.start`` events (no end) through the real
:class:`loopwatch.processors.pipeline.Pipeline` into the real
:class:`loopwatch.processors.app.TableRunStore`, over a stand-in for the faust table that has
the same layout (``data``: bytes key -> state); the store encodes each changelog value
and the changes are dropped instead of sent, after the batch and after the sweep. With
tracemalloc it measures what two batches left allocated once their transient objects
are gone: the run states, their keys, the deadline index, and the containers holding
them, divided by the runs.
Counting from an empty pipeline matters: measured over the second batch alone, the
figure for the same build was 694 or 1128 B depending on whether a dict or set resize
fell into that batch (whether the batches straddled a deadline bucket).
``python -m loopwatch.bench.open_run_heap [RUNS]``.

Why not process RSS alone (``loopwatch.bench.pipeline`` reports it beside this): RSS moves in
whole allocator pools. A worker's first batch of 80k runs took ~1 GB of transient
objects (rows, changelog messages) whose freed pools later batches reuse, so per-batch
growth read -2 to +12 KB per run on the same build.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from faust.types import TP

from loopwatch.core.config import Settings
from loopwatch.ingest.events import EventBase, RunStart
from loopwatch.ingest.wire import encode_envelope
from loopwatch.processors.app import KafkaWrites, TableRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage

ENVELOPE_EVENTS = 200


class _ChangelogFreeTable:
    """What :class:`TableRunStore` touches of a faust table, minus the broker."""

    def __init__(self) -> None:
        self.data: dict[bytes, Any] = {}


class _Assignor:
    def assigned_actives(self) -> set[TP]:
        return {TP("bench", 0)}


class _OnePartitionApp:
    """What :class:`TableRunStore` asks of the faust app: which partitions it owns."""

    assignor = _Assignor()


def open_run_starts(runs: int) -> list[EventBase]:
    """``run.start`` events of ``runs`` new runs that never end (also what
    :func:`loopwatch.bench.pipeline.open_run_memory` sends through the broker)."""
    now = datetime.now(UTC)
    return [RunStart(run_id=uuid.uuid4().hex, ts=now, agent="bench-open", task_type="hold",
                     model="claude-sonnet-4", prompt_version="v1", deployment="d1",
                     step_cap=50)
            for _ in range(runs)]


def _batch(runs: int, offset: int) -> list[RawMessage]:
    starts = open_run_starts(runs)
    return [RawMessage("bench", 0, offset + index,
                       encode_envelope(starts[index:index + ENVELOPE_EVENTS]))
            for index in range(0, runs, ENVELOPE_EVENTS)]


def heap_per_open_run(runs: int = 20_000) -> float:
    """Bytes of Python heap each of ``runs`` open runs keeps (two batches)."""
    settings = Settings(data_dir=Path("/nonexistent-bench"))
    app: Any = _OnePartitionApp()
    store = TableRunStore(_ChangelogFreeTable(), app, "bench", KafkaWrites(retry_s=1.0))
    pipeline = Pipeline(settings, store)

    def fold(messages: list[RawMessage]) -> None:
        touched: dict[str, Any] = {}
        work = pipeline.fold(messages, touched)
        work.rows.extend(pipeline.settle(touched).rows)
        for rows in work.rows.tables.values():
            orjson.dumps(rows)  # the sink's encoding, as transient as in the processor
        store.take_changes()  # the processor sends them after every batch
        pipeline.sweep()
        store.take_changes()

    batches = [_batch(runs // 2, 0), _batch(runs - runs // 2, runs // 2)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        while batches:
            fold(batches.pop(0))
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    kept = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    return kept / runs


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    print(f"{heap_per_open_run(count):.0f} bytes of Python heap per open run")
