"""Grafana dashboard models, built with grafana-foundation-sdk from the panel table.

The SDK (Grafana's own dashboards-as-code library) has builders for dashboards, panels
and variables but no ClickHouse query type, so :class:`ClickHouseQuery` adds one: the
plugin's SQL-editor query model (``editorType: sql``, ``rawSql``, ``format``).
Annotations get the same query shape through :class:`ClickHouseAnnotationTarget`.

Every panel and target points at the ``${datasource}`` variable (any ClickHouse data
source; provisioning preselects loopwatch's), uids are fixed per tier, and panel ids
are positions in the tier, so regenerating the files changes nothing unless a panel
definition did.

>>> model = dashboard_model("realtime")
>>> model["uid"], model["refresh"], len([p for p in model["panels"] if p["type"] != "row"])
('loopwatch-realtime', '30s', 17)
>>> model["panels"][1]["targets"][0]["datasource"]
{'type': 'grafana-clickhouse-datasource', 'uid': '${datasource}'}
"""

from __future__ import annotations

import json
import re
from typing import Any, Final
from urllib.parse import urlparse

from grafana_foundation_sdk.builders import barchart, stat, table, timeseries
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as builders
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as models

from loopwatch.dashboards.model import Panel, Threshold, TierId
from loopwatch.dashboards.panels import ANNOTATION, TIERS_BY_ID, VARIABLES, panels_of, title_of

PLUGIN_ID: Final = "grafana-clickhouse-datasource"
DATASOURCE_UID: Final = "loopwatch-clickhouse"
DATASOURCE_NAME: Final = "loopwatch ClickHouse"
DATASOURCE_REF: Final = models.DataSourceRef(type_val=PLUGIN_ID, uid="${datasource}")
RUN_DRILLDOWN_URL: Final = (
    "/d/" + TIERS_BY_ID["drilldown"].uid + "?var-run_id=${__value.raw}&${__url_time_range}")
#: The loopwatch web view holding each run's replay: a hidden dashboard variable whose
#: default is set when the dashboards are exported or deployed (``--web-url``, else
#: ``LOOPWATCH_LINK_BASE_URL``, the same base URL alert links use; without either,
#: ``loopwatch serve``'s local address). ``var-loopwatch_web=`` in a URL overrides it.
WEB_VIEW_VARIABLE: Final = "loopwatch_web"
WEB_VIEW_DEFAULT: Final = "http://127.0.0.1:8765"
#: The classic dashboard JSON schema the models follow: Grafana's latest (v42, the last
#: of the v1 dashboard API). The SDK still writes 36 and the ``style`` key Grafana
#: dropped; :func:`dashboard_model` brings the model to this version's shape.
SCHEMA_VERSION: Final = 42
RUN_REPLAY_URL: Final = "${" + WEB_VIEW_VARIABLE + "}/#/replay/${__value.raw}"
NAMED_COLORS: Final = {"text": "text", "green": "green", "red": "red", "orange": "orange",
                       "blue": "blue", "yellow": "yellow"}


def _ref_json() -> dict[str, object]:
    return {"type": PLUGIN_ID, "uid": "${datasource}"}


class ClickHouseQuery(cogvariants.Dataquery):
    """The ClickHouse plugin's SQL-editor query (the model its query editor saves)."""

    def __init__(self, ref_id: str = "A", raw_sql: str = "", format_: int = 1) -> None:
        self.ref_id = ref_id
        self.raw_sql = raw_sql
        self.format = format_

    def to_json(self) -> dict[str, object]:
        return {
            "refId": self.ref_id,
            "datasource": _ref_json(),
            "editorType": "sql",
            "queryType": "timeseries" if self.format == 0 else "table",
            "format": self.format,
            "rawSql": self.raw_sql,
        }


class ClickHouseQueryBuilder(cogbuilder.Builder[cogvariants.Dataquery]):
    """Builder for :class:`ClickHouseQuery`, to pass to any SDK panel's ``with_target``."""

    def __init__(self, ref_id: str = "A") -> None:
        self._internal = ClickHouseQuery(ref_id)

    def build(self) -> ClickHouseQuery:
        return self._internal

    def raw_sql(self, sql: str) -> ClickHouseQueryBuilder:
        self._internal.raw_sql = sql
        return self

    def format(self, format_: int) -> ClickHouseQueryBuilder:
        self._internal.format = format_
        return self


