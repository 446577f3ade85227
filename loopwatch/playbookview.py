"""A playbook on a terminal: headings as headings, each step's query indented (no
Markdown fences) and followed by its answer, and a step that needs a parameter the
user did not give is said to be skipped, with the option that gives it.

``loopwatch.detectors.playbooks.render_markdown`` stays what it is for: pasting into an incident
channel. Read raw on a terminal it was ``#``, ``**`` and ```` ```sql ```` fences, and a
step whose query needs a run id ran with an empty one and answered nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from loopwatch.detectors.playbooks import Playbook, Step

#: a step parameter that has no "all" value, and the option that fills it
REQUIRED_OPTIONS = {"run_id": "--run-id RUN_ID"}
SQL_INDENT = "    "


def _heading(console: Console, text: str) -> None:
    console.print()
    console.print(Text(text, style="bold underline"))


def _bullets(console: Console, items: tuple[str, ...]) -> None:
    listing = Table.grid(padding=(0, 1))  # a wrapped item stays under its own text
    listing.add_column(no_wrap=True)
    listing.add_column()
    for item in items:
        listing.add_row("  •", Text(item))
    console.print(listing)


def missing_options(step: Step, values: dict[str, object]) -> list[str]:
    """The options the user must pass before ``step``'s query can answer anything."""
    return [option for name, option in REQUIRED_OPTIONS.items()
            if name in step.parameters and not values.get(name)]


def print_playbook(console: Console, playbook: Playbook, values: dict[str, object],
                   answer: Callable[[Step], None]) -> list[Step]:
    """Print ``playbook``; ``answer(step)`` prints a query step's result under it.
    Returns the steps skipped for a missing parameter."""
    console.print(Text(f"{playbook.title} ({playbook.name})", style="bold"))
    console.print(Text(f"severity: {playbook.severity}"
                       + (f" ({playbook.severity_note})" if playbook.severity_note else "")))
    console.print(Text(f"alerts: {', '.join(playbook.alerts)}"))
    console.print()
    console.print(Text(playbook.summary.strip()))
    _heading(console, "Symptoms")
    _bullets(console, playbook.symptoms)
    _heading(console, "Investigation")
    skipped = []
    for number, step in enumerate(playbook.steps, start=1):
        console.print()
        console.print(Text(f"{number}. {step.title}", style="bold"))
        console.print(Text(step.why))
        if step.sql is not None:
            console.print(Text("\n".join(SQL_INDENT + line for line in
                                         step.sql.strip("\n").splitlines()), style="cyan"),
                          soft_wrap=True)  # copied and run as is: never wrapped
            missing = missing_options(step, values)
            if missing:
                skipped.append(step)
                console.print(Text(f"skipped: this query needs {', '.join(missing)} "
                                   "(a run_id from the steps above)", style="yellow"))
            else:
                answer(step)
        if step.action is not None:
            console.print(Text(f"action: {step.action}"))
    _heading(console, "Mitigation")
    _bullets(console, playbook.mitigation)
    _heading(console, "Prevention")
    _bullets(console, playbook.prevention)
    console.print()
    console.print(Text("source: " + "; ".join(playbook.source), style="dim"))
    return skipped
