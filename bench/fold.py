"""The processor's fold and inserts without Kafka or faust, in seconds instead of the
full bench's minutes: what one event costs the pipeline itself.

``python -m loopwatch.bench.fold [--events N] [--no-write] [--json]`` generates the bench's
event mix, packs it into messages as the SDK's ``Emitter`` does, folds the messages in
the processor's chunks (:func:`loopwatch.processors.app.chunks`) and, unless ``--no-write``,
inserts each chunk's rows into a fresh chdb store in a temporary folder on the calling
thread, as the processor's sink thread does. It prints the CPU per event of the fold,
of the inserts' calling thread, of the whole process, and by thread.

Each chunk is settled on its own (the processor settles once per batch of several
chunks), so ``runs`` rows are written a little more often than in ``loopwatch up``.
The figures move with the machine: compare builds paired, in one sitting.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from loopwatch.bench.pipeline import cpu_by_kind, generate_events, thread_cpu, threads_note
from loopwatch.core.config import Settings
from loopwatch.ingest.events import EventBase
from loopwatch.ingest.sdk import MAX_BATCH, MAX_MESSAGE_BYTES, partition_for
from loopwatch.ingest.wire import envelope_chunks, message_value
from loopwatch.processors.app import chunks, tune_gc
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.processors.runs import RunState
from loopwatch.store.clickhouse import migrate
from loopwatch.store.sink import ClickHouseSink


def envelopes(events: list[EventBase], partitions: int, topic: str) -> list[RawMessage]:
    """The events as the processor would consume them: each encoded as the SDK's
    ``Emitter.emit`` does, grouped per partition (of ``run_id``, as the SDK chooses it)
    into the messages the ``Emitter`` sends with its defaults
    (:func:`loopwatch.ingest.wire.envelope_chunks`,
    :func:`loopwatch.ingest.wire.message_value`), in emit order, the partitions taken in turn.

    >>> from loopwatch.ingest.events import Step
    >>> steps = [Step(run_id=f"r{n}", agent="a", step=n) for n in range(1200)]
    >>> [(m.partition, m.offset, len(orjson.loads(m.value)["events"]))
    ...  for m in envelopes(steps, 2, "t")]
    [(0, 0, 500), (1, 0, 500), (0, 1, 93), (1, 1, 107)]
    """
    by_partition: dict[int, list[bytes]] = defaultdict(list)
    for event in events:
        by_partition[partition_for(event.run_id, partitions)].append(
            event.__pydantic_serializer__.to_json(event, exclude_none=True))
    queues = {partition: [message_value(chunk) for chunk in envelope_chunks(
                  lines, MAX_BATCH, MAX_MESSAGE_BYTES)]
              for partition, lines in sorted(by_partition.items())}
    messages: list[RawMessage] = []
    for round_ in range(max((len(queue) for queue in queues.values()), default=0)):
        for partition, queue in queues.items():
            if round_ < len(queue):
                messages.append(RawMessage(topic, partition, round_, queue[round_]))
    return messages


def measure_fold(events: int, write: bool, data_dir: Path, seed: int = 7) -> dict[str, Any]:
    """Fold (and write) ``events`` generated events; CPU figures per event."""
    settings = Settings(data_dir=data_dir)
    messages = envelopes(generate_events(events, seed, datetime.now(UTC) - timedelta(minutes=1)),
                         settings.partitions, settings.events_topic)
    client = migrate(settings) if write else None
    sink = ClickHouseSink(client) if client is not None else None
    pipeline = Pipeline(settings, MemoryRunStore())
    tune_gc()
    pid = os.getpid()
    threads_before = thread_cpu(pid)
    fold_s = insert_s = 0.0
    started = time.perf_counter()
    for chunk in chunks(messages):
        before = time.thread_time()
        touched: dict[str, RunState] = {}
        work = pipeline.fold(chunk, touched)
        work.rows.extend(pipeline.settle(touched).rows)
        folded = time.thread_time()
        fold_s += folded - before
        if sink is not None:
            sink.write_batch(work.rows)
            insert_s += time.thread_time() - folded
    elapsed = time.perf_counter() - started
    folded_events = pipeline.counters.events
    per_event = 1e6 / max(folded_events, 1)
    stored = None if client is None else int(
        client.query("SELECT uniqExact(event_id) FROM events").result_rows[0][0])
    return {
        "events": folded_events,
        "messages": pipeline.counters.messages,
        "stored_events": stored,
        "runs_closed": pipeline.counters.runs_closed,
        "dead_letters": pipeline.counters.dead_letters,
        "fold_us_per_event": fold_s * per_event,
        "insert_calling_thread_us_per_event": insert_s * per_event if write else None,
        "wall_s": elapsed,
        "threads": threads_note(cpu_by_kind(threads_before, thread_cpu(pid), pid,
                                             folded_events)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loopwatch.bench.fold",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--no-write", action="store_true", help="fold only; no chdb store")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="loopwatch-fold-") as tmp:
        result = measure_fold(args.events, not args.no_write, Path(tmp))
    if args.json:
        print(orjson.dumps(result).decode())
        return
    inserts = result["insert_calling_thread_us_per_event"]
    print(f"{result['events']} events in {result['messages']} messages, "
          f"{result['wall_s']:.1f} s: fold {result['fold_us_per_event']:.1f} µs/event"
          + ("" if inserts is None else f", inserts (calling thread) {inserts:.1f} µs/event, "
             f"{result['stored_events']} stored"))
    print(result["threads"])


if __name__ == "__main__":
    main()
