"""Every derived metric, defined once (``metrics.toml``), rendered for each reader.

A metric is numerator / denominator over the measures of a per-minute view. From that
one definition come: the view's SQL (a migration, ``python -m loopwatch.core.metrics views``),
the panels' and the report's re-aggregation over the view (``sum(num) / sum(den)``, so
buckets of any size stay exact), and the rules' and playbooks' series over the base
table on any window (``{{ ratio0 NAME | CONDITION }}`` in their SQL, see :func:`expand`);
``{{ view_ratio NAME }}`` re-aggregates over the view, and ``{{ view_column NAME }}`` is
the ratio over a query's own ``sum(measure) AS measure`` columns.
A rule therefore computes exactly what its panel draws, on its own window.

>>> METRICS["near_miss_ratio"].over_view()
'sum(near_misses) / nullIf(sum(timeouts_known_duration), 0)'
>>> METRICS["tool_error_rate"].ratio()
'sum(is_error) / count()'
>>> METRICS["exception_rate"].numerator_sql("closed_ts > {start:DateTime64(3, 'UTC')}")
"countIf(closed_ts > {start:DateTime64(3, 'UTC')} AND (outcome = 'hard_error'))"
>>> METRICS["silent_failure_ratio"].value(3, 12)
0.25
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Any, Final, Literal

__all__ = ["METRICS", "SETS", "SILENT_OUTCOMES", "VIEWS", "Measure", "Metric", "MetricsError",
           "View", "expand", "silent_sql", "views_sql"]

MeasureKind = Literal["count", "count_if", "sum", "sum_if", "sql", "metric"]
#: the per-minute bucket every view groups by (exact over the whole DateTime64 range, 008)
MINUTE: Final = "toStartOfInterval({time}, INTERVAL 60000 MILLISECOND) AS minute"


class MetricsError(ValueError):
    """``metrics.toml`` or a template that uses it is malformed; the message says where."""


def _sql_tuple(values: tuple[str, ...]) -> str:
    return "(" + ", ".join("'" + value.replace("'", "\\'") + "'" for value in values) + ")"


@dataclass(frozen=True)
class Measure:
    """One column of a view: an additive aggregate of the base table's rows (``count``,
    ``count_if``, ``sum``, ``sum_if``), a ratio column (``metric``), or plain ``sql``."""

    name: str
    kind: MeasureKind
    expr: str = ""
    predicate: str = ""
    #: False: a measure of the base table that the view does not carry (yet): rules and
    #: playbooks render it over the base table; panels cannot read it from the view
    in_view: bool = True

    @property
    def additive(self) -> bool:
        return self.kind in ("count", "count_if", "sum", "sum_if")

    def base(self, condition: str | None = None) -> str:
        """The aggregate over the base table's rows, restricted to ``condition``."""
        both = " AND ".join(part for part in (condition, self.predicate and f"({self.predicate})")
                            if part)
        if self.kind == "count":
            return f"countIf({condition})" if condition else "count()"
        if self.kind == "count_if":
            return f"countIf({both})" if condition else f"countIf({self.predicate})"
        if self.kind == "sum":
            return f"sumIf({self.expr}, {condition})" if condition else f"sum({self.expr})"
        if self.kind == "sum_if":
            return f"sumIf({self.expr}, {both})" if condition else \
                f"sumIf({self.expr}, {self.predicate})"
        raise MetricsError(f"measure {self.name} is not additive ({self.kind})")


