"""``loopwatch bench``: the end-to-end throughput benchmark (:mod:`loopwatch.bench.pipeline`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
import typer
from rich.bar import Bar
from rich.console import Console
from rich.table import Table

from loopwatch.cliargs import one_of, positive
from loopwatch.liveline import LiveLine


@dataclass(frozen=True)
class Target:
    """One of issue 7's targets: ``figure`` reads the value from a bench result."""

    label: str
    figure: str
    goal: float
    higher_is_better: bool
    unit: str = ""


#: the targets on the reference machine (2 cores shared with the broker)
TARGETS = (
    Target("processors / raw consumer", "ratio", 1 / 3, True),
    Target("2 workers / 1 worker", "worker_scaling", 1.0, True, "x"),
    Target("emitter, one process, spool on", "emitter_events_per_s", 50_000, True, " ev/s"),
    Target("alert latency p95", "alert_latency_p95_s", 5.0, False, " s"),
    Target("memory per open run", "memory_per_open_run_bytes", 1024, False, " B"),
    Target("stored bytes per event", "stored_bytes_per_event", 60, False, " B"),
    Target("slowest investigation query", "slowest_query_s", 1.0, False, " s"),
    Target("OTLP ingest, first POST to last row stored", "otlp_spans_per_s", 20_000, True,
           " spans/s"),
)


def _figure(result: dict[str, Any], name: str) -> float | None:
    if name == "worker_scaling":
        one, two = result["workers"].get("1"), result["workers"].get("2")
        return two / one if one and two else None
    if name == "slowest_query_s":
        return max(result["query_latency_s"].values(), default=None)
    value = result.get(name)
    return None if value is None else float(value)


def against_targets(result: dict[str, Any]) -> list[tuple[Target, float | None, float | None]]:
    """(target, value, score) per target; score >= 1 means met (value / goal, or goal /
    value where lower is better); None where the run did not measure it.

    >>> rows = against_targets({"ratio": 0.1, "workers": {"1": 10.0, "2": 15.0},
    ...     "emitter_events_per_s": 60_000.0, "alert_latency_p95_s": 2.5,
    ...     "memory_per_open_run_bytes": 2048.0, "stored_bytes_per_event": None,
    ...     "query_latency_s": {"a": 0.02, "b": 0.5}, "otlp_spans_per_s": 25_000.0})
    >>> [(t.figure, value, None if score is None else round(score, 2)) for t, value, score in rows]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('ratio', 0.1, 0.3), ('worker_scaling', 1.5, 1.5), ('emitter_events_per_s', 60000.0, 1.2),
     ('alert_latency_p95_s', 2.5, 2.0), ('memory_per_open_run_bytes', 2048.0, 0.5),
     ('stored_bytes_per_event', None, None), ('slowest_query_s', 0.5, 2.0),
     ('otlp_spans_per_s', 25000.0, 1.25)]
    """
    rows: list[tuple[Target, float | None, float | None]] = []
    for target in TARGETS:
        value = _figure(result, target.figure)
        score = None
        if value is not None and value > 0:
            score = value / target.goal if target.higher_is_better else target.goal / value
        rows.append((target, value, score))
    return rows


def bench(
    events: Annotated[int, typer.Option(help="events to emit and process",
                                        callback=positive)] = 500_000,
    workers: Annotated[int, typer.Option(help="also measure 2 processor processes if 2",
                                         callback=one_of(1, 2))] = 1,
    query_events: Annotated[int, typer.Option(
        help="synthetic events bulk-loaded into the store before the query latencies",
        callback=positive)] = 200_000,
    otlp_traces: Annotated[int, typer.Option(
        help="traces per OTLP burst (11 GenAI spans each, 3 bursts)",
        callback=positive)] = 2000,
    json_output: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Measure emitter, raw consumer, processors, storage, query and alert latency."""
    from loopwatch.bench.pipeline import run_bench

    err = Console(stderr=True)
    with err.status("benchmark starting") as status, LiveLine(
            err, enabled=not err.is_terminal) as plain:  # the spinner needs a terminal
        def progress(message: str) -> None:
            status.update(message)
            plain.update([message], phase=message.partition(" ")[0])

        def note(message: str) -> None:
            err.print(f"[dim]{message}[/dim]")

        result = run_bench(events, workers, query_events, progress, note=note,
                           otlp_traces=otlp_traces)
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


#: the rows of :func:`loopwatch.bench.pipeline.cpu_budget`'s figures
BUDGET_ROWS = (("CPU budget at 1/3 of raw", "budget_us"),
               ("  storing (sink thread, chdb)", "store_us"),
               ("  broker", "broker_us"),
               ("  left for the processors", "left_for_processors_us"),
               ("processors' Python spent", "processors_us"))


def print_result(result: dict[str, Any]) -> None:
    table = Table(title=f"loopwatch bench ({result['events']:,} events)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("emitter (SDK, one process, spool on)",
         _fmt(result["emitter_events_per_s"], " ev/s")),
        ("emitter, spool off (baseline)",
         _fmt(result["emitter_baseline_events_per_s"], " ev/s")),
        ("emitter spool on / off", _fmt(result["emitter_spool_ratio"])),
        ("raw consumer (aiokafka + orjson; mean of 2)",
         _fmt(result["raw_consume_events_per_s"], " ev/s")),
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
        *((label, _fmt((result["cpu_budget"] or {}).get(key), " µs/ev"))
          for label, key in BUDGET_ROWS),
        ("OTLP burst, first POST to last row stored (median of 3)",
         _fmt(result["otlp_spans_per_s"], " spans/s")),
        ("OTLP burst, closed at the check that saw every row",
         _fmt(result["otlp_at_check_spans_per_s"], " spans/s")),
        ("OTLP burst, HTTP accepted (same runs)",
         _fmt(result["otlp_accept_spans_per_s"], " spans/s")),
        ("OTLP burst, last 200 to last row stored", _fmt(result["otlp_lag_s"], " s")),
        ("OTLP burst, up CPU per span", _fmt(result["otlp_up_cpu_us_per_span"], " µs")),
    ]
    for name, value in rows:
        table.add_row(name, value)
    machine = result["machine"]
    table.caption = (f"{machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB, "
                     f"Python {machine['python']}, {machine['system']}")
    console = Console()
    console.print(table)
    console.print(targets_chart(result))


#: the chart's bars end at this multiple of a target
CHART_SCALE = 2.0


def targets_chart(result: dict[str, Any]) -> Table:
    """Each target as a bar of how far it is met: the bar's middle is the target."""
    chart = Table(title="against the targets (bar middle = target; longer is better)")
    for name in ("target", "value", "goal", "met", ""):
        chart.add_column(name, justify="left" if name in ("target", "") else "right")
    for target, value, score in against_targets(result):
        goal = (">= " if target.higher_is_better else "<= ") + _fmt(target.goal, target.unit)
        if score is None:
            chart.add_row(target.label, "-", goal, "-", "")
            continue
        met = score >= 1
        chart.add_row(target.label, _fmt(value, target.unit), goal, "yes" if met else "no",
                      Bar(size=CHART_SCALE, begin=0, end=min(score, CHART_SCALE), width=30,
                          color="green" if met else "red"))
    return chart


def register(app: typer.Typer) -> None:
    """Add ``loopwatch bench`` to the main CLI."""
    app.command("bench")(bench)
