"""Expanding panel SQL the way Grafana and its ClickHouse plugin do, but safely.

A panel's SQL is written once, for Grafana: it uses the plugin's macros
(``$__timeFilter(ts)``, ``$__timeInterval(ts)``, ``$__interval_s``, ...), its frontend
macro ``$__conditionalAll(cond, $var)`` and template variables. The built-in web view
runs the very same text, so it must expand it in the same three steps, in the same
order, as a Grafana request does:

1. :func:`conditional_all` -- the plugin's frontend: each ``$__conditionalAll(cond,
   $var)``, from the last one backwards, becomes ``1=1`` when the variable is empty or
   "All", else ``cond``.
2. :func:`bind_variables` -- where Grafana's template service would paste the values in,
   each ``${name:sqlstring}`` becomes ClickHouse query parameters
   (``{v_name_0:String}, ...``): user input never becomes SQL text. Any other variable
   syntax is refused, so a panel cannot quietly rely on unescaped interpolation.
3. :func:`expand_backend_macros` -- the plugin's backend (sqlds): a regex per macro,
   ``\\$__name\\b(?:\\((.*?)\\))?``, arguments split on commas, every occurrence replaced.
   The same non-greedy regex means nested parentheses in macro arguments break in both.

>>> window = QueryWindow(datetime(2026, 11, 29, 12, 0, tzinfo=UTC),
...                      datetime(2026, 11, 29, 13, 0, tzinfo=UTC), interval_s=60)
>>> sql = ("SELECT $__timeInterval(ts) AS time, count() / $__interval_s AS rps FROM t "
...        "WHERE $__timeFilter(ts) AND $__conditionalAll(agent IN (${agent:sqlstring}), $agent)")
>>> print(expand(sql, window, {"agent": ["a", "b"]}).sql)  # doctest: +NORMALIZE_WHITESPACE
SELECT toStartOfInterval(toDateTime(ts), INTERVAL 60 second) AS time, count() / 60 AS rps
FROM t WHERE ts >= toDateTime(1795953600) AND ts <= toDateTime(1795957200)
AND agent IN ({v_agent_0:String}, {v_agent_1:String})
>>> expand(sql, window, {"agent": ["a", "b"]}).parameters
{'v_agent_0': 'a', 'v_agent_1': 'b'}
>>> "1=1" in expand(sql, window, {"agent": []}).sql
True
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final

ALL: Final = "$__all"
"""The value Grafana gives a multi-value variable when "All" is selected."""

#: Grafana's template-variable syntax: ``$name``, ``[[name:fmt]]``, ``${name.path:fmt}``.
VARIABLE = re.compile(
    r"\$(\w+)|\[\[(\w+?)(?::(\w+))?\]\]|\$\{(\w+)(?:\.([^:^}]+))?(?::([^}]+))?\}")
#: The only variable form panels may use: quoted, escaped, comma-separated values.
SAFE_FORMAT: Final = "sqlstring"
CONDITIONAL_ALL: Final = "$__conditionalAll("

#: sqlds's defaults that the ClickHouse plugin does not override: they produce SQL
#: ClickHouse cannot run (``datepart``), or depend on query-builder state, so a panel
#: that uses one is a bug.
UNSUPPORTED_MACROS: Final = ("timeFrom", "timeTo", "timeGroup", "table", "column")


class MacroError(ValueError):
    """The SQL uses a macro or variable form the web view cannot expand faithfully."""


@dataclass(frozen=True)
class QueryWindow:
    """What a Grafana request carries besides the SQL: the time range and the interval."""

    start: datetime
    end: datetime
    interval_s: float

    def __post_init__(self) -> None:
        for moment in (self.start, self.end):
            if moment.tzinfo is None:
                raise ValueError("QueryWindow needs timezone-aware datetimes")
        if self.end < self.start:
            raise ValueError("QueryWindow ends before it starts")


@dataclass(frozen=True)
class Expanded:
    """SQL ready for ClickHouse, with the query parameters the variables became."""

    sql: str
    parameters: dict[str, str] = field(default_factory=dict)


# --- step 1: the plugin frontend's $__conditionalAll ------------------------------------


def _macro_args(sql: str, open_index: int) -> list[str]:
    """Arguments of the macro whose ``(`` is at ``open_index``, split on top-level commas.

    The plugin's ``getMacroArgs``: it counts only round brackets, so a comma inside
    ``(...)`` stays in its argument; an unbalanced call yields no arguments.

    >>> _macro_args("f(a IN (1, 2), $v) tail", 1)
    ['a IN (1, 2)', ' $v']
    """
    args: list[str] = []
    depth = 0
    last = open_index + 1
    for index in range(open_index, len(sql)):
        char = sql[index]
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 1:
            args.append(sql[last:index])
            last = index + 1
        if depth == 0:
            args.append(sql[last:index])
            return args
    return []


_CONDITION_VARIABLE = re.compile(r"(?<=\$\{)\w+(?=\})|(?<=\$)\w+")


def _is_all(values: Sequence[str] | None) -> bool:
    return not values or ALL in values or all(value == "" for value in values)


def conditional_all(sql: str, selected: Mapping[str, Sequence[str]]) -> str:
    """Replace every ``$__conditionalAll(condition, $var)`` as the plugin's frontend does.

    >>> conditional_all("WHERE $__conditionalAll(a IN (${a:sqlstring}), $a)", {"a": ["x"]})
    'WHERE a IN (${a:sqlstring})'
    >>> conditional_all("WHERE $__conditionalAll(a IN (${a:sqlstring}), $a)", {"a": [ALL]})
    'WHERE 1=1'
    """
    index = sql.rfind(CONDITIONAL_ALL)
    while index != -1:
        params = _macro_args(sql, index + len(CONDITIONAL_ALL) - 1)
        if len(params) != 2:
            raise MacroError("$__conditionalAll needs (condition, $variable): "
                             f"{sql[index:][:80]!r}")
        phrase = params[0]
        found = _CONDITION_VARIABLE.search(params[1].strip())
        if found and _is_all(selected.get(found.group(0))):
            phrase = "1=1"
        sql = sql.replace(f"{CONDITIONAL_ALL}{params[0]},{params[1]})", phrase, 1)
        index = sql.rfind(CONDITIONAL_ALL)
    return sql


# --- step 2: template variables, as query parameters ------------------------------------


def referenced_variables(sql: str) -> set[str]:
    """Template variables a query refers to (Grafana globals and macros excluded).

    >>> sorted(referenced_variables("a IN (${agent:sqlstring}) AND $__timeFilter(ts), $model"))
    ['agent', 'model']
    """
    names = set()
    for match in VARIABLE.finditer(sql):
        name = match.group(1) or match.group(2) or match.group(4)
        if not name.startswith("__"):
            names.add(name)
    return names


def bind_variables(sql: str, selected: Mapping[str, Sequence[str]]) -> Expanded:
    """Turn each ``${name:sqlstring}`` into ClickHouse parameters, one per value.

    Grafana would paste ``'v1','v2'`` (quotes doubled); a parameter list keeps the
    same SQL shape without ever putting a value into the SQL text.

    >>> bind_variables("run_id = ${run_id:sqlstring}", {"run_id": ["x' OR 1=1 --"]})
    Expanded(sql='run_id = {v_run_id_0:String}', parameters={'v_run_id_0': "x' OR 1=1 --"})
    >>> bind_variables("agent = '$agent'", {"agent": ["a"]})
    Traceback (most recent call last):
    ...
    loopwatch.dashboards.macros.MacroError: variable $agent must be written ${agent:sqlstring}
    """
    parameters: dict[str, str] = {}

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(4)
        if name.startswith("__"):
            return match.group(0)
        if match.group(4) is None or match.group(5) is not None or match.group(6) != SAFE_FORMAT:
            raise MacroError(f"variable ${name} must be written ${{{name}:{SAFE_FORMAT}}}")
        values = list(selected.get(name) or [""])
        if ALL in values:
            raise MacroError(f"${{{name}}} is 'All' outside a $__conditionalAll")
        placeholders = []
        for value in values:
            key = f"v_{name}_{len([k for k in parameters if k.startswith(f'v_{name}_')])}"
            parameters[key] = str(value)
            placeholders.append(f"{{{key}:String}}")
        return ", ".join(placeholders)

    return Expanded(VARIABLE.sub(replace, sql), parameters)


def render_literal(sql: str, selected: Mapping[str, Sequence[str]]) -> str:
    """What Grafana's template service pastes for ``${name:sqlstring}``: ``'a','b'``.

    A reference for tests that compare the two paths; the web view never uses it.

    >>> render_literal("x IN (${a:sqlstring})", {"a": ["it's", "b"]})
    "x IN ('it''s','b')"
    """

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(4)
        if name.startswith("__"):
            return match.group(0)
        values = list(selected.get(name) or [""])
        return ",".join("'" + value.replace("'", "''") + "'" for value in values)

    return VARIABLE.sub(replace, sql)


# --- step 3: the plugin backend's macros -------------------------------------------------


def _unix(moment: datetime) -> int:
    return int(moment.timestamp() // 1)


def _unix_ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000 // 1)


def _one(name: str, args: list[str]) -> str:
    if len(args) != 1:
        raise MacroError(f"$__{name} expects 1 argument, received {len(args)}")
    return args[0]


def _filter(low: str, high: str) -> Callable[[str, list[str], QueryWindow], str]:
    def expand_filter(name: str, args: list[str], window: QueryWindow) -> str:
        column = _one(name, args)
        start = low.format(s=_unix(window.start), ms=_unix_ms(window.start),
                           d=window.start.astimezone(UTC).strftime("%Y-%m-%d"))
        end = high.format(s=_unix(window.end), ms=_unix_ms(window.end),
                          d=window.end.astimezone(UTC).strftime("%Y-%m-%d"))
        return f"{column} >= {start} AND {column} <= {end}"

    return expand_filter


def _date_time_filter(name: str, args: list[str], window: QueryWindow) -> str:
    if len(args) != 2:
        raise MacroError(f"$__{name} expects 2 arguments, received {len(args)}")
    date_column, time_column = args
    start_day = window.start.astimezone(UTC).strftime("%Y-%m-%d")
    end_day = window.end.astimezone(UTC).strftime("%Y-%m-%d")
    return (f"({date_column} >= toDate('{start_day}') AND {date_column} <= toDate('{end_day}'))"
            f" AND ({time_column} >= toDateTime({_unix(window.start)}) AND {time_column} <= "
            f"toDateTime({_unix(window.end)}))")


def _seconds(window: QueryWindow) -> int:
    return int(max(window.interval_s, 1))


MacroFn = Callable[[str, list[str], QueryWindow], str]

#: The ClickHouse plugin's backend macros (pkg/macros), in one fixed order; no
#: expansion produces text another macro matches, so the order cannot matter.
BACKEND_MACROS: Final[dict[str, MacroFn]] = {
    "fromTime": lambda n, a, w: f"toDateTime({_unix(w.start)})",
    "toTime": lambda n, a, w: f"toDateTime({_unix(w.end)})",
    "fromTime_ms": lambda n, a, w: f"fromUnixTimestamp64Milli({_unix_ms(w.start)})",
    "toTime_ms": lambda n, a, w: f"fromUnixTimestamp64Milli({_unix_ms(w.end)})",
    "timeFilter": _filter("toDateTime({s})", "toDateTime({s})"),
    "timeFilter_ms": _filter("fromUnixTimestamp64Milli({ms})", "fromUnixTimestamp64Milli({ms})"),
    "dateFilter": _filter("toDate('{d}')", "toDate('{d}')"),
    "dateTimeFilter": _date_time_filter,
    "dt": _date_time_filter,
    "timeInterval": lambda n, a, w: (
        f"toStartOfInterval(toDateTime({_one(n, a)}), INTERVAL {_seconds(w)} second)"),
    "timeInterval_ms": lambda n, a, w: (
        f"toStartOfInterval(toDateTime64({_one(n, a)}, 3), INTERVAL "
        f"{int(max(w.interval_s * 1000, 1))} millisecond)"),
    "interval_s": lambda n, a, w: str(_seconds(w)),
}


def expand_backend_macros(sql: str, window: QueryWindow) -> str:
    """Expand the plugin's backend macros with sqlds's regex and argument splitting.

    >>> w = QueryWindow(datetime(2022, 1, 1, tzinfo=UTC), datetime(2022, 1, 2, tzinfo=UTC), 30)
    >>> print(expand_backend_macros("$__timeFilter_ms(ts) AND $__dateFilter( day )", w))
    ... # doctest: +NORMALIZE_WHITESPACE
    ts >= fromUnixTimestamp64Milli(1640995200000) AND ts <= fromUnixTimestamp64Milli(1641081600000)
    AND day >= toDate('2022-01-01') AND day <= toDate('2022-01-02')
    """
    for name in UNSUPPORTED_MACROS:
        if re.search(rf"\$__{name}\b", sql, re.ASCII):
            raise MacroError(f"$__{name} is a generic sqlds macro the ClickHouse plugin does "
                             "not implement for ClickHouse; do not use it")
    for name, function in BACKEND_MACROS.items():
        pattern = re.compile(rf"\$__{name}\b(?:\((.*?)\))?", re.ASCII)
        for match in pattern.finditer(sql):
            args = [arg.strip() for arg in (match.group(1) or "").split(",")]
            sql = sql.replace(match.group(0), function(name, args, window))
    return sql


_LEFTOVER = re.compile(r"\$(\w+|\{)")


def expand(sql: str, window: QueryWindow, selected: Mapping[str, Sequence[str]]) -> Expanded:
    """All three steps, in Grafana's order; refuses anything left unexpanded."""
    bound = bind_variables(conditional_all(sql, selected), selected)
    text = expand_backend_macros(bound.sql, window)
    leftover = _LEFTOVER.search(text)
    if leftover:
        raise MacroError(f"unknown macro or variable ${leftover.group(1)} in panel SQL")
    return Expanded(text, bound.parameters)


# --- Grafana's interval -------------------------------------------------------------------

#: Grafana's ``rangeutil.roundInterval``: (upper bound, rounded interval) in ms.
_ROUNDING_MS: Final = (
    (15, 10), (35, 20), (75, 50), (150, 100), (350, 200), (750, 500), (1_500, 1_000),
    (3_500, 2_000), (7_500, 5_000), (12_500, 10_000), (17_500, 15_000), (25_000, 20_000),
    (45_000, 30_000), (90_000, 60_000), (210_000, 120_000), (450_000, 300_000),
    (750_000, 600_000), (1_050_000, 900_000), (1_500_000, 1_200_000),
    (2_700_000, 1_800_000), (5_400_000, 3_600_000), (9_000_000, 7_200_000),
    (16_200_000, 10_800_000), (27_000_000, 21_600_000), (43_200_000, 43_200_000),
    (604_800_000, 86_400_000), (1_814_400_000, 604_800_000),
    (3_628_800_000, 2_592_000_000),
)


def grafana_interval(start: datetime, end: datetime, max_data_points: int,
                     min_interval_s: float = 0.0) -> float:
    """The ``$__interval`` Grafana sends: range / points, rounded, at least the minimum.

    >>> from datetime import timedelta
    >>> h = datetime(2026, 1, 1, tzinfo=UTC)
    >>> grafana_interval(h, h + timedelta(hours=1), 240, min_interval_s=60)
    60.0
    >>> grafana_interval(h, h + timedelta(hours=24), 240, min_interval_s=60)
    300.0
    """
    span_ms = max((end - start).total_seconds() * 1000 / max(max_data_points, 1), 0)
    rounded = next((value for bound, value in _ROUNDING_MS if span_ms < bound),
                   31_536_000_000)
    return float(max(rounded / 1000, min_interval_s))
