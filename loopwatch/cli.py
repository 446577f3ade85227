"""The ``loopwatch`` command line. Settings are read here, once, and passed down."""

from __future__ import annotations

import json
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from loopwatch.cliargs import (
    HELP_MARKUP,
    DataDir,
    DebugFlag,
    ErrorContract,
    JsonFlag,
    Limit,
    UsageError,
    console,
    port_number,
    positive,
    settings_from,
)
from loopwatch.render import fitted

app = typer.Typer(cls=ErrorContract, rich_markup_mode=HELP_MARKUP,
                  no_args_is_help=True, add_completion=False,
                  help="Streaming observability and anomaly detection for LLM agent fleets.")
dlq_app = typer.Typer(no_args_is_help=True, rich_markup_mode=HELP_MARKUP,
                      help="Dead letters: input the pipeline refused or failed on.")
app.add_typer(dlq_app, name="dlq")
scenario_app = typer.Typer(no_args_is_help=True, rich_markup_mode=HELP_MARKUP,
                           help="Incident scenarios: inject failure modes, score the alerting.")
app.add_typer(scenario_app, name="scenario")
out = Console()


@app.callback()
def root(debug: DebugFlag = False) -> None:
    """Options for every command (the error contract reads ``--debug``: loopwatch.cliargs)."""


def print_table(columns: list[str], rows: list[list[Any]], title: str | None = None) -> None:
    out.print(fitted(out, columns, rows, title))


@app.command()
def up(
    data_dir: DataDir = None,
    otlp_port: Annotated[int | None, typer.Option(
        help="OTLP/HTTP receiver port [env LOOPWATCH_OTLP_PORT, default 4318]",
        callback=port_number)] = None,
) -> None:
    """Run broker (unless configured), processors and the store service until Ctrl-C."""
    from loopwatch.core.embedded.lifecycle import BrokerError
    from loopwatch.runtime import ProcessorCrashed, exit_without_engine_teardown, run_up

    settings = settings_from(data_dir)

    def ready(info: dict[str, Any]) -> None:
        console.print(f"kafka bootstrap: [bold]{info['kafka_bootstrap']}[/bold]  "
                      f"topic: {info['events_topic']}")
        console.print(f"store: [bold]{info['store']}[/bold]  service: {info['url']}")
        if info.get("otlp_url"):
            console.print(f"OTLP/HTTP: {info['otlp_url']}/v1/traces")
        if info.get("otlp_grpc"):
            console.print(f"OTLP/gRPC: {info['otlp_grpc']}")
        console.print("processing; Ctrl-C drains and stops")

    latest: dict[str, Any] = {}

    def progress(status: dict[str, Any]) -> None:
        latest.update(status)  # its "counters" is the processors' live dict: read at the end
        counters = status["counters"]
        failed = counters["processing_errors"]
        console.print(
            f"{datetime.now().strftime('%H:%M:%S')}  events {counters['events']}  "
            f"runs closed {counters['runs_closed']} (abandoned {counters['runs_abandoned']}, "
            f"revised {counters['runs_revised']})  dead letters {counters['dead_letters']}"
            + (f" ({failed} processing failed: see the log)" if failed else "")
            + f"  duplicates {counters['duplicates']}  store retries {status['sink_failures']}"
            + f"  broker retries {status['kafka_write_retries']}")

    def draining(limit_s: float) -> None:
        console.print(f"draining: storing what the broker holds (at most {limit_s:g} s; "
                      "Ctrl-C again stops at once)", markup=False, highlight=False)

    try:
        run_up(settings, on_ready=ready, on_status=progress, otlp_port=otlp_port,
               on_stopping=draining)
    except BrokerError as exc:
        console.print(f"loopwatch up: {exc}", markup=False, highlight=False)
        raise typer.Exit(1) from None
    except ProcessorCrashed as exc:  # stopped and cleaned up like a stop, but not asked
        console.print(f"loopwatch up: {exc}", markup=False, highlight=False)
        exit_without_engine_teardown(1)
    stored = latest.get("counters", {}).get("events")
    console.print("stopped" if stored is None else f"stopped: {stored} events stored",
                  markup=False, highlight=False)
    exit_without_engine_teardown()


