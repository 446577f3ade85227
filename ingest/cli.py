"""``loopwatch ingest``: the OTLP receiver standalone, and file imports.

Wired into the main CLI with ``register(app)``; also runnable on its own as
``python -m loopwatch.ingest.cli ingest ...``. Settings are read here, once, like the main CLI.
"""

from __future__ import annotations

import signal
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from loopwatch.cliargs import HELP_MARKUP, DataDir, console, port_number, positive, settings_from
from loopwatch.core.config import Settings
from loopwatch.liveline import LiveLine

WaitTimeout = Annotated[float, typer.Option(
    "--wait-timeout", help="seconds to wait for everything to be stored", callback=positive)]


def serve(
    host: Annotated[str | None, typer.Option(help="listen address [env LOOPWATCH_OTLP_HOST]")]
    = None,
    port: Annotated[int | None, typer.Option(
        help="OTLP/HTTP port [env LOOPWATCH_OTLP_PORT, default 4318]",
        callback=port_number)] = None,
    grpc_port: Annotated[str | None, typer.Option(
        help="OTLP/gRPC port, or off [env LOOPWATCH_OTLP_GRPC_PORT, default 4317]")] = None,
    token: Annotated[str | None, typer.Option(
        help="require this bearer token [env LOOPWATCH_OTLP_TOKEN]")] = None,
    data_dir: DataDir = None,
) -> None:
    """Run the OTLP trace receivers (HTTP and gRPC) against the configured Kafka until
    Ctrl-C."""
    from loopwatch.core.topics import ensure_topics
    from loopwatch.ingest.otlp.server import OtlpReceiver
    from loopwatch.ingest.otlp.settings import load_otlp_settings
    from loopwatch.store.reader import running_service

    settings = settings_from(data_dir)
    try:
        limits = load_otlp_settings(host=host, port=port, token=token, grpc_port=grpc_port)
    except ValidationError as exc:
        console.print(f"[red]invalid OTLP setting:[/red] {exc.errors()[0]['msg']}")
        raise typer.Exit(2) from None
    bootstrap = settings.kafka_bootstrap
    if bootstrap is None:
        announced = running_service(settings)
        if announced is None:
            console.print("[red]no Kafka configured[/red]: set LOOPWATCH_KAFKA_BOOTSTRAP, or "
                          "run `loopwatch up` (which runs a receiver itself)")
            raise typer.Exit(2)
        bootstrap = str(announced["kafka_bootstrap"])
    ensure_topics(bootstrap, settings)
    receiver = OtlpReceiver(settings, bootstrap, limits.host, limits.port, limits.token,
                            limits=limits)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    url = receiver.start()
    grpc_address = None if limits.grpc_port is None else receiver.serve_grpc(limits.grpc_port)
    console.print(f"OTLP/HTTP receiver: [bold]{url}/v1/traces[/bold] -> kafka {bootstrap} "
                  f"topic {settings.events_topic}; Ctrl-C stops")
    if grpc_address is not None:
        console.print(f"OTLP/gRPC receiver: [bold]{grpc_address}[/bold]")
    elif limits.grpc_port is not None:
        console.print(f"[yellow]OTLP/gRPC receiver not started:[/yellow] port "
                      f"{limits.grpc_port} is taken (set LOOPWATCH_OTLP_GRPC_PORT or --grpc-port)")
    try:
        stop.wait()
    finally:
        receiver.stop()


def _progress(total: int, enabled: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TimeRemainingColumn(), console=console, transient=True,
                    disable=not enabled)


