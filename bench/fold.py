"""The processor's fold and inserts without Kafka or faust, in seconds instead of the
full bench's minutes: what one event costs the pipeline itself.

``python -m loopwatch.bench.fold [--events N] [--repeats R] [--no-write] [--json]``
generates the bench's event mix, packs it into messages as the SDK's ``Emitter`` does,
folds the messages in the processor's chunks (:func:`loopwatch.processors.app.chunks`) and,
unless ``--no-write``, inserts each chunk's rows into a fresh chdb store in a temporary
folder on the calling thread, as the processor's sink thread does. It prints the CPU per
event of the fold, of the inserts' calling thread, of the whole process, and by thread.

Before that it measures the fold of this build against the fold before the lean fold
(:mod:`loopwatch.bench.fold_reference`: pydantic models, ``isinstance`` dispatch) on the
same messages, ``R`` times in turn, each in a fresh pipeline whose run states go through
the real ``TableRunStore`` (changelog values encoded, as in the processor): per build the
decode alone, the fold (decode included) and the settle (changelog values and ``runs``
rows), as medians, and ``ratio``, the median of the paired ratios new/old of fold + settle.

Each chunk is settled on its own (the processor settles once per batch of several
chunks), so ``runs`` rows are written a little more often than in ``loopwatch up``.
The figures move with the machine: compare builds paired, in one sitting.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from loopwatch.bench.fold_reference import ReferencePipeline
from loopwatch.bench.open_run_heap import _ChangelogFreeTable, _OnePartitionApp
from loopwatch.bench.pipeline import cpu_by_kind, generate_events, thread_cpu, threads_note
from loopwatch.core.config import Settings
from loopwatch.ingest.events import EventBase
from loopwatch.ingest.sdk import MAX_BATCH, MAX_MESSAGE_BYTES, partition_for
from loopwatch.ingest.wire import decode_message, envelope_chunks, message_value
from loopwatch.processors.app import TableRunStore, chunks, tune_gc
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.kafka_writes import KafkaWrites
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


BUILDS: dict[str, type[Pipeline]] = {"before": ReferencePipeline, "after": Pipeline}


def bench_messages(events: int, settings: Settings, seed: int = 7) -> list[RawMessage]:
    """The bench mix of about ``events`` events as the processor consumes them."""
    return envelopes(generate_events(events, seed, datetime.now(UTC) - timedelta(minutes=1)),
                     settings.partitions, settings.events_topic)


def changelogged_store() -> TableRunStore:
    """The processor's run store over a stand-in table: every put encodes the state's
    changelog value, as in the processor; the changes are dropped, not sent."""
    app: Any = _OnePartitionApp()
    return TableRunStore(_ChangelogFreeTable(), app, "bench", KafkaWrites(retry_s=1.0))


def fold_pass(build: type[Pipeline], settings: Settings, messages: list[RawMessage]
              ) -> dict[str, float]:
    """One build's CPU seconds over ``messages``: decode alone, then fold and settle in
    the processor's chunks (a fresh pipeline and store)."""
    started = time.thread_time()
    for message in messages:
        decode_message(message.value, settings.max_message_bytes,
                       structs=build.decode_structs)
    decode_s = time.thread_time() - started
    store = changelogged_store()
    pipeline = build(settings, store)
    fold_s = settle_s = 0.0
    for chunk in chunks(messages):
        before = time.thread_time()
        touched: dict[str, RunState] = {}
        pipeline.fold(chunk, touched)
        folded = time.thread_time()
        pipeline.settle(touched)
        store.take_changes()
        settle_s += time.thread_time() - folded
        fold_s += folded - before
    return {"decode": decode_s, "fold": fold_s, "settle": settle_s,
            "events": pipeline.counters.events}


def compare_builds(events: int, repeats: int, data_dir: Path) -> dict[str, Any]:
    """µs per event of the fold before and after the lean fold, on the same messages,
    ``repeats`` passes of each in turn: medians, and the median paired ratio."""
    settings = Settings(data_dir=data_dir)
    messages = bench_messages(events, settings)
    tune_gc()
    passes: dict[str, list[dict[str, float]]] = {name: [] for name in BUILDS}
    for _ in range(repeats):
        for name, build in BUILDS.items():
            passes[name].append(fold_pass(build, settings, messages))
    result: dict[str, Any] = {}
    for name, runs in passes.items():
        counted = runs[0]["events"]
        result[name] = {f"{part}_us_per_event": statistics.median(
            run[part] for run in runs) * 1e6 / counted for part in ("decode", "fold", "settle")}
        result[name]["events"] = counted
    ratios = [(after["fold"] + after["settle"]) / (before["fold"] + before["settle"])
              for before, after in zip(passes["before"], passes["after"], strict=True)]
    result["ratio"] = statistics.median(ratios)
    result["ratios"] = ratios
    return result


def measure_fold(events: int, write: bool, data_dir: Path, seed: int = 7) -> dict[str, Any]:
    """Fold (and write) ``events`` generated events; CPU figures per event."""
    settings = Settings(data_dir=data_dir)
    messages = bench_messages(events, settings, seed)
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
    parser.add_argument("--repeats", type=int, default=3,
                        help="passes of each build for the before/after comparison (0: none)")
    parser.add_argument("--no-write", action="store_true", help="fold only; no chdb store")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="loopwatch-fold-") as tmp:
        builds = compare_builds(args.events, args.repeats, Path(tmp)) if args.repeats else None
        result = measure_fold(args.events, not args.no_write, Path(tmp))
    result["builds"] = builds
    if args.json:
        print(orjson.dumps(result).decode())
        return
    if builds is not None:
        for name in BUILDS:
            figures = builds[name]
            print(f"{name:>6}: decode {figures['decode_us_per_event']:.2f}, fold (decode "
                  f"included) {figures['fold_us_per_event']:.2f}, settle "
                  f"{figures['settle_us_per_event']:.2f} µs/event")
        print(f"after/before (fold + settle), median of {args.repeats} paired passes: "
              f"{builds['ratio']:.3f} ({', '.join(f'{r:.3f}' for r in builds['ratios'])})")
    inserts = result["insert_calling_thread_us_per_event"]
    print(f"{result['events']} events in {result['messages']} messages, "
          f"{result['wall_s']:.1f} s: fold {result['fold_us_per_event']:.1f} µs/event"
          + ("" if inserts is None else f", inserts (calling thread) {inserts:.1f} µs/event, "
             f"{result['stored_events']} stored"))
    print(result["threads"])


if __name__ == "__main__":
    main()
