"""Long commands' status lines with the output captured (not a terminal): plain lines,
when the phase changes and every 5 s of the command's clock, instead of nothing."""

from __future__ import annotations

import io

from rich.console import Console

from loopwatch.liveline import LiveLine


def test_off_a_terminal_the_status_is_printed_as_plain_lines_every_5_s_and_on_each_phase():
    output = io.StringIO()
    console = Console(file=output, force_terminal=False, width=200)
    assert not console.is_terminal
    now = [0.0]
    with LiveLine(console, clock=lambda: now[0]) as line:
        for now[0], events in [(0.0, 0), (0.5, 10), (4.9, 80), (5.0, 90), (7.0, 120),
                               (10.1, 160)]:
            line.update(["simulating", f"events sent {events}"], phase="simulating")
        now[0] = 10.6
        line.update(["draining", "events sent 160"], phase="draining")
        now[0] = 11.0
        line.update(["draining", "events sent 160"], phase="draining")
    assert output.getvalue().splitlines() == [
        "simulating  events sent 0",
        "simulating  events sent 90",
        "simulating  events sent 160",
        "draining  events sent 160",
    ]


def test_a_disabled_line_prints_nothing():
    output = io.StringIO()
    with LiveLine(Console(file=output, force_terminal=False), enabled=False) as line:
        line.update(["simulating", "events sent 1"])
    assert output.getvalue() == ""


# The piped demo's progress lines: tests/test_cli.py, beside the demo's report.