class ClickHouseAnnotationTarget(models.AnnotationTarget):
    """An annotation's target as the plugin expects it: a SQL query, not Grafana tags."""

    def __init__(self, raw_sql: str) -> None:
        super().__init__()
        self.raw_sql = raw_sql

    def to_json(self) -> dict[str, object]:
        return {"refId": "annotation", "datasource": _ref_json(), "editorType": "sql",
                "format": 1, "rawSql": self.raw_sql}


class ClickHouseAnnotationTargetBuilder(cogbuilder.Builder[models.AnnotationTarget]):
    def __init__(self, raw_sql: str) -> None:
        self._internal = ClickHouseAnnotationTarget(raw_sql)

    def build(self) -> models.AnnotationTarget:
        return self._internal


def _thresholds(panel: Panel) -> builders.ThresholdsConfig:
    steps = [models.Threshold(value=None, color=_color(panel.base_color))]
    steps += [models.Threshold(value=t.value, color=_color(t.color)) for t in panel.thresholds]
    return builders.ThresholdsConfig().mode(models.ThresholdsMode.ABSOLUTE).steps(steps)


def _color(name: str) -> str:
    return NAMED_COLORS.get(name, name)


def _fixed(color: str) -> models.DynamicConfigValue:
    return models.DynamicConfigValue(id_val="color", value={"mode": "fixed",
                                                            "fixedColor": _color(color)})


def _display(name: str) -> models.DynamicConfigValue:
    return models.DynamicConfigValue(id_val="displayName", value=name)


def _series_name(panel: Panel, column: str) -> str:
    """Grafana display name of a series, the same rule as the web view's."""
    labels = " · ".join(f"${{__field.labels.{label}}}" for label in panel.series_by)
    if not labels:
        return title_of(column)
    return labels if len(panel.value_columns) == 1 else f"{title_of(column)} · {labels}"


def _time_series(panel: Panel) -> timeseries.Panel:
    built = (timeseries.Panel()
             .legend(common_builders.VizLegendOptions()
                     .display_mode(common.LegendDisplayMode.LIST)
                     .placement(common.LegendPlacement.BOTTOM).show_legend(True))
             .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                      .sort(common.SortOrder.DESCENDING))
             .thresholds(_thresholds(panel))
             .thresholds_style(common_builders.GraphThresholdsStyleConfig().mode(
                 common.GraphTresholdsStyleMode.DASHED if panel.threshold_lines
                 else common.GraphTresholdsStyleMode.OFF))
             .span_nulls(False).axis_soft_min(0))
    if panel.viz == "bars":
        built = (built.draw_style(common.GraphDrawStyle.BARS).fill_opacity(85).line_width(1)
                 .stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL)))
    else:
        built = built.draw_style(common.GraphDrawStyle.LINE).line_width(2).fill_opacity(8)
    for column in panel.value_columns:
        built = built.override_by_name(column, [_display(_series_name(panel, column))])
        if not panel.series_by and column in panel.colors:
            built = built.override_by_name(column, [_fixed(panel.colors[column])])
        if column in panel.dashed:
            built = built.override_by_name(column, [models.DynamicConfigValue(
                id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]})])
    if panel.series_by:
        for value, color in panel.colors.items():
            built = built.override_by_regexp(rf".*\b{re.escape(value)}\b.*", [_fixed(color)])
    return built