@app.command()
def status(data_dir: DataDir = None, as_json: JsonFlag = False) -> None:
    """Is `up` running on this data dir: its store, broker, OTLP endpoint, how far behind
    the processors are, dead letters, firing alerts."""
    from loopwatch.status import gather, lines

    current = gather(settings_from(data_dir))
    if as_json:
        sys.stdout.write(json.dumps(current, default=str) + "\n")
        return
    for line in lines(current):
        out.print(line, markup=False, highlight=False, soft_wrap=True)


@app.command()
def worker(data_dir: DataDir = None) -> None:
    """An extra processor: joins the consumer group and shares the partitions."""
    from loopwatch.runtime import run_worker

    run_worker(settings_from(data_dir))  # no owner to write through: a runtime error, exit 1


@app.command()
def demo(
    data_dir: DataDir = None,
    duration: Annotated[float, typer.Option(help="seconds of simulated traffic",
                                            callback=positive)] = 60.0,
    rate: Annotated[float, typer.Option(help="new runs per second", callback=positive)] = 4.0,
    seed: Annotated[int, typer.Option(help="simulator seed")] = 7,
    as_json: JsonFlag = False,
) -> None:
    """Start the embedded stack, run a simulated agent fleet through it, report per agent.

    Progress goes to stderr also with ``--json`` (whose report alone is stdout), so that
    a scripted demo still shows it is alive."""
    from loopwatch.demo import run_demo

    settings = settings_from(data_dir, abandon_ttl_s=20.0, idle_advance_s=3.0,
                             late_allowance_s=2.0, detect_interval_s=2.0)
    report = run_demo(settings, duration_s=duration, rate=rate, seed=seed,
                      progress=True, console=console)
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
    create: Annotated[bool, typer.Option(
        "--create", help="create an empty store if the data dir holds none")] = False,
) -> None:
    """Run a read-only query in loopwatch's database (through a running `up` if any)."""
    _print_query(data_dir, sql, {}, as_json, create=create)


