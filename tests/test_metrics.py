"""Every derived metric has one definition (``loopwatch/core/metrics.toml``): on a scripted
input, the report's value (Python), the per-minute view's column, the panels'
re-aggregation over the view, the base-table series and the alert rule's series are the
same number, exactly. The views the migrations create are the rendered definitions.

Events go through the real engine-free pipeline into the in-process chdb store, under
agent names of their own, so the shared store's other data is ignored.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from loopwatch.core.metrics import METRICS, VIEWS, MetricsError, expand, load, views_sql
from loopwatch.detectors.engine import Policy
from loopwatch.detectors.rules import EXCLUDED_SLICES, load_rules
from loopwatch.ingest.events import LlmCall, ToolCall
from loopwatch.report import fleet_report
from loopwatch.store.clickhouse import run_query
from loopwatch.store.schema_versions import migrations, statements
from tests.test_rules import Fleet

NOW = datetime(2026, 11, 21, 11, 0, tzinfo=UTC)
AT = NOW - timedelta(minutes=2)            # every scripted row: the minute 10:58
BEFORE = NOW - timedelta(hours=1)          # the cache rule's baseline: the minute 09:58
MINUTE = AT.replace(second=0)

#: metric -> its exact value in the minute AT on the scripted input (see `scripted`)
EXPECTED: dict[str, float] = {
    "silent_failure_ratio": 4 / 9, "exception_rate": 1 / 9,
    "cost_per_successful_run": 18.0 / 3, "cost_per_run": 18.0 / 9,
    "tool_timeout_rate": 4 / 16, "near_miss_ratio": 2 / 3, "tool_error_rate": 5 / 16,
    "cache_hit_rate": 27_000 / 63_000, "cache_write_share": 16_000 / 63_000,
    "llm_error_rate": 2 / 11, "llm_rate_429": 2 / 11,
    "loop_rate": 1 / 9, "abandoned_rate": 1 / 9, "tool_rate_429": 1 / 16,
    "tool_retry_amplification": (4 + 2) / 2, "tool_attempts_per_operation": 16 / 12,
}
#: metric -> the rules whose `value` is that metric on their window
RULES: dict[str, tuple[str, ...]] = {
    "silent_failure_ratio": ("silent_failure_jump",),
    "tool_error_rate": ("tool_error_rate", "tool_error_rate_warning"),
    "near_miss_ratio": ("near_miss_high",),
    "cache_hit_rate": ("cache_hit_collapse",),
    "llm_error_rate": ("llm_error_rate_critical", "llm_error_rate_warning"),
    "llm_rate_429": ("rate_limit_storm",),
    "loop_rate": ("loop_rate_critical", "loop_rate_warning"),
    "abandoned_rate": ("abandoned_runs",),
    "tool_rate_429": ("tool_rate_limit_storm",),
    "tool_retry_amplification": ("retry_amplification_high",),
}
#: the report's key for a metric, where the report shows it
REPORT_KEYS = {"silent_failure_ratio": "silent_failure_ratio", "exception_rate":
               "exception_rate", "cost_per_successful_run": "cost_per_successful_run",
               "near_miss_ratio": "near_miss_timeout_ratio", "cache_hit_rate": "cache_hit_rate"}


class _Reader:
    def __init__(self, client: Any) -> None:
        self.client = client

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> Any:
        return run_query(self.client, sql, parameters or {}, readonly=True)


@pytest.fixture(scope="module")
def scripted(local_store: Any) -> dict[str, str]:
    """Runs, tool calls and LLM calls with known ratios, one agent per table.

    Runs: 3 successes at $3, one hard_error, 2 gave_up, one budget_exhausted, one looped
    and one abandoned at $1.50: 9 closed, 4 silent. Tool calls: 10, of which 4 timeouts
    (2 near misses, one beyond, one of unknown duration), one error, one 429 (no error),
    4 first attempts that succeeded, and two operations retried: attempts 1-4 and 1-2
    (16 calls, 12 operations; 2 retried, using 6 attempts).
    LLM calls: 11, of which 2 errors and 2 429s; cache read 27k, written 16k, uncached
    20k tokens, one call reporting more cache reads than input tokens (the view's
    denominator counts them; the cache rule counted input_tokens); 4 baseline calls an
    hour before at a 0.9 hit rate."""
    tag = uuid.uuid4().hex[:8]
    agents = {"runs": f"m-runs-{tag}", "tools": f"m-tools-{tag}", "llm": f"m-llm-{tag}"}
    fleet = Fleet(local_store)
    ends = ["model_done"] * 3 + ["crash", "cannot_complete", "cannot_complete", "budget",
                                 "loop_detector", "cancelled"]
    for end in ends:
        fleet.run(agents["runs"], AT, end=end,
                  input_tokens=1_000_000 if end == "model_done" else 500_000)
    tool = {"run_id": f"t-{tag}", "agent": agents["tools"], "tool": "search", "ts": AT}
    for index, late in enumerate((1100, 1200, 4000, None)):
        fleet.add(ToolCall(**tool, args_hash=f"timeout{index}", timed_out=True,
                           timeout_ms=1000, latency_ms=1000, late_completion_ms=late))
    fleet.add(ToolCall(**tool, args_hash="error", error_type="boom", http_status=500))
    fleet.add(ToolCall(**tool, args_hash="429", error_type="rate_limited", http_status=429))
    for index in range(4):
        fleet.add(ToolCall(**tool, args_hash=f"ok{index}", latency_ms=20))
    for op, attempts in (("retried-a", 4), ("retried-b", 2)):
        for attempt in range(1, attempts + 1):
            fleet.add(ToolCall(**tool, args_hash=op, attempt=attempt, latency_ms=20))
    llm = {"run_id": f"l-{tag}", "agent": agents["llm"]}
    for _ in range(4):
        fleet.add(LlmCall(**llm, ts=AT, input_tokens=10_000, cache_read_input_tokens=6000))
        fleet.add(LlmCall(**llm, ts=BEFORE, input_tokens=10_000, cache_read_input_tokens=9000))
    for _ in range(2):
        fleet.add(LlmCall(**llm, ts=AT, input_tokens=10_000, cache_creation_input_tokens=8000))
        fleet.add(LlmCall(**llm, ts=AT, error_type="server_error", http_status=500))
        fleet.add(LlmCall(**llm, ts=AT, error_type="rate_limited", http_status=429))
    fleet.add(LlmCall(**llm, ts=AT, input_tokens=1000, cache_read_input_tokens=3000))
    fleet.flush()
    return agents


def _agent(scripted: dict[str, str], metric: str) -> str:
    table = METRICS[metric].table
    return scripted["runs" if table == "runs" else "tools" if table == "tool_calls" else "llm"]


def _one(client: Any, sql: str, **parameters: Any) -> Any:
    rows = run_query(client, sql, parameters, readonly=True).rows
    assert len(rows) == 1, (sql, rows)
    return rows[0][0]


def rule_row(client: Any, name: str, agent: str) -> dict[str, Any]:
    """The rule's query at NOW with the parameters the engine gives it, for ``agent``."""
    rule = load_rules()[name]
    parameters = {"now": NOW, "start": NOW - rule.window,
                  "baseline_start": NOW - max(rule.baseline, rule.window), "wall_now": NOW,
                  EXCLUDED_SLICES: list(Policy().excluded_slices)}
    rows = [row for row in run_query(client, rule.sql, parameters, readonly=True).records()
            if row.get("agent") == agent]
    assert len(rows) == 1, (name, rows)
    return rows[0]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_reader_of_a_metric_gets_the_same_number(name, scripted, local_store):
    _, client = local_store
    metric, agent = METRICS[name], _agent(scripted, name)
    view = VIEWS[metric.view]
    in_minute = "agent = {a:String} AND minute = {m:DateTime64(3, 'UTC')}"
    where = f" AND {view.where}" if view.where else ""
    time = view.time or VIEWS[view.rollup_of].time
    base = _one(client, f"SELECT {metric.ratio()} FROM {metric.table} FINAL WHERE "
                f"agent = {{a:String}} AND toStartOfMinute({time}) = "
                f"{{m:DateTime64(3, 'UTC')}}{where}", a=agent, m=MINUTE)
    assert base == EXPECTED[name], name
    if metric.in_view:  # else the view does not carry it (yet): rules read the base table
        over_view = _one(client, f"SELECT {metric.over_view()} FROM {view.name} "
                         f"WHERE {in_minute}", a=agent, m=MINUTE)
        sums = run_query(client, f"SELECT sum({metric.numerator}), "
                         f"sum({' + '.join(metric.denominator)}) FROM {view.name} "
                         f"WHERE {in_minute}", {"a": agent, "m": MINUTE},
                         readonly=True).rows[0]
        assert over_view == metric.value(*sums) == EXPECTED[name], name
    column = [c.name for c in view.columns if c.kind == "metric" and c.expr == name]
    if column:  # the view's own column, in the one row the agent has that minute
        assert _one(client, f"SELECT {column[0]} FROM {view.name} WHERE {in_minute}",
                    a=agent, m=MINUTE) == EXPECTED[name]
    for rule in RULES.get(name, ()):
        assert rule_row(client, rule, agent)["value"] == EXPECTED[name], rule


