"""The store's write path alone: what storing an event costs ClickHouse (chdb) and us.

``python -m loopwatch.bench.store_path [--events N] [--runs R] [--json]`` folds the
bench's event mix (:func:`loopwatch.bench.pipeline.generate_events`, packed as the SDK
sends it) once per alternative, before anything is measured, and then stores it in a
fresh chdb store, in a fresh process, measuring the process's CPU (every thread: the
inserts run in chdb's) from the first insert until the store's merges have settled.
The alternatives run interleaved, ``R`` times each; the medians are reported, with the
ratio to today's path and the bytes stored per event. Every alternative must store the
same tables (row counts and per-column hashes of ``events``, ``llm_calls``,
``tool_calls``, ``labels`` and ``runs FINAL`` equal), or the bench fails.

The alternatives:

- ``python_rows``: the path before the generated views: ``events`` split from
  ``events_in`` by migration 006's view, ``llm_calls`` / ``tool_calls`` / ``labels``
  rows built in Python (their building is the fold's cost, done beforehand here;
  their encoding is measured), one insert per table per chunk of ~16k events,
  ClickHouse's default parallel parsing; ``python_rows_100k`` the same per ~100k events;
- ``views``: the raw events only, parsed once by the generated views
  (:mod:`loopwatch.store.event_views`), per ~100k events, parallel parsing off, one
  insert thread (the sink's settings); ``views_parallel_parsing`` and
  ``views_insert_threads`` put one of the two settings back to ClickHouse's default;
  ``views_16k`` inserts per ~16k events.

The figures move with the machine and whatever else runs on it: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
from clickhouse_connect.driver.client import Client

from loopwatch.bench.fold import envelopes
from loopwatch.bench.pipeline import generate_events
from loopwatch.core.config import Settings
from loopwatch.core.pricing import PriceTable, cost_mismatch
from loopwatch.ingest.events import LlmCall
from loopwatch.ingest.wire import decode_message
from loopwatch.processors import rows
from loopwatch.processors.app import chunks
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.processors.runs import RunState
from loopwatch.store import event_views, tables
from loopwatch.store.clickhouse import migrate
from loopwatch.store.schema_versions import migrations, statements
from loopwatch.store.sink import JSON_INSERT_SETTINGS, ClickHouseSink, RowBatch

#: this bench, as ``python -m`` runs it (its children too)
MODULE = "loopwatch.bench.store_path"
#: the tables every alternative must store alike (``runs`` compared ``FINAL``)
COMPARED = (tables.EVENTS, tables.LLM_CALLS, tables.TOOL_CALLS, tables.LABELS)
#: today's insert settings: before parallel parsing was turned off and threads bounded
TODAY_SETTINGS = {"date_time_input_format": "best_effort", "optimize_on_insert": 0}


@dataclass(frozen=True)
class Alternative:
    python_rows: bool
    events_per_insert: int
    settings: dict[str, Any]


ALTERNATIVES = {
    "python_rows": Alternative(True, 16_000, TODAY_SETTINGS),
    "python_rows_100k": Alternative(True, 100_000, TODAY_SETTINGS),
    "views": Alternative(False, 100_000, JSON_INSERT_SETTINGS),
    "views_parallel_parsing": Alternative(
        False, 100_000, {**JSON_INSERT_SETTINGS, "input_format_parallel_parsing": 1}),
    "views_insert_threads": Alternative(
        False, 100_000, {key: value for key, value in JSON_INSERT_SETTINGS.items()
                         if key != "max_insert_threads"}),
    "views_16k": Alternative(False, 16_000, JSON_INSERT_SETTINGS),
}


def python_rows(messages: list[RawMessage], batch: RowBatch, settings: Settings,
                prices: PriceTable) -> RowBatch:
    """The ``llm_calls`` / ``tool_calls`` / ``labels`` rows the processors built in
    Python for ``messages`` before the views did (the ones they still build, for claim
    events, are in ``batch`` already), stamped as the messages' ``events_in`` rows."""
    stamped = {(row["kafka_partition"], row["kafka_offset"]): row["ingested_at"]
               for row in batch.tables.get(tables.EVENTS_IN, [])}
    built = RowBatch()
    for message in messages:
        now = stamped.get((message.partition, message.offset))
        if now is None:
            continue
        for event in decode_message(message.value, settings.max_message_bytes).events:
            if rows.built_here(event):
                continue
            priced, mismatch = None, False
            if isinstance(event, LlmCall):
                priced = prices.cost(event.model, event.input_tokens, event.output_tokens,
                                     event.cache_read_input_tokens,
                                     event.cache_creation_input_tokens, event.cache_ttl)
                mismatch = cost_mismatch(event.cost_usd, priced.cost_usd,
                                         settings.cost_mismatch_tolerance)
            row = rows.event_row(event, priced, mismatch, settings.near_miss_factor, now)
            if row is not None:
                built.add(*row)
    return built


