"""Bulk-load synthetic rows straight into a chdb store (a child of ``loopwatch.bench.pipeline``).

    python -m loopwatch.bench._bulkload DATA_DIR EVENTS SEED

chdb lets one process own a data path at a time, so this runs in its own process
*before* ``loopwatch up`` opens the store: it migrates, folds generated events through
an in-memory :class:`loopwatch.processors.pipeline.Pipeline` and inserts every row it implies.
It prints ``{"events": stored, "seconds": s}`` as JSON on stdout.
"""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
from clickhouse_connect.driver.client import Client

from loopwatch.core.config import load_settings
from loopwatch.ingest.wire import encode_envelope
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.store.clickhouse import migrate
from loopwatch.store.sink import ClickHouseSink

#: events per message, as the SDK groups them
ENVELOPE_EVENTS = 200


def bulk_load(data_dir: Path, events: int, seed: int, chunk: int = 20_000) -> dict[str, float]:
    """Streams the fleet's events a simulated hour at a time, so ten million never sit in
    memory."""
    from loopwatch.bench.pipeline import event_spans

    started = time.monotonic()
    settings = load_settings(data_dir=data_dir)
    client = migrate(settings)
    sink = ClickHouseSink(client)
    pipeline = Pipeline(settings, MemoryRunStore())
    # history well before the pipeline's own traffic, so the two never share run ids
    end = datetime.now(UTC) - timedelta(days=2)
    offset = 0
    for span in event_spans(events, seed, end):
        span = span[:events - offset]
        for start in range(0, len(span), chunk):
            part = span[start:start + chunk]
            messages = [
                RawMessage("bench.bulk", 0, offset + start + index,
                           encode_envelope(part[index:index + ENVELOPE_EVENTS]))
                for index in range(0, len(part), ENVELOPE_EVENTS)
            ]
            work = pipeline.process(messages)
            work.rows.extend(pipeline.sweep().rows)
            sink.write_batch(work.rows)
        offset += len(span)
        if offset >= events:
            break
    merge_history(client)
    stored = int(client.command("SELECT count() FROM events"))  # type: ignore[arg-type]
    return {"events": stored, "seconds": time.monotonic() - started}


def merge_history(client: Client) -> None:
    """Merge every table down to one part per partition, as a store's history sits after
    its background merges. Left as its inserts made them (tens of small parts), the
    merges they were due ran in the pipeline's measured window and counted as its
    storing: ~200k bulk rows rewritten in a 500k-event window, most of its
    ``MergeMutate`` CPU (docs/performance.md)."""
    for (table,) in client.query(
            "SELECT name FROM system.tables WHERE database = currentDatabase() "
            "AND engine LIKE '%MergeTree'").result_rows:
        client.command(f"OPTIMIZE TABLE `{table}` FINAL")


def main() -> None:
    data_dir, events, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    sys.stdout.write(orjson.dumps(bulk_load(data_dir, events, seed)).decode() + "\n")


if __name__ == "__main__":
    main()
