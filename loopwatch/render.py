"""Query results on a terminal: a table when it fits, else one record per row.

A table wider than the terminal makes rich shrink its columns, cutting rule names,
run ids and timestamps to a few characters followed by an ellipsis: exactly the values a
reader copies into the next command. Like psql's ``\\x auto``, such a result is shown as
records instead: one block per row, a column name and its whole value per line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

#: a width no table reaches: measured against it, a table reports its natural width
UNBOUNDED = 1_000_000


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def result_table(columns: Sequence[str], rows: Sequence[Sequence[Any]],
                 title: str | None = None) -> Table:
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
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


def fitted(console: Console, columns: Sequence[str], rows: Sequence[Sequence[Any]],
           title: str | None = None) -> RenderableType:
    """The table if every cell fits whole on ``console``'s width, else the records."""
    table = result_table(columns, rows, title)
    unbounded = console.options.update_width(UNBOUNDED)
    if Measurement.get(console, unbounded, table).maximum <= console.width:
        return table
    return result_records(columns, rows, title)