def grouped(messages: list[RawMessage], events_per_insert: int
            ) -> Iterator[list[list[RawMessage]]]:
    """The processor's chunks (:func:`loopwatch.processors.app.chunks`), gathered into
    groups of about ``events_per_insert`` events: one insert per group."""
    group: list[list[RawMessage]] = []
    size = 0
    for chunk in chunks(messages):
        group.append(chunk)
        size += sum(value.count(b'"event_type"') for value in
                    (message.value or b"" for message in chunk))
        if size >= events_per_insert:
            yield group
            group, size = [], 0
    if group:
        yield group


def prepare(messages: list[RawMessage], settings: Settings, alternative: Alternative
            ) -> list[RowBatch]:
    """Every insert's rows, folded beforehand: the raw events and ``runs`` (settled once
    per insert), and for ``python_rows`` the Python-built call and label rows."""
    pipeline = Pipeline(settings, MemoryRunStore())
    prices = PriceTable.load(settings.prices_file)
    batches = []
    for group in grouped(messages, alternative.events_per_insert):
        touched: dict[str, RunState] = {}
        batch = RowBatch()
        for chunk in group:
            batch.extend(pipeline.fold(chunk, touched).rows)
            if alternative.python_rows:
                batch.extend(python_rows(chunk, batch, settings, prices))
        batch.extend(pipeline.settle(touched).rows)
        batches.append(batch)
    return batches


def today_schema(client: Client, settings: Settings) -> None:
    """The store as it was before the generated views: migration 006's split only."""
    for statement in event_views.render(settings).drops:
        client.command(statement)
    split = [statement for statement in statements(dict(migrations())["006_events_in.sql"])
             if statement.startswith("CREATE MATERIALIZED VIEW")]
    for statement in split:
        client.command(statement)


def settle(client: Client, quiet_s: float = 1.0, timeout_s: float = 300) -> None:
    """Wait until no merge has run for ``quiet_s`` and the part count holds still."""
    deadline = time.monotonic() + timeout_s
    last: tuple[int, int] | None = None
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        merges, parts = client.query(
            "SELECT (SELECT count() FROM system.merges WHERE database = currentDatabase()),"
            " (SELECT count() FROM system.parts WHERE database = currentDatabase() AND "
            "active)").result_rows[0]
        now = (int(merges), int(parts))
        if now != last or now[0]:
            last, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return
        time.sleep(0.2)


#: how :func:`fingerprint` reads a column, where not as its text: ``events.payload`` as
#: its JSON (keys, order and values, not the spelling of numbers: the cut of the event's
#: own text keeps its encoder's ``0.0``, migration 006's view stored ClickHouse's ``0``)
COMPARED_AS = {(tables.EVENTS, "payload"): "toString(JSONExtractKeysAndValuesRaw(payload))"}


