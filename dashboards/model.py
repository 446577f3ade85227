"""The shape of a panel definition, shared by the Grafana generator and the web view.

Kept apart from the panel table itself (:mod:`loopwatch.dashboards.panels`) so the table reads as
data: every field here is something both renderers need, so nothing about a panel is
said twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

Viz = Literal["timeseries", "bars", "table", "stat", "barchart"]
"""``timeseries`` lines; ``bars`` stacked bars over time; ``barchart`` categories on x."""

TierId = Literal["realtime", "trends", "drilldown"]

#: The plugin's query formats: 0 time series (long frames become wide), 1 table.
FORMAT_TIME_SERIES: Final = 0
FORMAT_TABLE: Final = 1

#: Grafana unit ids the panels use; the web view formats the same ids.
UNITS: Final = ("percentunit", "currencyUSD", "ms", "short", "none", "dateTimeAsIso")


@dataclass(frozen=True)
class Threshold:
    """From ``value`` up the colour is ``color`` (Grafana's absolute thresholds)."""

    value: float
    color: str


@dataclass(frozen=True)
class Variable:
    """A dashboard template variable; ``sql`` lists its values (None = free text)."""

    name: str
    label: str
    sql: str | None = None
    description: str = ""


@dataclass(frozen=True)
class Panel:
    """One panel: what Grafana draws and what the web view draws, from the same SQL.

    ``columns`` is the contract with the SQL (a test runs every query and compares).
    For time series the first column is ``time``, ``series_by`` are label columns that
    split one value into several series (the plugin turns such "long" frames into wide
    ones), and every other column is a value.

    ``colors`` pins colours: keyed by label value for split series, by column name for
    plain series and bar charts, by cell text in the ``color_columns`` of a table.
    ``thresholds`` colour a stat, draw lines on a time series (``threshold_lines``) or
    colour the ``threshold_columns`` of a table. A table with a ``run_id`` column links
    each run id to the run drill-down.
    """

    id: str
    tier: TierId
    title: str
    description: str
    sql: str
    viz: Viz
    columns: tuple[str, ...]
    unit: str = "short"
    series_by: tuple[str, ...] = ()
    column_units: dict[str, str] = field(default_factory=dict)
    thresholds: tuple[Threshold, ...] = ()
    base_color: str = "green"
    threshold_lines: bool = False
    threshold_columns: tuple[str, ...] = ()
    colors: dict[str, str] = field(default_factory=dict)
    color_columns: tuple[str, ...] = ()
    dashed: tuple[str, ...] = ()
    width: int = 12
    height: int = 8
    min_interval: str = ""
    decimals: int | None = None
    needs_run: bool = False
    section: str = ""

    @property
    def format(self) -> int:
        return FORMAT_TIME_SERIES if self.viz in ("timeseries", "bars") else FORMAT_TABLE

    @property
    def is_time_series(self) -> bool:
        return self.format == FORMAT_TIME_SERIES

    @property
    def value_columns(self) -> tuple[str, ...]:
        skip = {"time", *self.series_by}
        return tuple(column for column in self.columns if column not in skip)

    @property
    def links_run_id(self) -> bool:
        return "run_id" in self.columns and not self.is_time_series

    def unit_of(self, column: str) -> str:
        return self.column_units.get(column, self.unit)


@dataclass(frozen=True)
class Annotation:
    """Events drawn on every time series: columns ``time``, ``title``, ``text``, ``tags``."""

    name: str
    sql: str
    color: str


@dataclass(frozen=True)
class Tier:
    """One dashboard: which panels, the default range and how often it refreshes."""

    id: TierId
    uid: str
    title: str
    description: str
    time_from: str
    refresh: str
    variables: tuple[str, ...]
    time_options: tuple[str, ...]