def _run_import(settings: Settings, path: Path, records: Any, wait_timeout: float) -> None:
    from loopwatch.ingest.importers.delivery import Delivery, ImportFailed, deliver, open_target
    from loopwatch.ingest.importers.records import Bad

    def report(bad: Bad) -> None:
        console.print(f"[yellow]skipped {bad.position}:[/yellow] {bad.reason}")

    size = path.stat().st_size
    show = console.is_terminal

    def sent(offset: int) -> None:
        progress.update(task, completed=offset)
        plain.update([f"sending {path.name}", f"{offset} of {size} bytes"], phase="sending")

    def stored_so_far(done: int) -> None:
        progress.update(task, completed=done)
        plain.update(["waiting until stored", f"{done} of {len(delivery.ids)} events"],
                     phase="waiting")

    try:
        with open_target(settings, console.print) as target, LiveLine(
                console, enabled=not show) as plain:  # the progress bars need a terminal
            delivery = Delivery(settings, target)
            try:
                with _progress(size, show) as progress:
                    task = progress.add_task(f"sending {path.name}", total=size)
                    summary = deliver(records, delivery, report, sent)
                with Progress(console=console, transient=True, disable=not show) as progress:
                    task = progress.add_task("waiting until stored", total=len(delivery.ids))
                    stored, dead = delivery.wait_stored(wait_timeout, stored_so_far)
            finally:
                delivery.close()
    except ImportFailed as exc:
        console.print(f"[red]import failed:[/red] {exc}")
        raise typer.Exit(1) from None
    console.print(
        f"imported {path}: {summary.records} records, {len(delivery.ids)} events "
        f"({stored} stored, {dead} dead-lettered), {len(summary.bad)} bad records skipped; "
        f"into {target.how}")


def file(
    path: Annotated[Path, typer.Argument(help="JSONL: one event (or envelope) per line",
                                         exists=True, dir_okay=False)],
    data_dir: DataDir = None,
    wait_timeout: WaitTimeout = 600.0,
) -> None:
    """Import JSONL in the event contract; exits once every event is stored."""
    from loopwatch.ingest.importers.jsonl import read_jsonl
    from loopwatch.ingest.importers.records import file_digest

    settings = settings_from(data_dir)
    _run_import(settings, path, read_jsonl(path, file_digest(path)), wait_timeout)


def transcript(
    path: Annotated[Path, typer.Argument(help="a JSON list of runs, or JSONL (one run each)",
                                         exists=True, dir_okay=False)],
    format: Annotated[str, typer.Option("--format", help="transcript format")]
    = "openai-chat",
    agent: Annotated[str, typer.Option(help="agent name for every run")] = "transcript-import",
    messages_key: Annotated[str, typer.Option(help="key of a run's message list")]
    = "messages",
    run_id_key: Annotated[str | None, typer.Option(
        help="key of the run id (default: hash of file and record index)")] = None,
    task_id_key: Annotated[str | None, typer.Option(
        help="key of a task id (kept as the task_id extra)")] = None,
    outcome_key: Annotated[str | None, typer.Option(
        help="key of the outcome: bool, reward number or word (default: first of "
             "outcome, success, reward, resolved)")] = None,
    reward_threshold: Annotated[float, typer.Option(
        help="a numeric reward at or above this is correct, below it wrong")] = 1.0,
    task_type: Annotated[str, typer.Option(help="task_type for every run")] = "",
    model: Annotated[str, typer.Option(help="model (default: the run's `model` field)")]
    = "",
    data_dir: DataDir = None,
    wait_timeout: WaitTimeout = 600.0,
) -> None:
    """Import recorded agent transcripts; exits once every event is stored."""
    from loopwatch.ingest.importers.records import file_digest
    from loopwatch.ingest.importers.transcripts import TranscriptOptions, read_transcripts

    if format != "openai-chat":
        console.print(f"[red]unknown --format {format!r}[/red]; supported: openai-chat")
        raise typer.Exit(2)
    settings = settings_from(data_dir)
    options = TranscriptOptions(
        agent=agent, messages_key=messages_key, run_id_key=run_id_key,
        task_id_key=task_id_key, outcome_key=outcome_key, reward_threshold=reward_threshold,
        task_type=task_type, model=model)
    records = read_transcripts(path, file_digest(path), options, datetime.now(UTC))
    _run_import(settings, path, records, wait_timeout)


def register(app: typer.Typer) -> None:
    """Add the ``ingest`` sub-app (serve, file, transcript) to the main CLI."""
    ingest_app = typer.Typer(no_args_is_help=True, rich_markup_mode=HELP_MARKUP,
                             help="Bring data in: OTLP receivers (HTTP, gRPC) and file imports.")
    ingest_app.command("serve")(serve)
    ingest_app.command("file")(file)
    ingest_app.command("transcript")(transcript)
    app.add_typer(ingest_app, name="ingest")


def main() -> None:
    app = typer.Typer(no_args_is_help=True, add_completion=False,
                      rich_markup_mode=HELP_MARKUP)
    register(app)

    @app.callback()
    def _root() -> None:
        """loopwatch ingest, standalone."""

    app()


if __name__ == "__main__":
    main()
