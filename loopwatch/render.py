"""Query results on a terminal: a table that fits the terminal's width.

A table wider than the terminal used to become one record per row (psql's ``\\x``):
whole values, but at 80 columns every listing of five columns or more turned into a
long column of blocks. The table stays a table instead: the widest cells are cut with
an ellipsis, the columns a reader copies into the next command (ids, rule and playbook
names) last, and a caption says ``--json`` prints every value whole. Only a result too
wide even then (many columns) is shown as records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.cells import cell_len
from rich.console import Console, Group, RenderableType
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

#: what the next command takes: an id is cut only when nothing else is left to cut, a
#: name counts half its width when the widest column is chosen for cutting
IDS = frozenset({"fingerprint", "event_id", "trace_id"})
NAMES = frozenset({"rule", "playbook", "name", "scenario", "agent", "tool"})
#: a cut column keeps at least this many cells (its ellipsis included)
MIN_WIDTH = 8
CAPTION = "cut to fit {width} columns: --json prints every value whole"


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def result_table(columns: Sequence[str], rows: Sequence[Sequence[Any]],
                 title: str | None = None, widths: Sequence[int] | None = None,
                 caption: str | None = None) -> Table:
    """The rows as a table; ``widths`` fixes each column's width, cutting with "…"."""
    table = Table(title=title, caption=caption, caption_justify="left")
    for index, column in enumerate(columns):
        if widths is None:
            table.add_column(column)
        else:
            table.add_column(column, width=widths[index], no_wrap=True, overflow="ellipsis")
    for row in rows:
        table.add_row(*(_cell(value) for value in row))
    return table


def result_records(columns: Sequence[str], rows: Sequence[Sequence[Any]],
                   title: str | None = None) -> Group:
    """Each row as a block of ``column  value`` lines under a numbered rule."""
    parts: list[RenderableType] = [Text(title, style="bold")] if title else []
    for number, row in enumerate(rows, start=1):
        parts.append(Rule(f"record {number}", align="left", style="dim"))
        record = Table.grid(padding=(0, 2))
        record.add_column(style="bold", no_wrap=True)
        record.add_column(overflow="fold")
        for column, value in zip(columns, row, strict=True):
            record.add_row(column, _cell(value))
        parts.append(record)
    return Group(*parts)


def _natural_widths(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[int]:
    widths = [cell_len(column) for column in columns]
    for row in rows:
        for index, value in enumerate(row):
            longest = max((cell_len(line) for line in _cell(value).splitlines()), default=0)
            widths[index] = max(widths[index], longest)
    return widths


def fit_widths(columns: Sequence[str], natural: Sequence[int], space: int) -> list[int] | None:
    """Column widths summing to at most ``space``: the widest column loses a cell at a
    time, an id only when nothing else can be cut, a name counting half its width; none
    below its header or ``MIN_WIDTH``; None if even that does not fit.

    >>> fit_widths(["run_id", "summary", "n"], [12, 40, 1], 30)
    [12, 17, 1]
    >>> fit_widths(["a", "b"], [20, 20], 5) is None
    True
    """
    widths = list(natural)
    floors = [min(n, max(MIN_WIDTH, cell_len(c))) for c, n in zip(columns, natural, strict=True)]
    weight = [0.0 if column in IDS or column.endswith("_id") else
              0.5 if column in NAMES else 1.0 for column in columns]
    while sum(widths) > space:
        candidates = [i for i in range(len(widths)) if widths[i] > floors[i]]
        if not candidates:
            return None
        widest = max(candidates, key=lambda i: (weight[i] > 0, widths[i] * weight[i]))
        widths[widest] -= 1
    return widths


def fitted(console: Console, columns: Sequence[str], rows: Sequence[Sequence[Any]],
           title: str | None = None) -> RenderableType:
    """The result on ``console``'s width: "no rows", the table, the table with cut
    cells, or (too many columns for any table) the records."""
    if not rows:
        return Text(f"{title}\nno rows" if title else "no rows")
    natural = _natural_widths(columns, rows)
    space = console.width - (3 * len(columns) + 1)  # a border and two pads per column
    if sum(natural) <= space:
        return result_table(columns, rows, title)
    widths = fit_widths(columns, natural, space)
    if widths is None:
        return result_records(columns, rows, title)
    return result_table(columns, rows, title, widths, CAPTION.format(width=console.width))