def fingerprint(client: Client, skip: tuple[str, ...] = ()) -> dict[str, list[Any]]:
    """Per compared table: row count and, per stored column (but ``skip``), a hash of
    its values, as queries read them (``FINAL`` on replacing tables; see
    :data:`COMPARED_AS`)."""
    found: dict[str, list[Any]] = {}
    for table in (*COMPARED, tables.RUNS):
        columns = [name for (name,) in client.query(
            "SELECT name FROM system.columns WHERE database = currentDatabase() AND "
            "table = {t:String} AND default_kind != 'ALIAS' ORDER BY name",
            parameters={"t": table}).result_rows if name not in skip]
        sums = ", ".join(
            f"sum(cityHash64(ifNull({COMPARED_AS.get((table, name), f'toString({name})')}, "
            "'<null>')))" for name in columns)
        engine = client.query("SELECT engine FROM system.tables WHERE database = "
                              "currentDatabase() AND name = {t:String}",
                              parameters={"t": table}).result_rows[0][0]
        # a replacing table's content is what FINAL reads: rows a later insert replaced
        # (an agent's revision) stay apart until a merge that may not have run yet
        final = " FINAL" if str(engine).startswith("Replacing") else ""
        values = client.query(f"SELECT count(), {sums} FROM {table}{final}").result_rows[0]
        found[table] = [int(value) for value in values]
        found[table + ":columns"] = columns
    return found


def stored_bytes(client: Client) -> int:
    return int(client.query("SELECT sum(bytes_on_disk) FROM system.parts WHERE "
                            "database = currentDatabase() AND active").result_rows[0][0])


def save_messages(path: Path, events: int, seed: int) -> int:
    """Generate the mix once and keep its messages (partition, offset, value) in
    ``path``: every alternative reads the same bytes (the simulator's event ids are
    random). Returns how many events they hold."""
    settings = Settings(data_dir=path.parent)
    generated = generate_events(events, seed, datetime.now(UTC) - timedelta(minutes=1))
    messages = envelopes(generated, settings.partitions, settings.events_topic)
    path.write_bytes(msgspec.msgpack.encode([(m.partition, m.offset, m.value) for m in messages]))
    return len(generated)


def load_messages(path: Path, topic: str) -> list[RawMessage]:
    return [RawMessage(topic, partition, offset, value)
            for partition, offset, value in msgspec.msgpack.decode(path.read_bytes())]


def measure(name: str, messages_file: Path, data_dir: Path) -> dict[str, Any]:
    """One alternative in this (fresh) process and a fresh store."""
    alternative = ALTERNATIVES[name]
    settings = Settings(data_dir=data_dir)
    messages = load_messages(messages_file, settings.events_topic)
    batches = prepare(messages, settings, alternative)
    events = int(sum(value.count(b'"event_type"') for value in
                     (message.value or b"" for message in messages)))
    client = migrate(settings)
    if alternative.python_rows:
        today_schema(client, settings)
    sink = ClickHouseSink(client, insert_settings=alternative.settings)
    started_cpu, started = time.process_time(), time.perf_counter()
    for batch in batches:
        sink.write_batch(batch)
    inserted_cpu = time.process_time()
    settle(client)
    settled_cpu, settled = time.process_time(), time.perf_counter()
    return {"alternative": name, "events": events, "inserts": len(batches),
            "insert_us_per_event": (inserted_cpu - started_cpu) * 1e6 / events,
            "us_per_event": (settled_cpu - started_cpu) * 1e6 / events,
            "wall_s": settled - started,
            "bytes_per_event": stored_bytes(client) / events,
            "fingerprint": fingerprint(client, skip=("ingested_at",))}


