"""The ``loopwatch`` command line. Settings are read here, once, and passed down."""

from __future__ import annotations

import json
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from loopwatch.config import Settings, load_settings

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Streaming observability and anomaly detection for LLM agent fleets.")
dlq_app = typer.Typer(no_args_is_help=True, help="Dead letters: input the pipeline refused.")
app.add_typer(dlq_app, name="dlq")
console = Console(stderr=True, soft_wrap=True)
out = Console()

DataDir = Annotated[Path | None, typer.Option("--data-dir", help="state directory "
                                              "[env LOOPWATCH_DATA_DIR]")]
JsonFlag = Annotated[bool, typer.Option("--json", help="print JSON instead of tables")]


def settings_from(data_dir: Path | None, **overrides: Any) -> Settings:
    try:
        return load_settings(data_dir=data_dir, **overrides)
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"])
            console.print(f"[red]invalid setting {where}:[/red] {error['msg']}")
        raise typer.Exit(2) from None


def print_table(columns: list[str], rows: list[list[Any]], title: str | None = None) -> None:
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*("" if value is None else str(value) for value in row))
    out.print(table)


@app.command()
def up(data_dir: DataDir = None) -> None:
    """Run broker (unless configured), processors and the store service until Ctrl-C."""
    from loopwatch.runtime import run_up

    settings = settings_from(data_dir)

    def ready(info: dict[str, Any]) -> None:
        console.print(f"kafka bootstrap: [bold]{info['kafka_bootstrap']}[/bold]  "
                      f"topic: {info['events_topic']}")
        console.print(f"store: [bold]{info['store']}[/bold]  service: {info['url']}")
        console.print("processing; Ctrl-C drains and stops")

    def progress(status: dict[str, Any]) -> None:
        counters = status["counters"]
        console.print(
            f"{datetime.now().strftime('%H:%M:%S')}  events {counters['events']}  "
            f"runs closed {counters['runs_closed']} (abandoned {counters['runs_abandoned']}, "
            f"revised {counters['runs_revised']})  dead letters {counters['dead_letters']}  "
            f"duplicates {counters['duplicates']}  store retries {status['sink_failures']}")

    run_up(settings, on_ready=ready, on_status=progress)


@app.command()
def demo(
    data_dir: DataDir = None,
    duration: Annotated[float, typer.Option(help="seconds of simulated traffic")] = 60.0,
    rate: Annotated[float, typer.Option(help="new runs per second")] = 4.0,
    seed: Annotated[int, typer.Option(help="simulator seed")] = 7,
    as_json: JsonFlag = False,
) -> None:
    """Start the embedded stack, run a simulated agent fleet through it, report per agent."""
    from loopwatch.demo import run_demo

    settings = settings_from(data_dir, abandon_ttl_s=20.0, idle_advance_s=3.0,
                             late_allowance_s=2.0)
    report = run_demo(settings, duration_s=duration, rate=rate, seed=seed,
                      progress=not as_json, console=console)
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        from loopwatch.demo import print_report

        print_report(report, out)


@app.command()
def query(
    sql: Annotated[str, typer.Argument(help="a read-only ClickHouse query")],
    data_dir: DataDir = None,
    as_json: JsonFlag = False,
) -> None:
    """Run a read-only query in loopwatch's database (through a running `up` if any)."""
    _print_query(data_dir, sql, {}, as_json)


@app.command()
def investigate(
    name: Annotated[str, typer.Argument(help="one of the README's investigation queries")],
    param: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, e.g. run_id=...")] = None,
    agent: Annotated[str, typer.Option(help="only this agent ('' = all)")] = "",
    data_dir: DataDir = None,
    as_json: JsonFlag = False,
) -> None:
    """Run a named investigation query (top_cost_runs, loop_pattern, ...)."""
    from loopwatch.investigations import investigations

    known = investigations()
    if name not in known:
        console.print(f"[red]unknown investigation {name!r}[/red]; one of: {', '.join(known)}")
        raise typer.Exit(2)
    chosen = known[name]
    values = {"agent": agent, **dict(item.split("=", 1) for item in param or [])}
    missing = [key for key in chosen.parameters if key not in values]
    if missing:
        console.print(f"[red]{name} needs --param {missing[0]}=...[/red]")
        raise typer.Exit(2)
    _print_query(data_dir, chosen.sql, {k: values[k] for k in chosen.parameters}, as_json,
                 title=chosen.purpose)


def _print_query(data_dir: Path | None, sql: str, parameters: dict[str, Any], as_json: bool,
                 title: str | None = None) -> None:
    from loopwatch.store.reader import QueryError, open_reader
    from loopwatch.store.service import dumps

    settings = settings_from(data_dir)
    try:
        result = open_reader(settings).query(sql, parameters)
    except QueryError as exc:
        console.print(f"[red]query failed:[/red] {exc}")
        raise typer.Exit(1) from None
    if as_json:
        sys.stdout.write(dumps(result.records()).decode() + "\n")
    else:
        print_table(result.columns, result.rows, title=title)


@dlq_app.command("list")
def dlq_list(
    data_dir: DataDir = None,
    limit: Annotated[int, typer.Option(help="newest N")] = 50,
    as_json: JsonFlag = False,
) -> None:
    """Show dead letters, newest first, with their reasons."""
    from loopwatch.deadletters import list_dead_letters
    from loopwatch.store.reader import open_reader

    settings = settings_from(data_dir)
    result = list_dead_letters(open_reader(settings), limit)
    if as_json:
        from loopwatch.store.service import dumps

        sys.stdout.write(dumps(result.records()).decode() + "\n")
    else:
        print_table(result.columns, result.rows, title="dead letters")


@dlq_app.command("replay")
def dlq_replay(data_dir: DataDir = None) -> None:
    """Re-submit dead letters not yet replayed (after a fix); they are marked replayed."""
    from loopwatch.deadletters import replay_dead_letters

    settings = settings_from(data_dir)
    count = replay_dead_letters(settings)
    console.print(f"re-submitted {count} dead letters")


@app.command()
def reprocess(
    since: Annotated[str, typer.Option(help="ISO time or date; recompute from here")],
    data_dir: DataDir = None,
) -> None:
    """Recompute derived tables from stored raw events (after a price or config change)."""
    from loopwatch.reprocess import reprocess_since

    settings = settings_from(data_dir)
    try:
        moment = datetime.fromisoformat(since)
    except ValueError:
        console.print(f"[red]--since must be an ISO time, e.g. 2026-11-29T10:00 (got {since!r})")
        raise typer.Exit(2) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    summary = reprocess_since(settings, moment)
    console.print(f"reprocessed {summary['events']} events of {summary['runs']} runs")


@app.command()
def schema(
    output: Annotated[Path | None, typer.Argument(help="file to write; default stdout")] = None,
) -> None:
    """Export the event contract (single events and envelopes) as JSON Schema."""
    from ingest.jsonschema import render

    if output is None:
        sys.stdout.write(render().decode())
    else:
        output.write_bytes(render())


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    app()


if __name__ == "__main__":
    main()