#: (panel, column, metric): every panel that draws a derived metric
PANEL_SERIES = [
    ("silent_failure_ratio_now", "silent_failure_ratio", "silent_failure_ratio"),
    ("silent_vs_exception", "silent_failure_ratio", "silent_failure_ratio"),
    ("silent_vs_exception", "exception_rate", "exception_rate"),
    ("silent_failure_trend", "silent_failure_ratio", "silent_failure_ratio"),
    ("silent_failure_trend", "exception_rate", "exception_rate"),
    ("outcome_by_model_prompt", "silent_failure_ratio", "silent_failure_ratio"),
    ("outcome_by_model_prompt", "exception_rate", "exception_rate"),
    ("cost_per_success", "cost_per_successful_run", "cost_per_successful_run"),
    ("cost_per_success", "cost_per_run", "cost_per_run"),
    ("cache_hit_rate", "cache_hit_rate", "cache_hit_rate"),
    ("cache_by_prompt_deploy", "cache_hit_rate", "cache_hit_rate"),
    ("llm_errors_by_provider", "error_rate_excl_429", "llm_error_rate"),
    ("llm_errors_by_provider", "rate_429", "llm_rate_429"),
    ("tool_error_rate", "error_rate", "tool_error_rate"),
    ("near_miss_ratio", "near_miss_ratio", "near_miss_ratio"),
    ("tool_health", "error_rate", "tool_error_rate"),
    ("tool_health", "timeout_rate", "tool_timeout_rate"),
    ("tool_health", "near_miss_ratio", "near_miss_ratio"),
    ("retry_amplification", "retry_amplification", "tool_retry_amplification"),
]