def in_fresh_process(module: str, name: str, messages_file: Path) -> dict[str, Any]:
    """Run ``python -m module --child name`` on ``messages_file`` with a store in a
    fresh temporary folder, and return the JSON object it prints last (``module``:
    this bench or another that measures the store the same way)."""
    with tempfile.TemporaryDirectory(prefix="loopwatch-store-bench-") as tmp:
        result = subprocess.run(
            [sys.executable, "-m", module, "--child", name,
             "--messages", str(messages_file), "--data-dir", tmp],
            capture_output=True, check=False, env={**os.environ})
    if result.returncode:
        raise SystemExit(f"{name} failed:\n{result.stderr.decode()[-3000:]}")
    return dict(json.loads(result.stdout.decode().strip().splitlines()[-1]))


def run(events: int, runs: int, seed: int, names: list[str]) -> dict[str, Any]:
    """Every alternative ``runs`` times, interleaved, each in a fresh process."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="loopwatch-store-path-") as tmp:
        messages_file = Path(tmp) / "messages.msgpack"
        events = save_messages(messages_file, events, seed)
        for _ in range(runs):
            for name in names:
                results[name].append(in_fresh_process(MODULE, name, messages_file))
    reference = results[names[0]][0]["fingerprint"]
    for name, measured in results.items():
        for one in measured:
            if one["fingerprint"] != reference:
                raise SystemExit(f"{name} stored other tables than {names[0]}: "
                                 f"{_differences(reference, one['fingerprint'])}")
    summary: dict[str, Any] = {"events": events, "runs": runs, "alternatives": {}}
    base = statistics.median(one["us_per_event"] for one in results[names[0]])
    for name, measured in results.items():
        median = statistics.median(one["us_per_event"] for one in measured)
        summary["alternatives"][name] = {
            "us_per_event": median,
            "us_per_event_each": [round(one["us_per_event"], 2) for one in measured],
            "insert_us_per_event": statistics.median(
                one["insert_us_per_event"] for one in measured),
            "ratio_to_" + names[0]: median / base,
            "bytes_per_event": statistics.median(one["bytes_per_event"] for one in measured),
            "inserts": measured[0]["inserts"],
        }
    summary["tables"] = {table: reference[table][0] for table in (*COMPARED, tables.RUNS)}
    return summary


def _differences(expected: dict[str, list[Any]], found: dict[str, list[Any]]) -> list[str]:
    out: list[str] = []
    for table, values in expected.items():
        if table.endswith(":columns"):
            continue
        columns = ["count", *expected[table + ":columns"]]
        out.extend(f"{table}.{column}" for column, one, other
                   in zip(columns, values, found.get(table, []), strict=False) if one != other)
    return out


def store_bench_parser(module: str, doc: str, children: list[str]
                       ) -> argparse.ArgumentParser:
    """The command line of a bench that stores the mix in fresh processes (this one and
    :mod:`loopwatch.bench.store_stages`): how many events, runs and the seed, JSON
    output, and the hidden arguments of a child (:func:`in_fresh_process`)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc)
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", choices=children, help=argparse.SUPPRESS)
    parser.add_argument("--messages", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = store_bench_parser(MODULE, __doc__.split("\n\n")[0], list(ALTERNATIVES))
    parser.add_argument("--only", nargs="+", choices=list(ALTERNATIVES),
                        default=list(ALTERNATIVES), help="alternatives (first: the reference)")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.messages, args.data_dir)))
        return
    summary = run(args.events, args.runs, args.seed, args.only)
    if args.json:
        print(json.dumps(summary))
        return
    print(f"{args.events} events, median of {args.runs} interleaved runs, tables equal "
          f"({summary['tables']})")
    for name, figures in summary["alternatives"].items():
        ratio = next(value for key, value in figures.items() if key.startswith("ratio_to"))
        print(f"  {name:24} {figures['us_per_event']:6.2f} µs/event (insert "
              f"{figures['insert_us_per_event']:.2f}; runs {figures['us_per_event_each']}), "
              f"x{ratio:.2f}, {figures['bytes_per_event']:.1f} B/event, "
              f"{figures['inserts']} inserts")


if __name__ == "__main__":
    main()
