"""What the web view's JSON endpoints return, independent of HTTP.

Each panel runs exactly its Grafana SQL: :func:`loopwatch.dashboards.macros.expand` applies the
plugin's macros for the requested range and interval, and binds template variables as
ClickHouse query parameters. Time series come back pivoted the way the plugin turns a
"long" frame into a wide one (one series per label combination and value column), so
the page only draws.
"""

from __future__ import annotations

import math
import re
import shlex
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any, Final

from loopwatch.dashboards.grafana import threshold_steps
from loopwatch.dashboards.macros import QueryWindow, expand, grafana_interval
from loopwatch.dashboards.model import Panel, Tier
from loopwatch.dashboards.panels import (
    ANNOTATION,
    FILTER_VARIABLES,
    PANELS,
    PANELS_BY_ID,
    TIERS,
    TIERS_BY_ID,
    VARIABLES,
    title_of,
)
from loopwatch.processors.replay.economics import Rates, agent_economics
from loopwatch.processors.replay.recording import RunNotFound, load_recording
from loopwatch.store.clickhouse import read_time
from loopwatch.store.reader import QueryError, Reader, store_health

MAX_VALUE_LENGTH: Final = 256
MAX_RANGE: Final = timedelta(days=400)
DEFAULT_POINTS: Final = 240
_RELATIVE = re.compile(r"^now-(\d+)([smhdw])$")
_SECONDS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class BadRequest(ValueError):
    """The request's parameters are invalid; the message says which."""


class NotFound(LookupError):
    """No such panel or run."""


def relative_seconds(text: str) -> int:
    """Seconds in a Grafana relative time ``now-1h``.

    >>> relative_seconds("now-7d")
    604800
    """
    found = _RELATIVE.match(text)
    if not found:
        raise ValueError(f"not a relative time: {text!r}")
    return int(found.group(1)) * _SECONDS[found.group(2)]


def as_datetime(value: Any) -> datetime | None:
    """A ClickHouse time as an aware UTC datetime: what :func:`read_time` reads, and
    also dates (``toDate`` / ``toStartOfDay`` columns) and epoch seconds, which panels
    return too.

    >>> as_datetime("2026-11-29T10:00:00"), as_datetime(date(2026, 11, 29)).hour
    (datetime.datetime(2026, 11, 29, 10, 0, tzinfo=datetime.timezone.utc), 0)
    >>> as_datetime("2026-11-29 11:00:00+01:00") == as_datetime(1795946400)
    True
    """
    if value is None or isinstance(value, datetime):
        moment = read_time(value)
    elif isinstance(value, date):
        moment = datetime(value.year, value.month, value.day, tzinfo=UTC)
    elif isinstance(value, int | float):
        return datetime.fromtimestamp(float(value), tz=UTC)
    else:
        moment = read_time(str(value))
    return None if moment is None else moment.astimezone(UTC)


def _epoch(value: Any) -> float | None:
    moment = as_datetime(value)
    return None if moment is None else moment.timestamp()


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, str):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def json_cell(value: Any) -> Any:
    """A table cell as JSON: times as ISO-8601 UTC, uuids as text, no NaN."""
    if isinstance(value, datetime | date):
        moment = as_datetime(value)
        return None if moment is None else moment.isoformat().replace("+00:00", "Z")
    if isinstance(value, uuid.UUID | Decimal):
        return str(value) if isinstance(value, uuid.UUID) else float(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list | tuple):
        return [json_cell(item) for item in value]
    if isinstance(value, dict):
        return {str(key): json_cell(item) for key, item in value.items()}
    return value


def series_name(panel: Panel, column: str, labels: Sequence[str]) -> str:
    """The same naming rule as the Grafana display names (see loopwatch.dashboards.grafana)."""
    joined = " · ".join(str(label) if label not in ("", None) else "—" for label in labels)
    if not panel.series_by:
        return title_of(column)
    return joined if len(panel.value_columns) == 1 else f"{title_of(column)} · {joined}"