def _table(panel: Panel) -> table.Panel:
    built = table.Panel().show_header(True).cell_height(common.TableCellHeight.SM)
    for column, unit in panel.column_units.items():
        built = built.override_by_name(column, [models.DynamicConfigValue("unit", unit)])
    for column in panel.color_columns:
        mapping = models.ValueMap(options={
            value: models.ValueMappingResult(color=color, index=index)
            for index, (value, color) in enumerate(panel.colors.items())})
        built = built.override_by_name(column, [
            models.DynamicConfigValue("mappings", [mapping]),
            models.DynamicConfigValue("custom.cellOptions", {"type": "color-text"})])
    for column in panel.threshold_columns:
        built = built.override_by_name(column, [
            models.DynamicConfigValue("thresholds", _thresholds(panel).build()),
            models.DynamicConfigValue("custom.cellOptions", {"type": "color-text"})])
    if panel.links_run_id:
        built = built.override_by_name("run_id", [models.DynamicConfigValue("links", [
            {"title": "Open the run drill-down", "url": RUN_DRILLDOWN_URL},
            {"title": "Replay this run (prompts, responses, tool I/O)", "url": RUN_REPLAY_URL,
             "targetBlank": True}])])
    return built


def _stat(panel: Panel) -> stat.Panel:
    built = (stat.Panel()
             .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"])
                             .fields("").values(False))
             .color_mode(common.BigValueColorMode.VALUE)
             .graph_mode(common.BigValueGraphMode.NONE)
             .text_mode(common.BigValueTextMode.VALUE_AND_NAME)
             .justify_mode(common.BigValueJustifyMode.AUTO)
             .thresholds(_thresholds(panel)))
    for column in panel.value_columns:
        built = built.override_by_name(column, [_display(title_of(column))])
    for column, unit in panel.column_units.items():
        built = built.override_by_name(column, [models.DynamicConfigValue("unit", unit)])
    return built


def _barchart(panel: Panel) -> barchart.Panel:
    built = (barchart.Panel().x_field(panel.columns[0])
             .orientation(common.VizOrientation.VERTICAL)
             .show_value(common.VisibilityMode.NEVER).fill_opacity(85)
             .legend(common_builders.VizLegendOptions().show_legend(False)
                     .display_mode(common.LegendDisplayMode.LIST)
                     .placement(common.LegendPlacement.BOTTOM))
             .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.SINGLE)
                      .sort(common.SortOrder.NONE)))
    for column in panel.value_columns:
        if column == panel.columns[0]:
            continue
        built = built.override_by_name(column, [_display(title_of(column))])
        if column in panel.colors:
            built = built.override_by_name(column, [_fixed(panel.colors[column])])
    return built


PanelBuilder = timeseries.Panel | table.Panel | stat.Panel | barchart.Panel


def panel_builder(panel: Panel, panel_id: int) -> PanelBuilder:
    """An SDK builder for one panel: its visualisation, SQL target, unit and thresholds."""
    built: PanelBuilder
    if panel.viz in ("timeseries", "bars"):
        built = _time_series(panel)
    elif panel.viz == "table":
        built = _table(panel)
    elif panel.viz == "stat":
        built = _stat(panel)
    else:
        built = _barchart(panel)
    built = (built.id(panel_id).title(panel.title).description(panel.description)
             .datasource(DATASOURCE_REF).span(panel.width).height(panel.height)
             .unit(panel.unit)
             .with_target(ClickHouseQueryBuilder().raw_sql(panel.sql).format(panel.format)))
    if panel.decimals is not None:
        built = built.decimals(panel.decimals)
    if panel.min_interval:
        built = built.interval(panel.min_interval)
    if panel.viz != "table" and panel.viz != "stat":
        built = built.max_data_points(240)
    return built


def web_view_url(url: str | None) -> str:
    """The web view's base URL for the dashboards' run links: http(s) with a host,
    no trailing slash; ``ValueError`` saying why otherwise.

    >>> web_view_url("https://loopwatch.example.com/"), web_view_url(None)
    ('https://loopwatch.example.com', 'http://127.0.0.1:8765')
    """
    if not url:
        return WEB_VIEW_DEFAULT
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.query \
            or parsed.fragment or any(c in url for c in "\"'<> \t\r\n"):
        raise ValueError(f"the web view URL must be http(s)://host[:port][/path], not {url!r}")
    return url.rstrip("/")


