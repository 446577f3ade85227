"""Bulk-load synthetic rows straight into a chdb store (run as a child by ``bench.pipeline``).

    python -m bench._bulkload DATA_DIR EVENTS SEED

chdb lets one process own a data path at a time, so this runs in its own process
*before* ``loopwatch up`` opens the store: it migrates, folds generated events through
an in-memory :class:`processors.pipeline.Pipeline` and inserts every row it implies.
It prints ``{"events": stored, "seconds": s}`` as JSON on stdout.
"""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson

from ingest.wire import encode_event
from loopwatch.config import load_settings
from loopwatch.reprocess import MemoryRunStore
from loopwatch.store.clickhouse import migrate
from processors.pipeline import Pipeline, RawMessage
from processors.sink import ClickHouseSink


def bulk_load(data_dir: Path, events: int, seed: int, chunk: int = 20_000) -> dict[str, float]:
    from bench.pipeline import generate_events

    started = time.monotonic()
    settings = load_settings(data_dir=data_dir)
    client = migrate(settings)
    sink = ClickHouseSink(client)
    pipeline = Pipeline(settings, MemoryRunStore())
    # history well before the pipeline's own traffic, so the two never share run ids
    end = datetime.now(UTC) - timedelta(days=2)
    generated = generate_events(events, seed, end)
    for start in range(0, len(generated), chunk):
        messages = [
            RawMessage("bench.bulk", 0, start + index, encode_event(event))
            for index, event in enumerate(generated[start:start + chunk])
        ]
        work = pipeline.process(messages)
        work.rows.extend(pipeline.sweep().rows)
        sink.write_batch(work.rows)
    stored = int(client.command("SELECT count() FROM events"))  # type: ignore[arg-type]
    return {"events": stored, "seconds": time.monotonic() - started}


def main() -> None:
    data_dir, events, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    sys.stdout.write(orjson.dumps(bulk_load(data_dir, events, seed)).decode() + "\n")


if __name__ == "__main__":
    main()
