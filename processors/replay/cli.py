"""``loopwatch replay``, ``loopwatch diff`` and ``loopwatch economics``, joined to the
main CLI by :func:`register` (``loopwatch/cli.py``) so that it does not grow with them.

Exit codes: 0 done, 1 the store refused a query, 2 no such run (or bad input).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import orjson
import typer
from rich.console import Console, Group
from rich.panel import Panel
from rich.text import Text

from loopwatch.cliargs import DataDir, JsonFlag, console, positive, settings_from
from loopwatch.core.money import usd
from loopwatch.processors.replay.diff import diff_json
from loopwatch.processors.replay.recording import Recording, RunNotFound, Step, load_recording

if TYPE_CHECKING:  # imported by every CLI start: the store client only when a command reads
    from loopwatch.store.reader import Reader

out = Console(soft_wrap=False)
SHORT_CHARS = 400
SHORT_MESSAGES = 4

FullFlag = Annotated[bool, typer.Option("--full", help="print every body in full")]


def _reader(data_dir: Path | None) -> Reader:
    from loopwatch.store.reader import QueryError, open_reader
    from loopwatch.storecheck import store_to_read

    settings = settings_from(data_dir)
    store_to_read(settings)  # a data dir without a store is refused, not created
    try:
        return open_reader(settings)
    except QueryError as exc:
        console.print(f"[red]cannot read the store:[/red] {exc}")
        raise typer.Exit(1) from None


def _load(reader: Reader, run_id: str) -> Recording:
    from loopwatch.store.reader import QueryError

    try:
        return load_recording(reader, run_id)
    except RunNotFound as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    except QueryError as exc:
        console.print(f"[red]query failed:[/red] {exc}")
        raise typer.Exit(1) from None


def _write_json(body: Any) -> None:
    # orjson keeps strings as they are (only JSON's own escapes), so bodies come out
    # byte for byte as captured.
    sys.stdout.write(orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS).decode() + "\n")


# --- rendering ------------------------------------------------------------------------


def abbreviate(text: str, limit: int = SHORT_CHARS) -> str:
    """The head and tail of a long body, saying how much is left out.

    >>> abbreviate("a" * 10 + "b" * 10, limit=8)
    'aaaa … [+12 chars] … bbbb'
    """
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} … [+{len(text) - 2 * half} chars] … {text[-half:]}"


def _json_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()


def render_body(value: Any, full: bool) -> str:
    """A body for people: chat messages one per line as ``role: content``; long bodies
    cut in the middle unless ``full``; of a long conversation, the first message (the
    system prompt) and the last few."""
    if value is None:
        return "—"
    cut = (lambda text: text) if full else abbreviate
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        lines = [f"{m.get('role', '?')}: {cut(_json_text(m.get('content', m)))}" for m in value]
        if not full and len(lines) > SHORT_MESSAGES + 1:
            hidden = len(lines) - SHORT_MESSAGES - 1
            lines = [lines[0], f"… {hidden} more messages (--full shows them) …",
                     *lines[-SHORT_MESSAGES:]]
        return "\n".join(lines)
    return cut(_json_text(value))


def step_title(step: Step) -> str:
    tokens = step.tokens
    if step.type == "llm":
        what = f"LLM · {tokens['input']:,} in / {tokens['output']:,} out"
        if tokens["cache_read"] or tokens["cache_creation"]:
            what += f" (cache read {tokens['cache_read']:,}, write {tokens['cache_creation']:,})"
        what += f" · {usd(step.cost)}"
    else:
        what = f"tool {step.tool}"
    return f"#{step.index} · step {step.step} · {what} · {duration(step)}"


def duration(step: Step) -> str:
    """How long the call took; for a timed-out one, its timeout and its true duration.

    >>> duration(Step(index=0, step=0, type="tool", latency_ms=500, timed_out=True,
    ...               true_duration_ms=550))
    'timed out after 500 ms, true duration 550 ms'
    """
    if not step.timed_out:
        return f"{step.latency_ms:,.0f} ms"
    true = ("unknown" if step.true_duration_ms is None
            else f"{step.true_duration_ms:,.0f} ms")
    return f"timed out after {step.latency_ms:,.0f} ms, true duration {true}"


def render_step(step: Step, full: bool) -> Panel:
    rows: list[Text] = []
    fields = (("prompt", step.prompt), ("response", step.response)) if step.type == "llm" \
        else (("args", step.args), ("output", step.output))
    for name, value in fields:
        label = Text(f"{name}: ", style="bold cyan")
        rows.append(label + Text(render_body(value, full)))
    notes = [f"{', '.join(step.truncated)} truncated at capture"] if step.truncated else []
    if step.missing:
        notes.append(f"{', '.join(step.missing)} no longer stored")
    if notes:
        rows.append(Text("; ".join(notes), style="yellow"))
    return Panel(Group(*rows), title=Text(step_title(step)), title_align="left",
                 border_style="blue" if step.type == "llm" else "magenta")


def print_recording(recording: Recording, full: bool, console_out: Console = out) -> None:
    capture = recording.capture
    cost = sum(step.cost for step in recording.steps)
    console_out.print(Text.assemble(
        ("run ", "bold"), (recording.run_id, "bold"), f" · {recording.agent} · ",
        (recording.outcome, "red" if recording.outcome != "success" else "green"),
        f" · {len(recording.steps)} calls · {usd(cost)}"))
    style = {"kept": "green", "pending": "yellow", "discarded": "red"}[capture.status]
    console_out.print(Text.assemble(("capture: ", "bold"), (capture.status, style),
                                    f" ({capture.reason}; {capture.parts} parts, "
                                    f"{capture.bytes:,} bytes)"))
    for step in recording.steps:
        console_out.print(render_step(step, full))
    console_out.print(Text(f"re-drive it: ReplaySession.load(reader, {recording.run_id!r})",
                           style="dim"))


# --- commands -------------------------------------------------------------------------


def replay_command(
    run_id: Annotated[str, typer.Argument(help="the run to replay")],
    data_dir: DataDir = None,
    as_json: JsonFlag = False,
    full: FullFlag = False,
) -> None:
    """Print a run's recorded trajectory step by step.

    What was asked, what came back, which tool ran with what and returned what, tokens,
    cost and latency."""
    recording = _load(_reader(data_dir), run_id)
    if as_json:
        _write_json(recording.to_json())
    else:
        print_recording(recording, full)


def diff_command(
    run_a: Annotated[str, typer.Argument(help="the reference run")],
    run_b: Annotated[str, typer.Argument(help="the run compared with it")],
    data_dir: DataDir = None,
    as_json: JsonFlag = False,
) -> None:
    """The first step where two runs diverge, then the others.

    Compared in order: tool name, tool input, tool output, response, prompt, or a step
    only one of them has."""
    reader = _reader(data_dir)
    a, b = _load(reader, run_a), _load(reader, run_b)
    body = diff_json(a, b)
    if as_json:
        _write_json(body)
        return
    first = body["first"]
    out.print(f"A {run_a}: {len(a.steps)} calls, {a.outcome} · "
              f"B {run_b}: {len(b.steps)} calls, {b.outcome} · compared: {body['compared']}",
              markup=False, highlight=False)
    if first is None:
        out.print("no divergence: the two runs made the same calls", markup=False)
        return
    from loopwatch.processors.replay.diff import diff_recordings

    found = diff_recordings(a, b)
    out.print(Text("first divergence: ", style="bold red") + Text(found[0].describe()))
    if len(found) > 1:
        out.print(Text(f"then {len(found) - 1} more:", style="bold"))
        for divergence in found[1:]:
            out.print(Text(f"  {divergence.describe()}"))


def economics_command(
    agent: Annotated[str, typer.Argument(help="the agent")],
    days: Annotated[float, typer.Option(help="window of closed runs, days",
                                        callback=positive)] = 7.0,
    data_dir: DataDir = None,
    as_json: JsonFlag = False,
) -> None:
    """Reproducing an agent's failures by re-running vs capturing its runs: the costs.

    Re-running costs 1/p runs of tokens and engineer time per failure mode of
    probability p; capture costs stored bytes per run."""
    from datetime import timedelta

    from loopwatch.processors.replay.economics import Rates, agent_economics
    from loopwatch.store.reader import QueryError

    settings = settings_from(data_dir)
    reader = _reader(data_dir)
    try:
        numbers = agent_economics(reader, agent, Rates.from_settings(settings),
                                  timedelta(days=days))
    except QueryError as exc:
        console.print(f"[red]query failed:[/red] {exc}")
        raise typer.Exit(1) from None
    if as_json:
        _write_json(numbers.to_json())
        return
    out.print(f"{agent}: {numbers.runs} closed runs in {days:g} days · avg "
              f"{usd(numbers.avg_run_cost_usd)}, {numbers.avg_run_seconds:.1f} s a run · "
              f"capture {usd(numbers.capture_cost_per_run_usd, 6)} a run "
              f"({numbers.stored_bytes_per_run:,.0f} compressed bytes)", markup=False)
    for mode in numbers.failure_modes:
        tax = mode.tax
        verdict = "capture pays" if mode.worth_it else "capture costs more"
        out.print(f"  {mode.outcome}: p={tax.p:.2%} · {tax.expected_runs:.0f} runs to "
                  f"reproduce · tokens {usd(tax.token_cost, 2)} + engineer "
                  f"{usd(tax.engineer_cost, 2)} = {usd(tax.total, 2)} · {verdict}", markup=False)


def register(app: typer.Typer) -> None:
    app.command("replay")(replay_command)
    app.command("diff")(diff_command)
    app.command("economics")(economics_command)