def _variables(tier: TierId, web_url: str) -> list[cogbuilder.Builder[models.VariableModel]]:
    found: list[cogbuilder.Builder[models.VariableModel]] = [
        builders.DatasourceVariable("datasource").label("Data source").type(PLUGIN_ID)
        .current(models.VariableOption(selected=True, text=DATASOURCE_NAME,
                                       value=DATASOURCE_UID))]
    for name in TIERS_BY_ID[tier].variables:
        variable = VARIABLES[name]
        if variable.sql is None:
            found.append(builders.TextBoxVariable(name).label(variable.label)
                         .description(variable.description).default_value("")
                         .current(models.VariableOption(text="", value="")))
            continue
        found.append(
            builders.QueryVariable(name).label(variable.label).query(variable.sql)
            .datasource(DATASOURCE_REF).multi(True).include_all(True)
            .refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(models.VariableSort.ALPHABETICAL_ASC)
            .current(models.VariableOption(selected=True, text=["All"], value=["$__all"])))
    found.append(builders.TextBoxVariable(WEB_VIEW_VARIABLE).label("loopwatch web view")
                 .description("base URL of the loopwatch web view, where runs replay")
                 .default_value(web_url).hide(models.VariableHide.HIDE_VARIABLE)
                 .current(models.VariableOption(text=web_url, value=web_url)))
    return found


def dashboard_builder(tier: TierId, web_url: str = WEB_VIEW_DEFAULT) -> builders.Dashboard:
    """The SDK dashboard for one tier, panels grouped in rows by section."""
    spec = TIERS_BY_ID[tier]
    board = (builders.Dashboard(spec.title).uid(spec.uid).description(spec.description)
             .tags(["loopwatch", tier]).editable().timezone("browser")
             .time(spec.time_from, "now").refresh(spec.refresh or False)
             .tooltip(models.DashboardCursorSync.CROSSHAIR)
             .timepicker(builders.TimePicker().refresh_intervals(
                 ["10s", "30s", "1m", "5m", "15m"]))
             .link(builders.DashboardLink("loopwatch").type(models.DashboardLinkType.DASHBOARDS)
                   .tags(["loopwatch"]).as_dropdown(False).include_vars(True).keep_time(True))
             .variables(_variables(tier, web_view_url(web_url)))
             .annotation(builders.AnnotationQuery().name(ANNOTATION.name)
                         .datasource(DATASOURCE_REF).enable(True).icon_color(ANNOTATION.color)
                         .target(ClickHouseAnnotationTargetBuilder(ANNOTATION.sql))))
    if "run_id" in spec.variables:
        board = board.link(
            builders.DashboardLink("Replay this run").type(models.DashboardLinkType.LINK)
            .url("${" + WEB_VIEW_VARIABLE + "}/#/replay/${run_id}").icon("external link")
            .tooltip("its prompts, responses and tool inputs and outputs, step by step")
            .target_blank(True))
    next_id = 1
    section = None
    for panel in panels_of(tier):
        if panel.section != section:
            section = panel.section
            board = board.with_row(builders.Row(section).id(next_id))
            next_id += 1
        board = board.with_panel(panel_builder(panel, next_id))
        next_id += 1
    return board


def dashboard_model(tier: TierId, web_url: str | None = None) -> dict[str, Any]:
    """The dashboard JSON model of one tier, as a plain dict, in the shape of
    :data:`SCHEMA_VERSION`: no ``style`` (gone from the schema), no timepicker
    ``time_options`` (v41), ``refresh`` a string, empty when off (v40)."""
    encoded = json.dumps(dashboard_builder(tier, web_view_url(web_url)).build(),
                         cls=JSONEncoder)
    model: dict[str, Any] = json.loads(encoded)
    model.pop("style", None)
    model.get("timepicker", {}).pop("time_options", None)
    if model.get("refresh") is False:
        model["refresh"] = ""
    model["schemaVersion"] = SCHEMA_VERSION
    return model


def render(model: dict[str, Any]) -> str:
    """The model as the exported file's text (stable: regenerating gives the same bytes)."""
    return json.dumps(model, indent=2, ensure_ascii=False) + "\n"


def threshold_steps(thresholds: tuple[Threshold, ...], base: str) -> list[dict[str, Any]]:
    """Thresholds as Grafana steps (base colour from -Infinity), for the web view too."""
    return [{"value": None, "color": base},
            *({"value": t.value, "color": t.color} for t in thresholds)]