@app.command()
def investigate(
    name: Annotated[str, typer.Argument(
        help="one of the investigation queries (docs/investigations.md)")],
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
    values = {"agent": agent, **_key_values(param or [])}
    missing = [key for key in chosen.parameters if key not in values]
    if missing:
        console.print(f"[red]{name} needs --param {missing[0]}=...[/red]")
        raise typer.Exit(2)
    _print_query(data_dir, chosen.sql, {k: values[k] for k in chosen.parameters}, as_json,
                 title=chosen.purpose)


def _key_values(items: list[str]) -> dict[str, str]:
    """``--param KEY=VALUE`` options as a dict; anything else is a usage error."""
    values: dict[str, str] = {}
    for item in items:
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise UsageError(f"--param takes KEY=VALUE, e.g. run_id=abc (got {item!r})")
        values[key.strip()] = value
    return values


def _print_query(data_dir: Path | None, sql: str, parameters: dict[str, Any], as_json: bool,
                 title: str | None = None, create: bool = False) -> None:
    from loopwatch.store.reader import QueryError
    from loopwatch.store.service import dumps

    reader, store = open_checked(settings_from(data_dir), create)
    try:
        result = reader.query(sql, parameters)
    except QueryError as exc:
        console.print(f"[red]query failed:[/red] {exc}")
        raise typer.Exit(1) from None
    if as_json:
        sys.stdout.write(dumps(result.records()).decode() + "\n")
    else:
        print_table(result.columns, result.rows, title=title)
    said(store)


def open_checked(settings: Any, create: bool = False) -> tuple[Any, str]:
    """The store's reader and description, refusing a data dir that holds none
    (loopwatch.storecheck; imported here, not at start, like every store module)."""
    from loopwatch.storecheck import open_checked as checked

    return checked(settings, create)


def said(store: str) -> None:
    """Which store was read, on stderr (after the result: an error stays one line)."""
    console.print(store, markup=False, highlight=False)


@app.command()
def alerts(
    data_dir: DataDir = None,
    limit: Limit = 50,
    as_json: JsonFlag = False,
) -> None:
    """Firing alerts first, then recent ones, with their playbooks."""
    from loopwatch.store.service import dumps

    reader, store = open_checked(settings_from(data_dir))
    result = reader.query(ALERTS_SQL, {"limit": limit})
    if as_json:
        records = result.records()
        for record in records:
            record["evidence"] = json.loads(record["evidence"] or "{}")
        sys.stdout.write(dumps(records).decode() + "\n")
    else:
        columns = ["state", "severity", "rule", "summary", "playbook", "started_at"]
        print_table(columns, [[r[c] for c in columns] for r in result.records()],
                    title="alerts")
    said(store)


ALERTS_SQL = """
SELECT fingerprint, rule, severity, state, labels, summary, playbook, value, started_at,
       fired_at, resolved_at, link, evidence
FROM alerts FINAL
ORDER BY state = 'firing' DESC, updated_at DESC
LIMIT {limit:UInt32}
"""


@app.command()
def playbook(
    name: Annotated[str, typer.Argument(help="a playbook name; omit to list them")] = "",
    agent: Annotated[str, typer.Option(help="investigate this agent ('' = all)")] = "",
    tool: Annotated[str, typer.Option(help="the tool in question, if any")] = "",
    run_id: Annotated[str, typer.Option(help="the run in question, if any")] = "",
    hours: Annotated[float, typer.Option(help="look back this many hours",
                                         callback=positive)] = 24.0,
    data_dir: DataDir = None,
) -> None:
    """Print a playbook and run its investigation queries against the store."""
    from datetime import timedelta

    from loopwatch.detectors.playbooks import Step, load_playbooks
    from loopwatch.playbookview import missing_options, print_playbook
    from loopwatch.store.reader import QueryError

    books = load_playbooks()
    if not name:
        print_table(["name", "severity", "title"],
                    [[b.name, b.severity, b.title] for b in books.values()], title="playbooks")
        return
    if name not in books:
        console.print(f"[red]unknown playbook {name!r}[/red]; one of: {', '.join(books)}")
        raise typer.Exit(2)
    chosen = books[name]
    reader, store = open_checked(settings_from(data_dir))
    now = datetime.now(UTC)
    values: dict[str, Any] = {"agent": agent, "tool": tool, "run_id": run_id,
                              "since": now - timedelta(hours=hours), "until": now}

    def answer(step: Step) -> None:
        try:
            result = reader.query(step.sql or "", {k: values[k] for k in step.parameters})
        except QueryError as exc:
            console.print(f"[red]{step.title}: {exc}[/red]")
            return
        print_table(result.columns, result.rows[:20])

    skipped = print_playbook(out, chosen, values, answer)
    if skipped:
        options = sorted({o for step in skipped for o in missing_options(step, values)})
        console.print(f"skipped {len(skipped)} of {len(chosen.sql_steps)} queries: "
                      f"`loopwatch playbook {name} {' '.join(options)}` runs them",
                      markup=False, highlight=False)
    said(store)


@app.command()
def detect(data_dir: DataDir = None) -> None:
    """Run the detectors as a service against the configured ClickHouse server."""
    import threading

    from loopwatch.detectors.service import build_engine
    from loopwatch.store.clickhouse import connect, migrate

    settings = settings_from(data_dir)
    if settings.embedded_store:
        console.print("[red]with the embedded store the detectors run inside `loopwatch up`[/red]"
                      "; set LOOPWATCH_CLICKHOUSE_URL to run them on their own")
        raise typer.Exit(2)
    migrate(settings)
    engine = build_engine(settings, connect(settings), connect(settings))
    console.print(f"detectors running every {settings.detect_interval_s:g}s; Ctrl-C stops")
    stop = threading.Event()
    from loopwatch.processors.jobs.capture_decide import start_decider

    start_decider(settings, connect(settings), stop)
    try:
        engine.run(stop, settings.detect_interval_s, settings.detect_start_delay_s)
    except KeyboardInterrupt:
        stop.set()


@app.command("detect-csv")
def detect_csv(
    detector: Annotated[str | None, typer.Option(help="detector name (see --list)")] = None,
    list_: Annotated[bool, typer.Option("--list", help="name the detectors")] = False,
) -> None:
    """Score a `timestamp,value` CSV from stdin online; write it with `anomaly_score`."""
    from loopwatch.detectors.anomaly.csvscore import score_csv
    from loopwatch.detectors.anomaly.registry import DEFAULT_DETECTOR, DETECTORS

    if list_:
        for name in DETECTORS:
            sys.stdout.write(f"{name}{' (default)' if name == DEFAULT_DETECTOR else ''}\n")
        return
    if detector is not None and detector not in DETECTORS:
        console.print(f"[red]unknown detector {detector!r}[/red]; one of: {', '.join(DETECTORS)}")
        raise typer.Exit(2)
    try:
        score_csv(sys.stdin, sys.stdout, detector)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None


@scenario_app.command("list")
def scenario_list() -> None:
    """The scenario library: what each injects, and the alert and playbook that must catch it."""
    from loopwatch.scenarios import load_scenarios

    rows = [[s.name, s.description, ", ".join(s.expected), s.advisor, s.playbook]
            for s in load_scenarios().values()]
    print_table(["scenario", "injects", "must fire", "advisor finds", "playbook"], rows,
                title="scenarios")


@scenario_app.command("run")
def scenario_run(
    name: Annotated[str, typer.Argument(help="a scenario from `loopwatch scenario list`")],
    speed: Annotated[float, typer.Option(help="simulated seconds per real second",
                                         callback=positive)] = 60.0,
    seed: Annotated[int, typer.Option(help="traffic seed")] = 7,
    data_dir: DataDir = None,
    as_json: JsonFlag = False,
) -> None:
    """Play one scenario through the running stack and report which alerts fired when."""
    from loopwatch.scenarios import load_scenarios
    from loopwatch.scenarios.live import run_live

    scenarios = load_scenarios()
    if name not in scenarios:
        console.print(f"[red]unknown scenario {name!r}[/red]; one of: {', '.join(scenarios)}")
        raise typer.Exit(2)
    settings = settings_from(data_dir)
    result = run_live(scenarios[name], settings.data_dir / f"scenario-{name}", speed=speed,
                      seed=seed, progress=console.print)
    if as_json:
        sys.stdout.write(json.dumps(result, default=str) + "\n")
        return
    print_table(["rule", "fired after (simulated s)"],
                [[a["rule"], f"{a['after_s']:.0f}"] for a in result["alerts"]],
                title=f"{name}: {'DETECTED' if result['detected'] else 'MISSED'} "
                      f"(expected {', '.join(result['expected'])})")


@scenario_app.command("score")
def scenario_score(
    days: Annotated[float, typer.Option(help="days of clean history loaded first",
                                        callback=positive)] = 7.0,
    baseline_hours: Annotated[float, typer.Option(help="clean hours watched for "
                                                       "false alerts",
                                                  callback=positive)] = 24.0,
    only: Annotated[list[str] | None, typer.Option(help="run only these scenarios")] = None,
    seed: Annotated[int, typer.Option(help="traffic seed")] = 7,
    data_dir: DataDir = None,
    as_json: JsonFlag = False,
) -> None:
    """Scorecard: every scenario's detection and time to detect, and false alerts on a
    clean baseline, all in simulated time against a fresh store.

    Progress goes to stderr also with ``--json``: a full card takes most of an hour."""
    import shutil
    import time

    from loopwatch.scenarios.scorecard import score
    from loopwatch.store.clickhouse import migrate

    base = settings_from(data_dir)
    folder = base.data_dir / "scorecard"
    shutil.rmtree(folder, ignore_errors=True)
    settings = settings_from(folder, abandon_ttl_s=360.0, apply_retention=False)
    started = time.monotonic()

    def progress(message: str) -> None:
        console.print(f"{time.monotonic() - started:6.0f}s  {message}")

    card = score(migrate(settings), settings, seed=seed, history_days=days,
                 baseline_hours=baseline_hours, scenario_names=only, progress=progress)
    result = card.as_json()
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    rows = []
    for scenario, entry in result["scenarios"].items():
        ttd = entry["time_to_detect_s"]
        rows.append([scenario, "yes" if entry["detected"] else "MISSED",
                     ", ".join(entry["expected"]), ", ".join(entry["fired"]),
                     "-" if ttd is None else f"{ttd / 60:.0f} min"])
    print_table(["scenario", "detected", "expected", "fired", "time to detect"], rows,
                title=f"recall {result['recall']:.2f}")
    false = result["baseline"]["false_alerts"]
    console.print(f"clean baseline, {baseline_hours:g} simulated hours: false alerts "
                  f"critical {false['critical']}, warning {false['warning']}, "
                  f"info {false['info']} {card.false_alert_rules or ''}")


@dlq_app.command("list")
def dlq_list(
    data_dir: DataDir = None,
    limit: Limit = 50,
    as_json: JsonFlag = False,
) -> None:
    """Show dead letters, newest first, with their reasons."""
    from loopwatch.processors.jobs.deadletters import list_dead_letters

    reader, store = open_checked(settings_from(data_dir))
    result = list_dead_letters(reader, limit)
    if as_json:
        from loopwatch.store.service import dumps

        sys.stdout.write(dumps(result.records()).decode() + "\n")
    else:
        print_table(result.columns, result.rows, title="dead letters")
    said(store)


@dlq_app.command("replay")
def dlq_replay(data_dir: DataDir = None) -> None:
    """Re-submit dead letters not yet replayed (after a fix); they are marked replayed."""
    from loopwatch.processors.jobs.deadletters import replay_dead_letters

    settings = settings_from(data_dir)
    count = replay_dead_letters(settings)
    console.print(f"re-submitted {count} dead letters")


@app.command()
def reprocess(
    since: Annotated[str, typer.Option(help="ISO time or date; recompute from here")],
    data_dir: DataDir = None,
) -> None:
    """Recompute derived tables from stored raw events (after a price or config change)."""
    from loopwatch.processors.jobs.reprocess import reprocess_since
    from loopwatch.store.clickhouse import read_time

    settings = settings_from(data_dir)
    try:
        moment = read_time(since)  # a time without a zone is UTC, as the store keeps it
    except ValueError:
        console.print(f"[red]--since must be an ISO time, e.g. 2026-11-29T10:00 (got {since!r})")
        raise typer.Exit(2) from None
    summary = reprocess_since(settings, moment)
    console.print(f"reprocessed {summary['events']} events of {summary['runs']} runs")
    if summary.get("skipped"):
        console.print(f"[yellow]skipped {summary['skipped']} closed runs stored without "
                      "their state[/yellow]")


@app.command()
def schema(
    output: Annotated[Path | None, typer.Argument(help="file to write; default stdout")] = None,
) -> None:
    """Export the event contract (single events and envelopes) as JSON Schema."""
    from loopwatch.ingest.jsonschema import render

    if output is None:
        sys.stdout.write(render().decode())
    else:
        output.write_bytes(render())


def _register_parts() -> None:
    """Commands that live with their parts (ingest, dashboards) join the main CLI here."""
    from loopwatch.bench.cli import register as register_bench
    from loopwatch.dashboards.cli import register as register_dashboards
    from loopwatch.detectors.advisors.cli import register as register_advisors
    from loopwatch.ingest.cli import register as register_ingest
    from loopwatch.processors.replay.cli import register as register_replay

    register_ingest(app)
    register_dashboards(app)
    register_bench(app)
    register_replay(app)
    register_advisors(app)


_register_parts()


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    app()


if __name__ == "__main__":
    main()
