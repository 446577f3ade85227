"""CLI commands for dashboards, hooked into ``loopwatch`` by :func:`register`.

``loopwatch/cli.py`` calls ``register(app)`` once; this module owns the commands so the
main CLI does not grow with every dashboard option:

- ``loopwatch dashboards export DIR``: the three dashboard models plus Grafana
  provisioning files (what ``deploy/grafana/`` holds);
- ``loopwatch dashboards deploy --url URL --token TOKEN``: data source, folder and
  dashboards through Grafana's HTTP API, idempotently;
- ``loopwatch serve``: the built-in web view on 127.0.0.1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from loopwatch.cliargs import HELP_MARKUP, DataDir, console, port_number, settings_from

ClickHouseUrl = Annotated[str | None, typer.Option(
    "--clickhouse-url", help="the ClickHouse server Grafana reads, http(s)://user@host:port/db "
    "[default: LOOPWATCH_CLICKHOUSE_URL]")]


WebUrl = Annotated[str | None, typer.Option(
    "--web-url", help="the loopwatch web view the dashboards' run links open "
    "[default: LOOPWATCH_LINK_BASE_URL, else http://127.0.0.1:8765]")]


def _web_url(web_url: str | None, data_dir: Path | None) -> str:
    """The option, else the configured link base URL; a bad one is a usage error."""
    from rich.markup import escape

    from loopwatch.dashboards.grafana import web_view_url

    try:
        return web_view_url(web_url or settings_from(data_dir).link_base_url)
    except ValueError as exc:
        console.print(f"[red]invalid --web-url:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None


def export_command(
    folder: Annotated[Path, typer.Argument(help="where to write dashboards/ and provisioning/")],
    clickhouse_url: ClickHouseUrl = None,
    web_url: WebUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Write the dashboards (one JSON model per tier) and Grafana provisioning files."""
    from loopwatch.dashboards.provisioning import export

    for path in export(folder, clickhouse_url, _web_url(web_url, data_dir)):
        console.print(f"wrote {path}")


def deploy_command(
    url: Annotated[str, typer.Option("--url", help="Grafana base URL, e.g. http://grafana:3000")],
    token: Annotated[str, typer.Option("--token", envvar="GRAFANA_TOKEN",
                                       help="service account token [env GRAFANA_TOKEN]")],
    clickhouse_url: ClickHouseUrl = None,
    clickhouse_password: Annotated[str | None, typer.Option(
        "--clickhouse-password", envvar="LOOPWATCH_CLICKHOUSE_PASSWORD",
        help="password for the data source [env LOOPWATCH_CLICKHOUSE_PASSWORD]")] = None,
    web_url: WebUrl = None,
    data_dir: DataDir = None,
) -> None:
    """Create or update the ClickHouse data source and the dashboards in Grafana."""
    from loopwatch.dashboards.deploy import DeployError, deploy

    settings = settings_from(data_dir)
    try:
        report = deploy(url, token, clickhouse_url or settings.clickhouse_url,
                        clickhouse_password, _web_url(web_url, data_dir))
    except DeployError as exc:
        console.print(f"[red]deploy failed:[/red] {exc}")
        raise typer.Exit(1) from None
    console.print(f"data source {report.datasource}; folder {report.folder}")
    for uid, link in report.dashboards.items():
        console.print(f"dashboard {uid}: {link}")


def serve_command(
    host: Annotated[str, typer.Option(help="interface to bind (keep 127.0.0.1 unless "
                                      "a proxy authenticates in front)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port (0 = any free one)",
                                      callback=port_number)] = 8765,
    data_dir: DataDir = None,
) -> None:
    """Serve the dashboards as a local web page (live charts, alerts, run drill-down)."""
    from loopwatch.dashboards.web.server import serve_forever
    from loopwatch.store.reader import QueryError, open_reader

    settings = settings_from(data_dir)
    try:
        reader = open_reader(settings, follow=True)
    except QueryError as exc:
        console.print(f"[red]cannot open the store:[/red] {exc}")
        raise typer.Exit(1) from None

    def ready(url: str) -> None:
        console.print(f"loopwatch web view: [bold]{url}[/bold]  (Ctrl-C stops)")

    try:
        serve_forever(reader, host, port, on_ready=ready)
    except OSError as exc:
        console.print(f"[red]cannot listen on {host}:{port}:[/red] {exc}")
        raise typer.Exit(1) from None


def register(app: typer.Typer) -> None:
    """Add the ``dashboards`` sub-app (export, deploy) and ``serve`` to ``app``."""
    dashboards_app = typer.Typer(no_args_is_help=True, rich_markup_mode=HELP_MARKUP,
                                 help="Grafana dashboards as code: export or deploy them.")
    dashboards_app.command("export")(export_command)
    dashboards_app.command("deploy")(deploy_command)
    app.add_typer(dashboards_app, name="dashboards")
    app.command("serve")(serve_command)