def fill_gaps(times: list[float], step_s: float | None) -> list[float]:
    """Every bucket of ``step_s`` between the first and the last time, so a minute
    without rows is a null in each series (a gap in the line), not a straight line
    across it. Times off the step's grid are kept as they are.

    >>> fill_gaps([0.0, 60.0, 240.0], 60), fill_gaps([0.0, 240.0], None)
    ([0.0, 60.0, 120.0, 180.0, 240.0], [0.0, 240.0])
    """
    if not step_s or len(times) < 2 or (times[-1] - times[0]) / step_s > 100_000:
        return times
    grid = {times[0] + step_s * k for k in range(int((times[-1] - times[0]) // step_s) + 1)}
    return sorted(grid.union(times))


def bucket_s(panel: Panel, window: QueryWindow) -> float | None:
    """A time series' bucket when the query fixes it: ``$__timeInterval`` buckets by
    the window's interval; other bucketing (the trends' hour or day) is not known here,
    so their series are not gap-filled."""
    return float(window.interval_s) if "$__timeInterval(" in panel.sql else None


def pivot(panel: Panel, columns: Sequence[str], rows: Sequence[Sequence[Any]],
          step_s: float | None = None) -> dict[str, Any]:
    """Long rows (time, labels..., values...) into aligned series, as the plugin does;
    with ``step_s``, the buckets without rows are there too, as nulls (see
    :func:`fill_gaps`)."""
    index = {name: position for position, name in enumerate(columns)}
    times = fill_gaps(sorted({t for t in (_epoch(row[0]) for row in rows) if t is not None}),
                      step_s)
    slot = {moment: position for position, moment in enumerate(times)}
    series: dict[tuple[str, tuple[str, ...]], list[float | None]] = {}
    for row in rows:
        moment = _epoch(row[0])
        if moment is None:
            continue
        labels = tuple("" if row[index[name]] is None else str(row[index[name]])
                       for name in panel.series_by)
        for column in panel.value_columns:
            key = (column, labels)
            if key not in series:
                series[key] = [None] * len(times)
            series[key][slot[moment]] = _number(row[index[column]])
    order = {column: position for position, column in enumerate(panel.value_columns)}
    built = []
    for (column, labels), values in sorted(series.items(),
                                           key=lambda item: (order[item[0][0]], item[0][1])):
        color_key = labels[0] if len(labels) == 1 else column
        built.append({"name": series_name(panel, column, labels), "column": column,
                      "labels": dict(zip(panel.series_by, labels, strict=True)),
                      "color": panel.colors.get(color_key), "dashed": column in panel.dashed,
                      "values": values})
    return {"x": times, "series": built}


def panel_meta(panel: Panel) -> dict[str, Any]:
    """Everything the page needs to draw a panel, from its one definition."""
    return {
        "id": panel.id, "tier": panel.tier, "title": panel.title,
        "description": panel.description, "viz": panel.viz, "unit": panel.unit,
        "columns": list(panel.columns), "titles": [title_of(c) for c in panel.columns],
        "column_units": {c: panel.unit_of(c) for c in panel.columns},
        "series_by": list(panel.series_by),
        "thresholds": threshold_steps(panel.thresholds, panel.base_color),
        "threshold_lines": panel.threshold_lines,
        "threshold_columns": list(panel.threshold_columns), "colors": panel.colors,
        "color_columns": list(panel.color_columns), "dashed": list(panel.dashed),
        "width": panel.width, "height": panel.height, "decimals": panel.decimals,
        "needs_run": panel.needs_run, "links_run_id": panel.links_run_id,
        "section": panel.section, "sql": panel.sql,
    }


def tier_meta(tier: Tier) -> dict[str, Any]:
    refresh = {"": 0, "30s": 30, "5m": 300, "10s": 10, "1m": 60}.get(tier.refresh, 0)
    return {"id": tier.id, "uid": tier.uid, "title": tier.title,
            "description": tier.description, "time_from": tier.time_from,
            "refresh_s": refresh, "variables": list(tier.variables),
            "time_options": list(tier.time_options),
            "panels": [panel.id for panel in PANELS if panel.tier == tier.id]}


class WebApi:
    """Runs panel SQL through a loopwatch reader; one query at a time (chdb's rule)."""

    def __init__(self, reader: Reader,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 rates: Rates | None = None) -> None:
        self.reader = reader
        self.clock = clock
        # The server is built from a reader alone; the rates are read where they are
        # configured unless a caller (a test, say) passes its own.
        self.rates = rates or Rates.from_environment()
        self._lock = threading.Lock()

    # --- parameters --------------------------------------------------------------------

    def window(self, params: Mapping[str, Sequence[str]], default_from: str,
               min_interval: str = "") -> QueryWindow:
        now = self.clock()
        try:
            end = (datetime.fromtimestamp(int(params["to"][0]) / 1000, tz=UTC)
                   if params.get("to") else now)
            start = (datetime.fromtimestamp(int(params["from"][0]) / 1000, tz=UTC)
                     if params.get("from")
                     else end - timedelta(seconds=relative_seconds(default_from)))
            points = int(params["points"][0]) if params.get("points") else DEFAULT_POINTS
        except (ValueError, OverflowError, OSError) as exc:
            raise BadRequest("from, to and points must be integers (epoch milliseconds)") \
                from exc
        if not start < end or end - start > MAX_RANGE:
            raise BadRequest("need from < to, at most 400 days apart")
        minimum = relative_seconds(f"now-{min_interval}") if min_interval else 0
        interval = grafana_interval(start, end, min(max(points, 20), 2000), minimum)
        return QueryWindow(start, end, interval)

    @staticmethod
    def selected(params: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
        """Template-variable values from the query string: absent or empty means All."""
        chosen: dict[str, list[str]] = {}
        for name in VARIABLES:
            values = [value for value in params.get(name, []) if value != ""]
            for value in values:
                if len(value) > MAX_VALUE_LENGTH:
                    raise BadRequest(f"{name} values are at most {MAX_VALUE_LENGTH} characters")
            chosen[name] = values
        return chosen

    # --- queries -------------------------------------------------------------------------

    def _run(self, sql: str, window: QueryWindow, selected: Mapping[str, Sequence[str]]
             ) -> tuple[list[str], list[list[Any]], str]:
        expanded = expand(sql, window, selected)
        with self._lock:
            result = self.reader.query(expanded.sql, expanded.parameters)
        return result.columns, result.rows, expanded.sql

    def store_problem(self) -> str | None:
        """``/api/health``: None when the store answers, else why not (one line)."""
        with self._lock:
            return store_health(self.reader)

    def panel(self, panel_id: str, params: Mapping[str, Sequence[str]]) -> dict[str, Any]:
        panel = PANELS_BY_ID.get(panel_id)
        if panel is None:
            raise NotFound(f"no panel {panel_id!r}")
        selected = self.selected(params)
        if panel.needs_run and not selected["run_id"]:
            raise BadRequest(f"panel {panel_id} needs run_id")
        window = self.window(params, TIERS_BY_ID[panel.tier].time_from, panel.min_interval)
        columns, rows, _ = self._run(panel.sql, window, selected)
        body: dict[str, Any] = {"id": panel.id, "viz": panel.viz, "columns": columns,
                                "from": window.start.timestamp(), "to": window.end.timestamp(),
                                "interval_s": window.interval_s}
        if panel.is_time_series:
            body.update(pivot(panel, columns, rows, bucket_s(panel, window)))
        else:
            # Through a running `loopwatch up` times arrive as text without a zone; the
            # panel's units say which columns are times, so all become UTC ISO-8601.
            times = {i for i, c in enumerate(columns) if panel.unit_of(c) == "dateTimeAsIso"}
            body["rows"] = [[json_cell(as_datetime(cell) if i in times else cell)
                             for i, cell in enumerate(row)] for row in rows]
        return body

    def annotations(self, params: Mapping[str, Sequence[str]]) -> dict[str, Any]:
        window = self.window(params, "now-1h")
        columns, rows, _ = self._run(ANNOTATION.sql, window, self.selected(params))
        items = [dict(zip(columns, (json_cell(cell) for cell in row), strict=True))
                 for row in rows]
        for item, row in zip(items, rows, strict=True):
            item["time"] = _epoch(row[0])
        return {"name": ANNOTATION.name, "color": ANNOTATION.color, "annotations": items}

    def variables(self) -> dict[str, list[str]]:
        now = self.clock()
        window = QueryWindow(now - timedelta(days=30), now, 60)
        values = {}
        for name in FILTER_VARIABLES:
            sql = VARIABLES[name].sql
            assert sql is not None
            _, rows, _ = self._run(sql, window, {})
            values[name] = [str(row[0]) for row in rows]
        return values

    def run(self, run_id: str, params: Mapping[str, Sequence[str]]) -> dict[str, Any]:
        if not run_id or len(run_id) > MAX_VALUE_LENGTH:
            raise BadRequest("a run id is 1 to 256 characters")
        query = {**params, "run_id": [run_id]}
        panels = {panel.id: self.panel(panel.id, query) for panel in PANELS if panel.needs_run}
        if not panels["run_summary"]["rows"]:
            raise NotFound(f"no run {run_id!r} in the store")
        return {"run_id": run_id, "panels": panels}

    def replay(self, run_id: str) -> dict[str, Any]:
        """``/api/replay/<run_id>``: the run's recorded steps with their bodies, as
        ``loopwatch replay --json`` prints them, plus what the page shows around them."""
        if not run_id or len(run_id) > MAX_VALUE_LENGTH:
            raise BadRequest("a run id is 1 to 256 characters")
        try:
            with self._lock:
                recording = load_recording(self.reader, run_id)
        except RunNotFound as exc:
            raise NotFound(str(exc)) from None
        body = recording.to_json()
        for step, shown in zip(recording.steps, body["steps"], strict=True):
            shown.update(index=step.index, truncated=list(step.truncated),
                         missing=list(step.missing))
        body.update(agent=recording.agent, status=recording.status,
                    command=f"loopwatch replay {shlex.quote(run_id)}")
        return body

    def economics(self, params: Mapping[str, Sequence[str]]) -> dict[str, Any]:
        """``/api/economics?agent=&days=``: the agent's reproduction tax per failure mode
        against its capture cost per run (loopwatch.processors.replay.economics)."""
        agent = (params.get("agent") or [""])[0]
        if not agent or len(agent) > MAX_VALUE_LENGTH:
            raise BadRequest("economics needs agent (1 to 256 characters)")
        try:
            days = float((params.get("days") or ["7"])[0])
        except ValueError:
            raise BadRequest("days must be a number") from None
        if not 0 < days <= MAX_RANGE.days:
            raise BadRequest(f"days must be in (0, {MAX_RANGE.days}]")
        with self._lock:
            numbers = agent_economics(self.reader, agent, self.rates, timedelta(days=days),
                                      self.clock())
        return numbers.to_json()

    def advice(self, params: Mapping[str, Sequence[str]]) -> dict[str, Any]:
        """``/api/advice?agent=``: ``loopwatch advise --json`` for the Advice page
        (detectors/advisors), over the configured window ending at the newest event."""
        from loopwatch.core.config import load_settings
        from loopwatch.detectors.advisors.run import advise_now

        agent = (params.get("agent") or [""])[0]
        if len(agent) > MAX_VALUE_LENGTH:
            raise BadRequest(f"agent is at most {MAX_VALUE_LENGTH} characters")
        settings = load_settings()
        with self._lock:
            findings = advise_now(self.reader, settings.advise, agent,
                                  timedelta(seconds=settings.max_clock_skew_s))
        return {"findings": [finding.model_dump(mode="json") for finding in findings]}

    def alerts(self, params: Mapping[str, Sequence[str]]) -> dict[str, Any]:
        """Firing alerts (the firing-alerts panel's SQL) with their playbooks attached."""
        table = self.panel("firing_alerts", params)
        books = playbooks()
        alerts = []
        for row in table["rows"]:
            record = dict(zip(table["columns"], row, strict=True))
            record["playbook_detail"] = books.get(str(record.get("playbook") or ""))
            alerts.append(record)
        return {"alerts": alerts}


def playbooks() -> dict[str, dict[str, Any]]:
    """Shipped playbooks by name, reduced to what an on-call engineer reads first."""
    try:
        from loopwatch.detectors.playbooks import load_playbooks

        books = load_playbooks()
    except Exception:  # a broken playbook file must not take the page down
        return {}
    return {name: {"title": book.title, "severity": book.severity, "summary": book.summary,
                   "steps": [{"title": step.title, "why": step.why, "sql": step.sql,
                              "action": step.action} for step in book.steps],
                   "mitigation": list(book.mitigation)}
            for name, book in books.items()}


def catalog() -> dict[str, Any]:
    """``/api/panels``: tiers, panels, variables and the annotation source."""
    return {"tiers": [tier_meta(tier) for tier in TIERS],
            "panels": [panel_meta(panel) for panel in PANELS],
            "variables": [{"name": v.name, "label": v.label, "free_text": v.sql is None}
                          for v in VARIABLES.values()],
            "annotation": {"name": ANNOTATION.name, "color": ANNOTATION.color}}


__all__ = ["BadRequest", "NotFound", "QueryError", "WebApi", "catalog"]
