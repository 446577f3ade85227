"""A long command's status line, on a terminal or not.

rich's ``Live`` redraws one line in place, but only on a terminal: with the output
piped (``loopwatch demo | tee demo.log``, a CI log) it draws nothing, and a 90 s demo
printed two lines and then silence. :class:`LiveLine` keeps the live line on a terminal
and, anywhere else, prints the status as a plain line when its phase changes and at
most every ``every_s`` seconds otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import TracebackType

from rich.console import Console
from rich.live import Live
from rich.table import Table

#: how often a plain (not a terminal) status line is printed while nothing else changes
PLAIN_EVERY_S = 5.0


class LiveLine:
    """``update(parts, phase)`` shows ``parts`` (short texts, the first one bold on a
    terminal); ``enabled=False`` shows nothing (``--json``)."""

    def __init__(self, console: Console, enabled: bool = True, every_s: float = PLAIN_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._console = console
        self._enabled = enabled
        self._every_s = every_s
        self._clock = clock
        self._live: Live | None = None
        self._phase: str | None = None
        self._printed_at: float | None = None

    def __enter__(self) -> LiveLine:
        if self._enabled and self._console.is_terminal:
            self._live = Live(console=self._console, transient=True, auto_refresh=False,
                              redirect_stdout=False)
            self._live.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._live is not None:
            self._live.__exit__(kind, error, trace)
            self._live = None

    def update(self, parts: Sequence[str], phase: str = "") -> None:
        if not self._enabled:
            return
        if self._live is not None:
            line = Table.grid(padding=(0, 2))
            line.add_row(*(f"[bold]{part}[/bold]" if index == 0 else part
                           for index, part in enumerate(parts)))
            self._live.update(line, refresh=True)
            return
        now = self._clock()
        due = self._printed_at is None or now - self._printed_at >= self._every_s
        if due or phase != self._phase:
            self._console.print("  ".join(parts), markup=False, highlight=False,
                                soft_wrap=True)
            self._printed_at, self._phase = now, phase
