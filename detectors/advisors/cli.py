"""``loopwatch advise``, hooked into the main CLI by :func:`register`."""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Annotated, Any

import orjson
import typer

from loopwatch.cliargs import DataDir, JsonFlag, console, settings_from

AgentOption = Annotated[str, typer.Option("--agent", help="only this agent ('' = all)")]


def findings_json(findings: list[Any]) -> bytes:
    """The JSON ``loopwatch advise --json`` prints: ``{"findings": [...]}``."""
    return orjson.dumps({"findings": [f.model_dump(mode="json") for f in findings]})


def advise_command(agent: AgentOption = "", data_dir: DataDir = None,
                   as_json: JsonFlag = False) -> None:
    """What to change and what it is worth: timeouts, prompt caching, retries, context,
    judges, pipelines (docs/advisors.md). Largest saving per day first."""
    from rich.console import Console
    from rich.markup import escape
    from rich.padding import Padding

    from loopwatch.detectors.advisors.run import advise_now
    from loopwatch.storecheck import open_checked

    if len(agent) > 256:
        raise typer.BadParameter("an agent name is at most 256 characters", param_hint="--agent")
    settings = settings_from(data_dir)
    reader, store = open_checked(settings)
    findings = advise_now(reader, settings.advise, agent,
                          timedelta(seconds=settings.max_clock_skew_s))
    if as_json:
        sys.stdout.write(findings_json(findings).decode() + "\n")
    else:
        out = Console()
        for finding in findings:
            saving = ("no dollar figure" if finding.saving_usd_per_day is None
                      else f"saves ${finding.saving_usd_per_day:,.2f}/day")
            out.print(f"[bold]{finding.kind}[/bold]  {escape(finding.agent)} / "
                      f"{escape(finding.subject)}  ({saving})", highlight=False)
            out.print(Padding(escape(finding.recommendation), (0, 0, 0, 4)),
                      highlight=False)
        if not findings:
            console.print("no finding worth raising in the window")
    console.print(store, markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    app.command("advise")(advise_command)