@dataclass(frozen=True)
class View:
    """A per-minute view: its base table, time column, dimensions and columns in order."""

    name: str
    table: str
    dimensions: tuple[str, ...]
    columns: tuple[Measure, ...]
    time: str = ""
    where: str = ""
    rollup_of: str = ""

    def measure(self, name: str) -> Measure:
        for column in self.columns:
            if column.name == name:
                if not column.additive:
                    raise MetricsError(f"{self.name}.{name} is not a measure (a {column.kind})")
                return column
        raise MetricsError(f"view {self.name} has no measure {name!r}")

    @property
    def grain(self) -> str:
        return (f"one {self.table} row ({self.where or 'every row'}); per minute of "
                f"{self.time or VIEWS[self.rollup_of].time} by {', '.join(self.dimensions)}")

    def _rolled(self, column: Measure) -> str:
        """A measure of this view summed from the view it rolls up (its count, its sums)."""
        source = VIEWS[self.rollup_of]
        kind = {"count": "count", "count_if": "count", "sum": "sum", "sum_if": "sum"}[column.kind]
        match = [m.name for m in source.columns if m.kind == kind and m.expr == column.expr]
        if not match:
            raise MetricsError(f"{self.name}.{column.name}: {source.name} has no {kind} "
                               f"measure {column.expr!r} to roll up")
        if column.predicate:
            return f"sumIf({match[0]}, {column.predicate})"
        return f"sum({match[0]})"

    def _column(self, column: Measure) -> str:
        if column.kind == "sql":
            return f"{column.expr} AS {column.name}"
        if column.kind == "metric":
            return f"{METRICS[column.expr].view_column()} AS {column.name}"
        rendered = self._rolled(column) if self.rollup_of else column.base()
        return f"{rendered} AS {column.name}"

    def sql(self) -> str:
        """``CREATE OR REPLACE VIEW``, as a migration carries it (no trailing ``;``)."""
        dims = ", ".join(self.dimensions)
        head = "minute, " + dims if self.rollup_of else MINUTE.format(time=self.time) + \
            ",\n    " + dims
        source = self.rollup_of or f"{self.table} FINAL"
        lines = [f"CREATE OR REPLACE VIEW {self.name} AS", "SELECT", f"    {head},"]
        lines += [f"    {self._column(column)}," for column in self.columns if column.in_view]
        lines[-1] = lines[-1].rstrip(",")
        lines.append(f"FROM {source}")
        if self.where and not self.rollup_of:
            lines.append(f"WHERE {self.where}")
        lines.append(f"GROUP BY minute, {dims}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Metric:
    """numerator / denominator over a view's measures; the denominator may add several."""

    name: str
    view: str
    numerator: str
    denominator: tuple[str, ...]
    unit: str
    description: str
    never_empty: bool = False

    @property
    def grain(self) -> str:
        return VIEWS[self.view].grain

    @property
    def in_view(self) -> bool:
        """Whether the view carries every measure (panels and the report can read it)."""
        return all(m.in_view for m in self._measures((self.numerator, *self.denominator)))

    @property
    def table(self) -> str:
        return VIEWS[self.view].table

    def _measures(self, names: tuple[str, ...]) -> list[Measure]:
        return [VIEWS[self.view].measure(name) for name in names]

    def numerator_sql(self, condition: str | None = None) -> str:
        """The numerator over the base table's rows (a rule's, a playbook's window)."""
        return self._measures((self.numerator,))[0].base(condition)

    def denominator_sql(self, condition: str | None = None) -> str:
        measures = self._measures(self.denominator)
        if len(measures) > 1 and all(m.kind == "sum" for m in measures):
            summed = " + ".join(m.expr for m in measures)
            return f"sumIf({summed}, {condition})" if condition else f"sum({summed})"
        return " + ".join(m.base(condition) for m in measures)

    def _divide(self, numerator: str, denominator: str) -> str:
        if self.never_empty:
            return f"{numerator} / {denominator}"
        return f"{numerator} / nullIf({denominator}, 0)"

    def ratio(self, condition: str | None = None, *, empty: Literal["null", "zero"] = "null"
              ) -> str:
        """The metric over the base table's rows (restricted to ``condition``): NULL with
        no denominator, or 0 (``empty="zero"``: a rule's value must be a number)."""
        rendered = self._divide(self.numerator_sql(condition), self.denominator_sql(condition))
        if empty == "zero" and not self.never_empty:
            return f"ifNull({rendered}, 0)"
        return rendered

    def _in_view(self) -> None:
        if not self.in_view:
            raise MetricsError(f"metric {self.name}: view {self.view} does not carry its "
                               "measures (in_view = false): read it over the base table")

    def view_column(self) -> str:
        """The ratio column inside the view (over the minute's measures)."""
        self._in_view()
        return self._divide(self.numerator, " + ".join(self.denominator))

    def over_view(self) -> str:
        """Re-aggregated over rows of the view: sum(numerator) / sum(denominator)."""
        self._in_view()
        return self._divide(f"sum({self.numerator})", f"sum({' + '.join(self.denominator)})")

    def value(self, numerator: float, denominator: float) -> float | None:
        """The same ratio in Python (the report): None with no denominator."""
        return None if not denominator else float(numerator) / float(denominator)


def _measure(view: str, raw: dict[str, Any], sets: dict[str, tuple[str, ...]]) -> Measure:
    raw = dict(raw)
    in_view = raw.pop("in_view", True)
    name = raw.get("name")
    kinds = [key for key in ("count", "count_if", "sum", "sum_if", "sql", "metric") if key in raw]
    if not isinstance(name, str) or len(kinds) != 1 or set(raw) != {"name", kinds[0]} or \
            not isinstance(in_view, bool):
        raise MetricsError(f"view {view}: column {raw!r} needs a name and exactly one of "
                           "count, count_if, sum, sum_if, sql, metric (and maybe in_view)")
    kind = kinds[0]
    value = raw[kind]
    if not in_view and kind in ("sql", "metric"):
        raise MetricsError(f"view {view}: {name}: only a measure can be in_view = false")

    def fill(text: str) -> str:
        for set_name, values in sets.items():
            text = text.replace("{" + set_name + "}", _sql_tuple(values))
        return text

    if kind == "count":
        return Measure(name, "count", in_view=in_view)
    if kind == "count_if":
        return Measure(name, "count_if", predicate=fill(value), in_view=in_view)
    if kind == "sum_if":
        if not (isinstance(value, list) and len(value) == 2):
            raise MetricsError(f"view {view}: {name}.sum_if is [expression, predicate]")
        return Measure(name, "sum_if", expr=value[0], predicate=fill(value[1]),
                       in_view=in_view)
    return Measure(name, kind, expr=value, in_view=in_view)


def load(text: str | None = None) -> tuple[dict[str, tuple[str, ...]], dict[str, View],
                                           dict[str, Metric]]:
    """Sets, views and metrics from ``text`` (TOML) or the shipped ``metrics.toml``."""
    if text is None:
        text = resources.files("loopwatch.core").joinpath("metrics.toml").read_text(
            encoding="utf-8")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise MetricsError(f"metrics.toml is not valid TOML: {exc}") from exc
    try:
        return _build(data)
    except (KeyError, TypeError, AttributeError) as exc:
        raise MetricsError(f"metrics.toml: a view or metric is missing a field or has one "
                           f"it may not have ({type(exc).__name__}: {exc})") from exc


def _build(data: dict[str, Any]) -> tuple[dict[str, tuple[str, ...]], dict[str, View],
                                          dict[str, Metric]]:
    sets = {name: tuple(values) for name, values in data.get("sets", {}).items()}
    views = {}
    for raw in data["views"]:
        raw = dict(raw)
        columns = tuple(_measure(raw["name"], column, sets) for column in raw.pop("columns"))
        views[raw["name"]] = View(columns=columns, dimensions=tuple(raw.pop("dimensions")),
                                  **raw)
    metrics = {}
    for raw in data["metrics"]:
        raw = dict(raw)
        denominator = raw.pop("denominator")
        metric = Metric(denominator=(denominator,) if isinstance(denominator, str)
                        else tuple(denominator), **raw)
        if metric.view not in views:
            raise MetricsError(f"metric {metric.name}: no view {metric.view!r}")
        metrics[metric.name] = metric
    _validate(views, metrics)
    return sets, views, metrics


def _validate(views: dict[str, View], metrics: dict[str, Metric]) -> None:
    """Every measure a metric names exists in its view and adds up; every ratio column
    names a metric over its own view."""
    for metric in metrics.values():
        for name in (metric.numerator, *metric.denominator):
            views[metric.view].measure(name)
    for view in views.values():
        if view.rollup_of and view.rollup_of not in views:
            raise MetricsError(f"view {view.name}: rolls up no view {view.rollup_of!r}")
        for column in view.columns:
            if column.kind != "metric":
                continue
            ratio = metrics.get(column.expr)
            if ratio is None or ratio.view != view.name:
                raise MetricsError(f"view {view.name}: column {column.name} names no metric "
                                   f"over {view.name} ({column.expr!r})")
            if not all(views[view.name].measure(name).in_view
                       for name in (ratio.numerator, *ratio.denominator)):
                raise MetricsError(f"view {view.name}: column {column.name} divides a "
                                   "measure the view does not carry")


SETS, VIEWS, METRICS = load()
#: the outcomes an exception counter never sees (the silent failures, MEAS)
SILENT_OUTCOMES: Final[tuple[str, ...]] = SETS["silent_outcomes"]


def silent_sql() -> str:
    """The silent outcomes as a SQL tuple, for ``outcome IN ...``."""
    return _sql_tuple(SILENT_OUTCOMES)



#: ``{{ FUNCTION NAME }}`` or ``{{ FUNCTION NAME | CONDITION }}``; the closing braces
#: follow a space, so a condition may end in a query parameter ``{now:DateTime64(3, 'UTC')}``
_TEMPLATE = re.compile(r"\{\{\s*(?P<fn>\w+)\s+(?P<name>\w+)\s*(?:\|\s*(?P<cond>.*?))?\s+\}\}",
                       re.DOTALL)


def _render(match: re.Match[str]) -> str:
    fn, name, condition = match["fn"], match["name"], match["cond"] or None
    if fn == "set":
        if name not in SETS or condition:
            raise MetricsError(f"{match[0]!r}: no set {name!r} (sets: {sorted(SETS)})")
        return _sql_tuple(SETS[name])
    metric = METRICS.get(name)
    if metric is None:
        raise MetricsError(f"{match[0]!r}: no metric {name!r} (see metrics.toml)")
    if fn == "ratio":
        return metric.ratio(condition)
    if fn == "ratio0":
        return metric.ratio(condition, empty="zero")
    if fn == "numerator":
        return metric.numerator_sql(condition)
    if fn == "denominator":
        return metric.denominator_sql(condition)
    if fn == "view_ratio" and not condition:
        return metric.over_view()
    if fn == "view_column" and not condition:
        return metric.view_column()
    raise MetricsError(f"{match[0]!r}: unknown template function {fn!r} (ratio, ratio0, "
                       "numerator, denominator NAME [| CONDITION]; view_ratio, view_column, "
                       "set NAME)")


def expand(text: str) -> str:
    """Replace every ``{{ ... }}`` in a rule's or a playbook's SQL with the metric it
    names, rendered over the base table (see the module's docstring).

    >>> expand("{{ ratio0 tool_error_rate }}, {{ set silent_outcomes }}")
    "sum(is_error) / count(), ('budget_exhausted', 'gave_up', 'looped', 'wrong')"
    >>> expand("{{ ratio0 near_miss_ratio | ts > 0 }}").replace("near_miss", "n")
    'ifNull(countIf(ts > 0 AND (n = 1)) / nullIf(countIf(ts > 0 AND (n IS NOT NULL)), 0), 0)'
    >>> expand("{{ ratio x }}")
    Traceback (most recent call last):
    ...
    loopwatch.core.metrics.MetricsError: '{{ ratio x }}': no metric 'x' (see metrics.toml)
    """
    expanded = _TEMPLATE.sub(_render, text)
    if "{{" in expanded or "}}" in expanded:
        raise MetricsError("a metric template is not closed by ' }}' (a space first): "
                           + expanded[max(0, expanded.find("{{")):][:80])
    return expanded


#: the header of a migration that re-renders the views
VIEWS_HEADER: Final = (
    "-- Rendered by `python -m loopwatch.core.metrics views` from metrics.toml, the one\n"
    "-- definition of every derived metric (the panels, rules, report and playbooks render\n"
    "-- from it too); do not edit: a changed definition is a new migration rendered again.\n")


def views_sql() -> str:
    """Every view, as the migration that (re)creates them carries it."""
    return VIEWS_HEADER + "".join(f"\n{view.sql()};\n" for view in VIEWS.values())


def describe() -> str:
    """Every metric: name, unit, numerator / denominator, grain, description."""
    lines = []
    for metric in METRICS.values():
        where = metric.view if metric.in_view else f"{metric.table} (not in {metric.view} yet)"
        lines += [f"{metric.name} [{metric.unit}] = {metric.numerator} / "
                  f"{' + '.join(metric.denominator)} over {where}",
                  f"    grain: {metric.grain}", f"    {metric.description}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if argv == ["views"]:
        sys.stdout.write(views_sql())
        return 0
    if argv == ["list"]:
        sys.stdout.write(describe())
        return 0
    sys.stderr.write("usage: python -m loopwatch.core.metrics views|list  (the views' "
                     "migration SQL, "
                     "or every metric's definition)\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