def test_every_metric_has_a_scripted_value():
    """A new metric in metrics.toml needs its exact value on the scripted input here;
    cost per outcome is one value per outcome (its own test below)."""
    assert set(METRICS) - set(EXPECTED) == {"cost_per_outcome"}


def _panel(client: Any, panel_id: str, agent: str) -> list[dict[str, Any]]:
    """The panel's SQL as the web view runs it (Grafana's macros), over 10:50 - 11:00."""
    from loopwatch.dashboards.macros import QueryWindow
    from loopwatch.dashboards.macros import expand as expand_macros
    from loopwatch.dashboards.panels import PANELS_BY_ID

    window = QueryWindow(NOW - timedelta(minutes=10), NOW, 60)
    expanded = expand_macros(PANELS_BY_ID[panel_id].sql, window, {"agent": [agent]})
    return run_query(client, expanded.sql, expanded.parameters, readonly=True).records()


@pytest.mark.parametrize("panel_id, column, name", PANEL_SERIES,
                         ids=[f"{p}.{c}" for p, c, _ in PANEL_SERIES])
def test_every_panel_draws_the_number_its_rule_pages_on(panel_id, column, name, scripted,
                                                         local_store):
    _, client = local_store
    rows = _panel(client, panel_id, _agent(scripted, name))
    assert [row[column] for row in rows] == [EXPECTED[name]], (panel_id, rows)


def test_the_cost_per_outcome_panel_is_the_reports(scripted, local_store):
    _, client = local_store
    rows = _panel(client, "cost_per_outcome", scripted["runs"])
    assert {row["outcome"]: row["mean_cost_usd"] for row in rows} == {
        "success": 3.0, "hard_error": 1.5, "budget_exhausted": 1.5, "gave_up": 1.5,
        "looped": 1.5, "abandoned": 1.5}


