"""What each chunk's write of a batch carries (``BatchFold``, run on the processor's
fold thread): the chunk's raw events; the batch's other rows, its ``runs`` rows and
its run state changes with the last chunk, or earlier once ``settle_max_runs`` runs
wait. The changes go with the write that carries their runs' rows, so a chunk's write
never takes another's changes (the changelog is never ahead of ClickHouse)."""

from __future__ import annotations

from pathlib import Path

from loopwatch.bench.fold import changelogged_store, envelopes
from loopwatch.core.config import Settings
from loopwatch.ingest.events import LlmCall, RunEnd, RunStart, Step
from loopwatch.processors.app import BatchFold
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.processors.rows import EVENTS_IN_TABLE
from loopwatch.store import tables


def _chunks(settings: Settings) -> list[list[RawMessage]]:
    """Two chunks (one partition, one message each): run ``a`` starts and calls a
    model in the first; run ``b`` runs whole and ``a`` ends in the second."""
    first = [RunStart(run_id="a", agent="x"), Step(run_id="a", agent="x", step=1),
             LlmCall(run_id="a", agent="x", model="gpt-4o", input_tokens=10)]
    second = [RunStart(run_id="b", agent="x"), RunEnd(run_id="b", agent="x"),
              RunEnd(run_id="a", agent="x")]
    return [envelopes(events, 1, settings.events_topic) for events in (first, second)]


def _fold(tmp_path: Path, settle_max_runs: int) -> list[tuple[dict[str, int], set[bytes]]]:
    settings = Settings(data_dir=tmp_path)
    store = changelogged_store()
    fold = BatchFold(Pipeline(settings, store), store, settle_max_runs)
    chunks = _chunks(settings)
    written = []
    for index, messages in enumerate(chunks):
        work, changes = fold.chunk(messages, last=index == len(chunks) - 1)
        written.append(({table: len(rows) for table, rows in work.rows.tables.items()},
                        set(changes)))
    return written


def test_the_runs_and_their_changes_go_with_the_batchs_last_chunk(tmp_path: Path) -> None:
    first, last = _fold(tmp_path, settle_max_runs=20_000)
    assert first == ({EVENTS_IN_TABLE: 1}, set())
    assert last == ({EVENTS_IN_TABLE: 1, tables.RUNS: 2}, {b"a", b"b"})


def test_a_chunk_that_reaches_settle_max_runs_takes_them_and_their_changes(
        tmp_path: Path) -> None:
    first, last = _fold(tmp_path, settle_max_runs=1)
    assert first == ({EVENTS_IN_TABLE: 1, tables.RUNS: 1}, {b"a"})
    assert last == ({EVENTS_IN_TABLE: 1, tables.RUNS: 2}, {b"a", b"b"})
