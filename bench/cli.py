"""``loopwatch bench``: the end-to-end throughput benchmark (see :mod:`bench.pipeline`)."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import orjson
import typer
from rich.console import Console
from rich.table import Table


def bench(
    events: Annotated[int, typer.Option(help="events to emit and process")] = 500_000,
    workers: Annotated[int, typer.Option(help="also measure 2 processor processes if 2")] = 1,
    query_events: Annotated[int, typer.Option(
        help="synthetic events bulk-loaded into the store before the query latencies")] = 200_000,
    json_output: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Measure emitter, raw consumer, processors, storage, query and alert latency."""
    from bench.pipeline import run_bench

    err = Console(stderr=True)
    with err.status("benchmark starting") as status:
        def progress(message: str) -> None:
            status.update(message)

        def note(message: str) -> None:
            err.print(f"[dim]{message}[/dim]")

        result = run_bench(events, workers, query_events, progress, note=note)
    if json_output:
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
        return
    print_result(result)


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}{unit}" if value < 10 else f"{value:,.0f}{unit}"
    return f"{value:,}{unit}"


def print_result(result: dict[str, Any]) -> None:
    table = Table(title=f"loopwatch bench ({result['events']:,} events)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("emitter (SDK, one process)", _fmt(result["emitter_events_per_s"], " ev/s")),
        ("raw consumer (aiokafka + orjson)", _fmt(result["raw_consume_events_per_s"], " ev/s")),
        *((f"pipeline, {count} worker{'s' if count != '1' else ''}", _fmt(rate, " ev/s"))
          for count, rate in result["workers"].items()),
        ("pipeline (1 worker) / raw", _fmt(result["ratio"])),
        ("processor peak RSS", _fmt(result["processor_peak_rss_mb"], " MB")),
        ("memory per open run", _fmt(result["memory_per_open_run_bytes"], " B")),
        ("stored bytes per event", _fmt(result["stored_bytes_per_event"], " B")),
        ("alert latency p50", _fmt(result["alert_latency_p50_s"], " s")),
        ("alert latency p95", _fmt(result["alert_latency_p95_s"], " s")),
        *((f"query {name}", _fmt(seconds, " s"))
          for name, seconds in result["query_latency_s"].items()),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def register(app: typer.Typer) -> None:
    """Add ``loopwatch bench`` to the main CLI."""
    app.command("bench")(bench)