def test_the_report_reads_the_same_definitions(scripted, local_store):
    """The CLI report (and the demo's numbers) divide the same sums in Python; the LLM
    agent's report spans its baseline hour too."""
    _, client = local_store
    report = fleet_report(_Reader(client))["agents"]
    for name, key in REPORT_KEYS.items():
        if name != "cache_hit_rate":
            assert report[_agent(scripted, name)][key] == EXPECTED[name], name
    assert report[scripted["llm"]]["cache_hit_rate"] == (27_000 + 36_000) / (63_000 + 40_000)
    per_outcome = report[scripted["runs"]]["cost_per_outcome"]
    assert per_outcome == {"success": 3.0, "hard_error": 1.5, "budget_exhausted": 1.5,
                           "gave_up": 1.5, "looped": 1.5, "wrong": None, "abandoned": 1.5}


def test_the_cache_rules_baseline_is_the_views_hit_rate_an_hour_before(scripted, local_store):
    _, client = local_store
    agent = scripted["llm"]
    row = rule_row(client, "cache_hit_collapse", agent)
    before = _one(client, "SELECT cache_hit_rate FROM cache_metrics_1m WHERE agent = {a:String}"
                  " AND minute = {m:DateTime64(3, 'UTC')}", a=agent, m=BEFORE.replace(second=0))
    assert row["baseline"] == before == 0.9
    assert (row["value"], row["samples"]) == (27_000 / 63_000, 11)


def test_the_silent_failure_rule_counts_what_the_view_counts(scripted, local_store):
    _, client = local_store
    row = rule_row(client, "silent_failure_jump", scripted["runs"])
    assert (row["k"], row["samples"], row["value"]) == (4, 9, 4 / 9)


# --- the views are the rendered definitions ---------------------------------------------


def _latest_views() -> dict[str, str]:
    """Each view's last CREATE OR REPLACE VIEW across the migrations, in order."""
    latest = {}
    for _, sql in migrations():
        for statement in statements(sql):
            words = statement.split()
            if words[:4] == ["CREATE", "OR", "REPLACE", "VIEW"]:
                latest[words[4]] = statement
    return latest


def _formatted(client: Any, sql: str) -> str:
    """ClickHouse's own canonical text of a statement (its parser, not ours)."""
    return str(_one(client, "SELECT formatQuery({q:String})", q=sql))


def differing_views(client: Any, views: dict[str, Any]) -> list[str]:
    latest = _latest_views()
    return [name for name, view in views.items()
            if name not in latest or _formatted(client, latest[name]) != _formatted(client,
                                                                                   view.sql())]


def test_the_views_the_migrations_create_are_the_rendered_definitions(local_store):
    """If this fails, a definition in metrics.toml changed: add the next migration with
    `python -m loopwatch.core.metrics views > store/migrations/NNN_metric_views.sql`."""
    _, client = local_store
    assert set(VIEWS) == {"outcomes_1m", "run_metrics_1m", "tool_metrics_1m",
                          "cache_metrics_1m"}
    assert differing_views(client, VIEWS) == []


def test_a_changed_definition_is_caught_until_a_migration_renders_it(local_store):
    """The check above can fail: one outcome more in the silent set changes one view."""
    _, client = local_store
    text = SHIPPED
    changed = text.replace('"looped", "wrong"]', '"looped", "wrong", "abandoned"]')
    assert changed != text
    _, views, _ = load(changed)
    assert differing_views(client, views) == ["run_metrics_1m"]


SHIPPED = resources.files("loopwatch.core").joinpath("metrics.toml").read_text(encoding="utf-8")


@pytest.mark.parametrize("change, message", [
    (('denominator = "closed_runs"', 'denominator = "closed_runz"'),
     "has no measure 'closed_runz'"),
    (('numerator = "hard_errors"', 'numerator = "silent_failure_ratio"'), "is not a measure"),
    (('view = "outcomes_1m"', 'view = "nowhere_1m"'), "no view 'nowhere_1m'"),
    (('{ name = "calls", count = true },', '{ name = "calls", count = true, sum = "x" },'),
     "exactly one of"),
    (('sql = "quantileTDigest(0.5)(latency_ms)" }', 'sql = "q", in_view = false }'),
     "only a measure can be in_view = false"),
    (('{ name = "errors", sum = "is_error" },\n    { name = "timeout_rate"',
      '{ name = "errors", sum = "is_error", in_view = false },\n    { name = "timeout_rate"'),
     "divides a measure the view does not carry"),
    (('unit = "percentunit"', 'units = "percentunit"'), "missing a field or has one"),
    (('[sets]', '[sets'), "not valid TOML"),
])
def test_a_malformed_definition_is_refused_in_one_line(change, message):
    changed = SHIPPED.replace(*change, 1)
    assert changed != SHIPPED, change
    with pytest.raises(MetricsError) as caught:
        load(changed)
    assert message in str(caught.value), str(caught.value)


