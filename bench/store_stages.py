"""What each stage of the store's write path costs, by taking stages away.

``python -m loopwatch.bench.store_stages [--events N] [--runs R] [--json]`` folds the
bench's event mix once (as :mod:`loopwatch.bench.store_path` does: the processor's
chunks, ~100k events an insert, ``runs`` settled once per insert) and stores it, in a
fresh process and a fresh chdb store for each variant, with more of the write path in
place each time:

- ``runs``: the rows Python builds (``runs``) alone, no raw events;
- ``events_in``: and the raw events into ``events_in`` (a ``Null`` table), every
  generated view dropped: ClickHouse reads the JSON and keeps nothing;
- ``parse``: and the view that parses each event into ``events_parsed`` (``Null``);
- ``events``: and the view that writes ``events``;
- ``all``: and the views that write ``llm_calls``, ``tool_calls`` and ``labels``: the
  store as it runs.

Each variant's figure is the process CPU (every thread) from the first insert to the
last one's return, per event; the variants run interleaved, ``R`` times each, and the
medians are reported with each stage's own cost (its median less the one before it).
Which rows each variant stored is checked (``events`` and call rows only where their
views are in place), so a stage that stopped doing its work fails the bench. Costs move
with the machine: read the stages against each other, within one run.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loopwatch.bench.store_path import (
    ALTERNATIVES,
    in_fresh_process,
    load_messages,
    prepare,
    save_messages,
    store_bench_parser,
)
from loopwatch.core.config import Settings
from loopwatch.store import event_views, tables
from loopwatch.store.clickhouse import migrate
from loopwatch.store.sink import ClickHouseSink

#: this bench, as ``python -m`` runs it (its children too)
MODULE = "loopwatch.bench.store_stages"
#: the tables a generated view writes (each view fills its own table)
_TABLE_VIEW_TABLES = (tables.EVENTS, tables.LLM_CALLS, tables.TOOL_CALLS, tables.LABELS)
#: the tables whose rows are counted after each variant
_CHECKED = (tables.RUNS, *_TABLE_VIEW_TABLES)


@dataclass(frozen=True)
class Stage:
    """What one variant keeps of the write path; the tables it fills follow from it
    (``runs``, and the table of each view kept)."""

    raw_events: bool
    """the raw events are inserted into ``events_in``"""
    parse_view: bool
    """the view that parses them into ``events_parsed`` is kept"""
    table_views: tuple[str, ...]
    """the tables whose generated view is kept"""

    @property
    def stored(self) -> tuple[str, ...]:
        return (tables.RUNS, *self.table_views)


#: the variants, each with one more stage than the one before
STAGES = {
    "runs": Stage(raw_events=False, parse_view=False, table_views=()),
    "events_in": Stage(raw_events=True, parse_view=False, table_views=()),
    "parse": Stage(raw_events=True, parse_view=True, table_views=()),
    "events": Stage(raw_events=True, parse_view=True, table_views=(tables.EVENTS,)),
    "all": Stage(raw_events=True, parse_view=True, table_views=_TABLE_VIEW_TABLES),
}


def _take_away(client: Any, stage: Stage) -> None:
    """Drop the generated views ``stage`` goes without."""
    for table in _TABLE_VIEW_TABLES:
        if table not in stage.table_views:
            client.command(f"DROP VIEW {event_views.view_name(table)}")
    if not stage.parse_view:
        client.command(f"DROP VIEW {event_views.PARSE_VIEW}")


def measure(stage: str, messages_file: Path, data_dir: Path) -> dict[str, Any]:
    """One variant in this (fresh) process and a fresh store."""
    settings = Settings(data_dir=data_dir)
    messages = load_messages(messages_file, settings.events_topic)
    batches = prepare(messages, settings, ALTERNATIVES["views"])
    if not STAGES[stage].raw_events:
        for batch in batches:
            batch.tables.pop(tables.EVENTS_IN, None)
    events = int(sum(value.count(b'"event_type"') for value in
                     (message.value or b"" for message in messages)))
    client = migrate(settings)
    _take_away(client, STAGES[stage])
    sink = ClickHouseSink(client)
    started = time.process_time()
    for batch in batches:
        sink.write_batch(batch)
    inserted = time.process_time()
    counts = {table: int(client.query(f"SELECT count() FROM {table}").result_rows[0][0])
              for table in _CHECKED}
    return {"stage": stage, "events": events, "inserts": len(batches),
            "us_per_event": (inserted - started) * 1e6 / events, "rows": counts}


def _check_rows(measured: dict[str, Any]) -> None:
    """Each variant stored rows in exactly the tables its stages write."""
    stored = STAGES[measured["stage"]].stored
    for table, count in measured["rows"].items():
        if (count > 0) != (table in stored):
            raise SystemExit(f"stage {measured['stage']}: {table} has {count} rows, "
                             f"expected {'some' if table in stored else 'none'}")
    if tables.EVENTS in stored and measured["rows"][tables.EVENTS] != measured["events"]:
        raise SystemExit(f"stage {measured['stage']}: {measured['rows'][tables.EVENTS]} "
                         f"events stored of {measured['events']}")


def run(events: int, runs: int, seed: int) -> dict[str, Any]:
    """Every variant ``runs`` times, interleaved, each in a fresh process."""
    results: dict[str, list[dict[str, Any]]] = {stage: [] for stage in STAGES}
    with tempfile.TemporaryDirectory(prefix="loopwatch-store-stages-") as tmp:
        messages_file = Path(tmp) / "messages.msgpack"
        events = save_messages(messages_file, events, seed)
        for round_ in range(1, runs + 1):
            for stage in STAGES:
                measured = in_fresh_process(MODULE, stage, messages_file)
                _check_rows(measured)
                results[stage].append(measured)
                print(f"round {round_}/{runs}: {stage} {measured['us_per_event']:.2f} "
                      "µs/event", file=sys.stderr, flush=True)
    summary: dict[str, Any] = {"events": events, "runs": runs, "stages": {}}
    before = 0.0
    for stage in STAGES:
        median = statistics.median(one["us_per_event"] for one in results[stage])
        summary["stages"][stage] = {
            "us_per_event": median,
            "us_per_event_each": [round(one["us_per_event"], 2) for one in results[stage]],
            "stage_us_per_event": median - before,
            "rows": results[stage][0]["rows"],
        }
        before = median
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = store_bench_parser(MODULE, __doc__.split("\n\n")[0], list(STAGES))
    args = parser.parse_args(argv)
    if args.events < 1 or args.runs < 1:
        parser.exit(2, f"{parser.prog}: --events and --runs must be at least 1\n")
    if args.child:
        print(json.dumps(measure(args.child, args.messages, args.data_dir)))
        return
    summary = run(args.events, args.runs, args.seed)
    if args.json:
        print(json.dumps(summary))
        return
    print(f"{summary['events']} events, medians of {args.runs} interleaved runs "
          "(process CPU per event, first insert to last)")
    for stage, figures in summary["stages"].items():
        print(f"  {stage:10} {figures['us_per_event']:6.2f} µs/event, this stage "
              f"{figures['stage_us_per_event']:+.2f} (runs {figures['us_per_event_each']})")


if __name__ == "__main__":
    main()