def test_the_views_migration_renders_every_view():
    rendered = views_sql()
    assert rendered.startswith("-- Rendered by `python -m loopwatch.core.metrics views`")
    assert [s.split()[4] for s in statements(rendered)] == list(VIEWS)


# --- templates ------------------------------------------------------------------------


@pytest.mark.parametrize("template, message", [
    ("SELECT {{ ratio no_such_metric }}", "no metric 'no_such_metric'"),
    ("SELECT {{ divide cache_hit_rate }}", "unknown template function 'divide'"),
    ("SELECT {{ set no_such_set }}", "no set 'no_such_set'"),
    ("SELECT {{ ratio cache_hit_rate}}", "not closed by ' }}'"),
    ("SELECT {{ ratio0 cache_hit_rate | ts > {start:DateTime64(3, 'UTC')}}}", "not closed"),
    ("SELECT {{ view_ratio cache_hit_rate | ts > 0 }}", "unknown template function"),
    ("SELECT {{ view_ratio loop_rate }}", "does not carry its measures"),
])
def test_a_bad_template_is_refused_in_one_line(template, message):
    with pytest.raises(MetricsError) as caught:
        expand(template)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_rule_with_a_bad_template_names_the_rule():
    text = """
[[rules]]
name = "bad_metric"
description = "d"
severity = "warning"
playbook = "p"
labels = ["agent"]
op = ">"
threshold = 1
window = "5m"
summary = "s"
sql = '''
SELECT agent, {{ ratio0 nope }} AS value FROM llm_calls
WHERE traffic_slice NOT IN {excluded_slices:Array(String)} GROUP BY agent'''
"""
    with pytest.raises(ValueError, match=r"rule bad_metric: .*no metric 'nope'"):
        load_rules(text)


def test_no_shipped_rule_or_playbook_re_derives_a_metric():
    """The silent set and the cache hit rate's denominator are written only in
    metrics.toml: rules and playbooks name the metric instead."""
    from loopwatch.detectors.playbooks import load_playbooks

    texts = [rule.sql for rule in load_rules().values()]
    texts += [step.sql for book in load_playbooks().values() for step in book.sql_steps
              if step.sql]
    rendered_silent = "('budget_exhausted', 'gave_up', 'looped', 'wrong')"
    raw = [(path.name, path.read_text(encoding="utf-8")) for path in _data_files()]
    for name, text in raw:
        assert rendered_silent not in text, name
        assert "greatest(1, sumIf(input_tokens" not in text, name
    assert any(rendered_silent in text for text in texts)  # rendered from the definition


def _data_files() -> list[Path]:
    root = Path(__file__).resolve().parent.parent / "detectors"
    return [root / "rules.toml", *sorted((root / "playbooks").glob("*.toml"))]


def test_expand_leaves_sql_without_templates_alone():
    sql = "SELECT {now:DateTime64(3, 'UTC')} AS t, map('a', 1) AS m"
    assert expand(sql) == sql


def test_the_module_lists_every_definition_and_refuses_other_arguments(capsys):
    from loopwatch.core.metrics import main

    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    assert "cache_hit_rate [percentunit] = cache_read_input_tokens / cache_read_input_tokens" \
        " + cache_creation_input_tokens + uncached_input_tokens over cache_metrics_1m" in listed
    assert "loop_rate [percentunit] = loops / all_closed_runs over runs (not in run_metrics_1m" \
        in listed
    assert listed.count("    grain: ") == len(METRICS)
    for argv in ([], ["views", "extra"], ["--drop"]):
        assert main(argv) == 2
        assert capsys.readouterr().err.count("\n") == 1
