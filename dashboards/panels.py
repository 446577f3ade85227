"""Every panel, defined once: the single source for Grafana and the built-in web view.

Three tiers (G003 §4.2): real-time operational health (1-minute buckets, refreshed
every 30 s), historical trends (1-hour buckets up to 8 days, 1-day buckets beyond,
so 7-day and 30-day views both read well) and the drill-down into one run.

The SQL is the Grafana ClickHouse plugin's dialect: ``$__timeFilter(col)``,
``$__timeInterval(col)``, ``$__interval_s``, ``$__fromTime``/``$__toTime`` and
``$__conditionalAll(cond, $var)`` around every template-variable filter, with values
only ever written ``${name:sqlstring}`` (quoted and escaped by Grafana; bound as query
parameters by :mod:`loopwatch.dashboards.macros` in the web view). Base tables are read with
FINAL (ReplacingMergeTree); the per-minute views already are.

>>> len(PANELS), sorted({p.tier for p in PANELS})
(34, ['drilldown', 'realtime', 'trends'])
>>> [t.id for t in TIERS]
['realtime', 'trends', 'drilldown']
"""

from __future__ import annotations

from typing import Final

from loopwatch.core.metrics import METRICS as M
from loopwatch.core.metrics import silent_sql
from loopwatch.dashboards.model import Annotation, Panel, Threshold, Tier, TierId, Variable

#: the silent outcomes, from their one definition (loopwatch/core/metrics.toml)
SILENT: Final = silent_sql()

#: Outcome colours, the same in Grafana and the web view: green for success, red for
#: exceptions, warm colours for the silent failures, grey for runs nobody finished.
OUTCOME_COLORS: Final[dict[str, str]] = {
    "success": "#73BF69", "hard_error": "#F2495C", "budget_exhausted": "#FF9830",
    "gave_up": "#FADE2A", "looped": "#B877D9", "wrong": "#FF7383", "abandoned": "#8E8E8E",
    "running": "#5794F2",
}
SEVERITY_COLORS: Final[dict[str, str]] = {
    "critical": "#F2495C", "warning": "#FF9830", "info": "#5794F2",
}

#: Human titles for columns, used as display names by both renderers.
TITLES: Final[dict[str, str]] = {
    "silent_failure_ratio": "silent-failure ratio", "exception_rate": "exception rate",
    "cost_per_minute": "cost / minute", "baseline_7d": "same time, last 7 days",
    "error_rate_excl_429": "error rate (excl. 429)", "error_rate": "error rate",
    "rate_429": "429 rate", "cache_hit_rate": "cache hit rate", "near_miss_ratio":
    "near-miss ratio", "p99_ms": "p99", "p50_ms": "p50", "p95_ms": "p95",
    "cost_per_successful_run": "cost per successful run", "cost_per_run": "cost per run",
    "p50_steps": "p50", "p95_steps": "p95", "p99_steps": "p99", "max_steps": "max",
    "active_runs": "active runs", "firing_alerts": "firing alerts", "spend_usd": "spend",
    "timeouts": "timeouts", "near_misses": "near-misses", "runs": "runs",
    "cost_usd": "cost", "step_cost_usd": "step cost", "share_of_run": "share of run",
}

FILTER_VARIABLES: Final = ("agent", "task_type", "model", "traffic_slice")

VARIABLES: Final[dict[str, Variable]] = {
    "agent": Variable("agent", "Agent",
                      "SELECT DISTINCT agent FROM runs FINAL WHERE agent != '' ORDER BY agent"),
    "task_type": Variable("task_type", "Task type",
                          "SELECT DISTINCT task_type FROM runs FINAL WHERE task_type != '' "
                          "ORDER BY task_type"),
    "model": Variable("model", "Model",
                      "SELECT DISTINCT model FROM runs FINAL WHERE model != '' ORDER BY model"),
    "traffic_slice": Variable("traffic_slice", "Environment / traffic slice",
                              "SELECT DISTINCT traffic_slice FROM runs FINAL "
                              "WHERE traffic_slice != '' ORDER BY traffic_slice"),
    "run_id": Variable("run_id", "Run id", None, "the run to drill into"),
}


def filters(*variables: str, columns: dict[str, str] | None = None) -> str:
    """The template-variable filters, each a no-op (``1=1``) while the variable is All.

    >>> filters("agent")
    '$__conditionalAll(agent IN (${agent:sqlstring}), $agent)'
    """
    mapping = columns or {}
    return " AND ".join(
        f"$__conditionalAll({mapping.get(name, name)} IN (${{{name}:sqlstring}}), ${name})"
        for name in variables)


ALL_FILTERS: Final = filters(*FILTER_VARIABLES)
TOOL_FILTERS: Final = filters("agent", "task_type", "traffic_slice")  # tool_metrics_1m
RUN: Final = "run_id = ${run_id:sqlstring}"


def bucket(column: str) -> str:
    """Historical buckets: hourly up to 8 days of range, daily beyond (a 30-day view)."""
    return (f"toDateTime(if(dateDiff('hour', $__fromTime, $__toTime) > 192, "
            f"toStartOfDay({column}), toStartOfHour({column})))")


RATIO_ALARM: Final = (Threshold(0.1, "orange"), Threshold(0.2, "red"))

REALTIME: Final[tuple[Panel, ...]] = (
    Panel(
        "firing_alerts_count", "realtime", "Firing alerts",
        "Alerts firing now; each is listed below with its playbook.",
        f"""SELECT count() AS firing_alerts
FROM alerts FINAL
WHERE state = 'firing' AND {filters("agent", columns={"agent": "labels['agent']"})}""",
        "stat", ("firing_alerts",), thresholds=(Threshold(1, "red"),), width=6, height=4,
        section="Now"),
    Panel(
        "active_runs_now", "realtime", "Active runs",
        "Runs started and not yet ended (the store's view, now).",
        f"""SELECT count() AS active_runs
FROM runs FINAL
WHERE status = 'running' AND {ALL_FILTERS}""",
        "stat", ("active_runs",), base_color="blue", width=6, height=4, section="Now"),
    Panel(
        "silent_failure_ratio_now", "realtime", "Silent-failure ratio",
        "(budget_exhausted + gave_up + looped + wrong) / closed runs in the range: the "
        "failures an exception counter never sees.",
        f"""SELECT {M["silent_failure_ratio"].over_view()} AS silent_failure_ratio
FROM run_metrics_1m
WHERE $__timeFilter(minute) AND {ALL_FILTERS}""",
        "stat", ("silent_failure_ratio",), unit="percentunit", thresholds=RATIO_ALARM,
        width=6, height=4, decimals=1, section="Now"),
    Panel(
        "spend_now", "realtime", "Spend in range",
        "LLM cost in the range, recomputed from tokens with the versioned price table.",
        f"""SELECT sum(cost_usd) AS spend_usd
FROM llm_calls FINAL
WHERE $__timeFilter(ts) AND {ALL_FILTERS}""",
        "stat", ("spend_usd",), unit="currencyUSD", base_color="blue", width=6, height=4,
        decimals=2, section="Now"),
    Panel(
        "firing_alerts", "realtime", "Firing alerts and their playbooks",
        "Critical first. The playbook column names the runbook to open; a run id opens "
        "the run drill-down.",
        f"""SELECT severity, rule, summary, labels['agent'] AS agent, value, fired_at, playbook,
       labels['run_id'] AS run_id
FROM alerts FINAL
WHERE state = 'firing' AND {filters("agent", columns={"agent": "labels['agent']"})}
ORDER BY severity = 'critical' DESC, fired_at DESC
LIMIT 50""",
        "table", ("severity", "rule", "summary", "agent", "value", "fired_at", "playbook",
                  "run_id"),
        column_units={"fired_at": "dateTimeAsIso"}, colors=SEVERITY_COLORS,
        color_columns=("severity",), width=24,
        height=7, section="Now"),
    Panel(
        "outcome_mix", "realtime", "Outcome mix",
        "Runs closed per bucket by outcome. Every run gets exactly one outcome.",
        f"""SELECT $__timeInterval(minute) AS time, outcome, sum(runs) AS runs
FROM outcomes_1m
WHERE $__timeFilter(minute) AND {ALL_FILTERS}
GROUP BY time, outcome
ORDER BY time, outcome""",
        "bars", ("time", "outcome", "runs"), series_by=("outcome",), colors=OUTCOME_COLORS,
        min_interval="1m", section="Outcomes"),
    Panel(
        "silent_vs_exception", "realtime", "Silent-failure ratio vs exception rate",
        "If the silent line climbs while exceptions stay flat, the agents are failing "
        "quietly: loops, caps, give-ups and wrong answers.",
        f"""SELECT $__timeInterval(minute) AS time,
       {M["silent_failure_ratio"].over_view()} AS silent_failure_ratio,
       {M["exception_rate"].over_view()} AS exception_rate
FROM run_metrics_1m
WHERE $__timeFilter(minute) AND {ALL_FILTERS}
GROUP BY time
ORDER BY time""",
        "timeseries", ("time", "silent_failure_ratio", "exception_rate"),
        unit="percentunit", thresholds=RATIO_ALARM, threshold_lines=True,
        colors={"silent_failure_ratio": "#FF9830", "exception_rate": "#F2495C"},
        min_interval="1m", section="Outcomes"),
    Panel(
        "cost_per_minute", "realtime", "Cost per minute vs its baseline",
        "Spend per minute against the same minutes of the day over the previous 7 days "
        "(days without traffic left out): traffic has a daily rhythm, so a flat average "
        "would cry wolf at every peak.",
        f"""SELECT $__timeInterval(ts) AS time,
       sum(cost_usd) / ($__interval_s / 60) AS cost_per_minute,
       any(history.per_minute) AS baseline_7d
FROM llm_calls FINAL
CROSS JOIN (
    SELECT sum(cost_usd) / nullIf(uniqExact(intDiv(dateDiff('second', ts, $__toTime), 86400))
               * greatest(1, dateDiff('minute', $__fromTime, $__toTime)), 0) AS per_minute
    FROM llm_calls FINAL
    WHERE ts >= $__fromTime - INTERVAL 7 DAY AND ts < $__fromTime
      AND arrayExists(day -> ts >= $__fromTime - toIntervalDay(day)
                             AND ts <= $__toTime - toIntervalDay(day), range(1, 8))
      AND {ALL_FILTERS}
) AS history
WHERE $__timeFilter(ts) AND {ALL_FILTERS}
GROUP BY time
ORDER BY time""",
        "timeseries", ("time", "cost_per_minute", "baseline_7d"),
        unit="currencyUSD", decimals=3,
        colors={"cost_per_minute": "#5794F2", "baseline_7d": "#8E8E8E"}, dashed=("baseline_7d",),
        min_interval="1m", section="Outcomes"),
    Panel(
        "active_runs", "realtime", "Active runs over time",
        "Runs with any event in the bucket: concurrency, and a traffic surge at a glance.",
        f"""SELECT $__timeInterval(ts) AS time, uniqExact(run_id) AS active_runs
FROM events FINAL
WHERE $__timeFilter(ts) AND run_id != '' AND event_type != 'annotation' AND {ALL_FILTERS}
GROUP BY time
ORDER BY time""",
        "timeseries", ("time", "active_runs"), colors={"active_runs": "#5794F2"},
        min_interval="1m", section="Outcomes"),
    Panel(
        "llm_errors_by_provider", "realtime", "LLM error rate and 429 rate by provider",
        "Errors exclude rate limits (429s), which have their own line: a 429 storm wants "
        "backoff, an error wave wants the fallback provider. Alert level 2%.",
        f"""SELECT $__timeInterval(ts) AS time,
       if(provider = '', 'unknown', provider) AS provider_name,
       {M["llm_error_rate"].ratio()} AS error_rate_excl_429,
       {M["llm_rate_429"].ratio()} AS rate_429
FROM llm_calls FINAL
WHERE $__timeFilter(ts) AND {ALL_FILTERS}
GROUP BY time, provider_name
ORDER BY time, provider_name""",
        "timeseries", ("time", "provider_name", "error_rate_excl_429", "rate_429"),
        series_by=("provider_name",), unit="percentunit",
        thresholds=(Threshold(0.02, "orange"), Threshold(0.5, "red")), threshold_lines=True,
        min_interval="1m", section="Providers and tools"),
    Panel(
        "cache_hit_rate", "realtime", "Prompt-cache hit rate by agent",
        "cache_read / (cache_read + cache_creation + uncached input). An agent near 0 "
        "pays full price for every prompt: a silent cache miss.",
        f"""SELECT $__timeInterval(minute) AS time, agent,
       {M["cache_hit_rate"].over_view()} AS cache_hit_rate
FROM cache_metrics_1m
WHERE $__timeFilter(minute) AND {ALL_FILTERS}
GROUP BY time, agent
ORDER BY time, agent""",
        "timeseries", ("time", "agent", "cache_hit_rate"), series_by=("agent",),
        unit="percentunit", thresholds=(Threshold(0.3, "orange"), Threshold(0.6, "green")),
        base_color="red", min_interval="1m", section="Providers and tools"),
    Panel(
        "tool_error_rate", "realtime", "Tool error rate",
        "Errors and timeouts over calls, per tool. Alert level 5%.",
        f"""SELECT $__timeInterval(minute) AS time, tool,
       {M["tool_error_rate"].over_view()} AS error_rate
FROM tool_metrics_1m
WHERE $__timeFilter(minute) AND {TOOL_FILTERS}
GROUP BY time, tool
ORDER BY time, tool""",
        "timeseries", ("time", "tool", "error_rate"), series_by=("tool",),
        unit="percentunit", thresholds=(Threshold(0.05, "orange"), Threshold(0.5, "red")),
        threshold_lines=True, min_interval="1m", section="Providers and tools"),
    Panel(
        "tool_latency_p99", "realtime", "Tool latency p99",
        "The tail that sets the agent's own p99 (p50 and p95 in the table beside it).",
        f"""SELECT $__timeInterval(ts) AS time, tool, quantile(0.99)(latency_ms) AS p99_ms
FROM tool_calls FINAL
WHERE $__timeFilter(ts) AND {ALL_FILTERS}
GROUP BY time, tool
ORDER BY time, tool""",
        "timeseries", ("time", "tool", "p99_ms"), series_by=("tool",), unit="ms",
        min_interval="1m", section="Providers and tools"),
    Panel(
        "near_miss_ratio", "realtime", "Near-miss timeout ratio per tool",
        "Timeouts whose true duration was within 1.3x the timeout, over timeouts with a "
        "known duration: high means the timeout is set too low, not that the tool is down.",
        f"""SELECT $__timeInterval(minute) AS time, tool,
       {M["near_miss_ratio"].over_view()} AS near_miss_ratio
FROM tool_metrics_1m
WHERE $__timeFilter(minute) AND timeouts > 0 AND {TOOL_FILTERS}
GROUP BY time, tool
ORDER BY time, tool""",
        "timeseries", ("time", "tool", "near_miss_ratio"), series_by=("tool",),
        unit="percentunit", thresholds=(Threshold(0.5, "orange"),), threshold_lines=True,
        min_interval="1m", section="Providers and tools"),
    Panel(
        "retry_amplification", "realtime", "Retry amplification per tool",
        "Attempts consumed by retried operations / retried operations: 2.0 is one retry "
        "each; above 2.5x the on-call engineer is flagged (A24).",
        f"""SELECT $__timeInterval(minute) AS time, tool,
       {M["tool_retry_amplification"].over_view()} AS retry_amplification
FROM tool_metrics_1m
WHERE $__timeFilter(minute) AND retried_operations > 0 AND {TOOL_FILTERS}
GROUP BY time, tool
ORDER BY time, tool""",
        "timeseries", ("time", "tool", "retry_amplification"), series_by=("tool",),
        unit="none", thresholds=(Threshold(2.5, "orange"),), threshold_lines=True,
        min_interval="1m", section="Providers and tools"),
    Panel(
        "tool_health", "realtime", "Tools: error rate and latency p50 / p95 / p99",
        "Over the whole range, worst first.",
        f"""SELECT tool, count() AS calls, {M["tool_error_rate"].ratio()} AS error_rate,
       quantile(0.5)(latency_ms) AS p50_ms, quantile(0.95)(latency_ms) AS p95_ms,
       quantile(0.99)(latency_ms) AS p99_ms, {M["tool_timeout_rate"].ratio()} AS timeout_rate,
       {M["near_miss_ratio"].ratio()} AS near_miss_ratio
FROM tool_calls FINAL
WHERE $__timeFilter(ts) AND {ALL_FILTERS}
GROUP BY tool
ORDER BY error_rate DESC, p99_ms DESC, tool""",
        "table", ("tool", "calls", "error_rate", "p50_ms", "p95_ms", "p99_ms", "timeout_rate",
                  "near_miss_ratio"),
        column_units={"error_rate": "percentunit", "timeout_rate": "percentunit",
                      "near_miss_ratio": "percentunit", "p50_ms": "ms", "p95_ms": "ms",
                      "p99_ms": "ms"},
        width=12, section="Providers and tools"),
    Panel(
        "problem_runs", "realtime", "Runs to look at",
        "Closed runs that did not succeed, and running ones past 20 steps, newest first. "
        "A run id opens its drill-down.",
        f"""SELECT run_id, agent, task_type, if(status = 'running', 'running', outcome) AS ended_as,
       steps, tool_errors + llm_errors AS errors, cost_usd, last_event_ts
FROM runs FINAL
WHERE $__timeFilter(last_event_ts) AND {ALL_FILTERS}
  AND ((status = 'closed' AND outcome NOT IN ('success', 'unknown'))
       OR (status = 'running' AND steps > 20))
ORDER BY last_event_ts DESC
LIMIT 50""",
        "table", ("run_id", "agent", "task_type", "ended_as", "steps", "errors", "cost_usd",
                  "last_event_ts"),
        column_units={"cost_usd": "currencyUSD", "last_event_ts": "dateTimeAsIso"},
        colors=OUTCOME_COLORS, color_columns=("ended_as",), width=24, height=9,
        section="Runs to look at"),
)

TRENDS: Final[tuple[Panel, ...]] = (
    Panel(
        "cost_by_outcome", "trends", "Cost by outcome",
        "Where the money went: spend of the runs that closed in each bucket, by outcome. "
        "Everything not green is the cost of failure.",
        f"""SELECT {bucket("minute")} AS time, outcome, sum(cost_usd) AS cost_usd
FROM outcomes_1m
WHERE $__timeFilter(minute) AND outcome != 'unknown' AND {ALL_FILTERS}
GROUP BY time, outcome
ORDER BY time, outcome""",
        "bars", ("time", "outcome", "cost_usd"), series_by=("outcome",), unit="currencyUSD",
        colors=OUTCOME_COLORS, decimals=2, section="Cost"),
    Panel(
        "cost_per_success", "trends", "Cost per successful run",
        "All spend, failures included, over the runs that succeeded, beside the plain "
        "cost per run: the gap is what failures cost each success.",
        f"""SELECT {bucket("minute")} AS time,
       {M["cost_per_successful_run"].over_view()} AS cost_per_successful_run,
       {M["cost_per_run"].over_view()} AS cost_per_run
FROM run_metrics_1m
WHERE $__timeFilter(minute) AND {ALL_FILTERS}
GROUP BY time
ORDER BY time""",
        "timeseries", ("time", "cost_per_successful_run", "cost_per_run"),
        unit="currencyUSD", decimals=4,
        colors={"cost_per_successful_run": "#FF9830", "cost_per_run": "#5794F2"},
        section="Cost"),
    Panel(
        "cost_per_outcome", "trends", "Cost per outcome",
        "Runs, total and mean cost per outcome over the range, and each outcome's share "
        "of the spend.",
        f"""SELECT outcome, sum(runs) AS total_runs, sum(cost_usd) AS spend_usd,
       {M["cost_per_outcome"].over_view()} AS mean_cost_usd,
       spend_usd / sum(spend_usd) OVER () AS share_of_spend
FROM outcomes_1m
WHERE $__timeFilter(minute) AND outcome != 'unknown' AND {ALL_FILTERS}
GROUP BY outcome
ORDER BY spend_usd DESC, outcome""",
        "table", ("outcome", "total_runs", "spend_usd", "mean_cost_usd", "share_of_spend"),
        column_units={"spend_usd": "currencyUSD", "mean_cost_usd": "currencyUSD",
                      "share_of_spend": "percentunit"},
        colors=OUTCOME_COLORS, color_columns=("outcome",), width=10, section="Cost"),
    Panel(
        "outcome_by_model_prompt", "trends", "Outcome mix by model and prompt version",
        "Did a model or prompt change move failures around?",
        f"""SELECT model, prompt_version, sum(runs) AS total_runs,
       sumIf(runs, outcome = 'success') / total_runs AS success_rate,
       sumIf(runs, outcome IN {SILENT}) / total_runs AS silent_failure_ratio,
       sumIf(runs, outcome = 'hard_error') / total_runs AS exception_rate,
       sumIf(runs, outcome = 'looped') AS looped, sumIf(runs, outcome = 'wrong') AS wrong,
       sumIf(runs, outcome = 'budget_exhausted') AS budget_exhausted,
       sumIf(runs, outcome = 'gave_up') AS gave_up, sumIf(runs, outcome = 'abandoned') AS abandoned,
       {M["cost_per_outcome"].over_view()} AS mean_cost_usd
FROM outcomes_1m
WHERE $__timeFilter(minute) AND outcome != 'unknown' AND {ALL_FILTERS}
GROUP BY model, prompt_version
ORDER BY total_runs DESC, model, prompt_version""",
        "table", ("model", "prompt_version", "total_runs", "success_rate",
                  "silent_failure_ratio", "exception_rate", "looped", "wrong",
                  "budget_exhausted", "gave_up", "abandoned", "mean_cost_usd"),
        column_units={"success_rate": "percentunit", "silent_failure_ratio": "percentunit",
                      "exception_rate": "percentunit", "mean_cost_usd": "currencyUSD"},
        width=14, section="Cost"),
    Panel(
        "silent_failure_trend", "trends", "Silent-failure ratio vs exception rate",
        "The same pair as the real-time view, over days: a slow drift shows here first.",
        f"""SELECT {bucket("minute")} AS time,
       {M["silent_failure_ratio"].over_view()} AS silent_failure_ratio,
       {M["exception_rate"].over_view()} AS exception_rate
FROM run_metrics_1m
WHERE $__timeFilter(minute) AND {ALL_FILTERS}
GROUP BY time
ORDER BY time""",
        "timeseries", ("time", "silent_failure_ratio", "exception_rate"), unit="percentunit",
        thresholds=RATIO_ALARM, threshold_lines=True,
        colors={"silent_failure_ratio": "#FF9830", "exception_rate": "#F2495C"},
        width=24, section="Runs"),
    Panel(
        "steps_quantiles", "trends", "Steps per run: p50 / p95 / p99 / max",
        "A p99 at 3x its history means agents are looping or planning in circles.",
        f"""SELECT {bucket("assumeNotNull(closed_ts)")} AS time,
       quantile(0.5)(steps) AS p50_steps, quantile(0.95)(steps) AS p95_steps,
       quantile(0.99)(steps) AS p99_steps, max(steps) AS max_steps
FROM runs FINAL
WHERE status = 'closed' AND $__timeFilter(closed_ts) AND {ALL_FILTERS}
GROUP BY time
ORDER BY time""",
        "timeseries", ("time", "p50_steps", "p95_steps", "p99_steps", "max_steps"),
        decimals=1, width=16, section="Runs"),
    Panel(
        "steps_distribution", "trends", "Steps-per-run distribution",
        "How many steps closed runs took (30 and more in one bar).",
        f"""SELECT if(steps >= 30, '30+', toString(steps)) AS steps_taken, count() AS runs
FROM runs FINAL
WHERE status = 'closed' AND $__timeFilter(closed_ts) AND {ALL_FILTERS}
GROUP BY steps_taken
ORDER BY min(steps)""",
        "barchart", ("steps_taken", "runs"), colors={"runs": "#5794F2"}, width=8,
        section="Runs"),
    Panel(
        "cache_by_prompt_deploy", "trends", "Cache hit rate by prompt version and deployment",
        "A prompt version or deployment whose line sits near 0 misses the cache on "
        "every call (a volatile prefix, a reordered tool list).",
        f"""SELECT {bucket("minute")} AS time, prompt_version, deployment,
       {M["cache_hit_rate"].over_view()} AS cache_hit_rate
FROM cache_metrics_1m
WHERE $__timeFilter(minute) AND {ALL_FILTERS}
GROUP BY time, prompt_version, deployment
ORDER BY time, prompt_version, deployment""",
        "timeseries", ("time", "prompt_version", "deployment", "cache_hit_rate"),
        series_by=("prompt_version", "deployment"), unit="percentunit",
        section="Cache and tools"),
    Panel(
        "tool_timeouts", "trends", "Timeouts and near-misses per tool",
        "Near-misses are timeouts that would have finished within 1.3x the limit: when "
        "they are most of a tool's timeouts, raise its timeout.",
        f"""SELECT {bucket("minute")} AS time, tool, sum(timeouts) AS timeouts,
       sum(near_misses) AS near_misses
FROM tool_metrics_1m
WHERE $__timeFilter(minute) AND {TOOL_FILTERS}
GROUP BY time, tool
HAVING timeouts > 0
ORDER BY time, tool""",
        "timeseries", ("time", "tool", "timeouts", "near_misses"), series_by=("tool",),
        section="Cache and tools"),
    Panel(
        "advice", "trends", "Advice: what to change, what it is worth",
        "The advisors' open findings (detectors/advisors, docs/advisors.md), largest "
        "saving per day first; `loopwatch advise` and the web view's Advice page show "
        "each with its evidence and chart.",
        f"""SELECT replaceOne(rule, 'advisor_', '') AS kind, labels['agent'] AS agent,
       labels['subject'] AS subject,
       JSONExtract(evidence, 'saving_usd_per_day', 'Nullable(Float64)') AS saving_usd_per_day,
       summary AS recommendation, started_at
FROM alerts FINAL
WHERE startsWith(rule, 'advisor_') AND state = 'firing'
  AND {filters("agent", columns={"agent": "labels['agent']"})}
ORDER BY saving_usd_per_day DESC NULLS LAST, kind, agent, subject
LIMIT 100""",
        "table", ("kind", "agent", "subject", "saving_usd_per_day", "recommendation",
                  "started_at"),
        column_units={"saving_usd_per_day": "currencyUSD"}, width=24, section="Advice"),
)

DRILLDOWN: Final[tuple[Panel, ...]] = (
    Panel(
        "run_list", "drilldown", "Runs in range",
        "Newest first; pick a run to drill into.",
        f"""SELECT run_id, agent, task_type, status, outcome, steps, tool_calls,
       tool_errors + llm_errors AS errors, cost_usd, started_ts
FROM runs FINAL
WHERE $__timeFilter(started_ts) AND {ALL_FILTERS}
ORDER BY started_ts DESC
LIMIT 200""",
        "table", ("run_id", "agent", "task_type", "status", "outcome", "steps", "tool_calls",
                  "errors", "cost_usd", "started_ts"),
        column_units={"cost_usd": "currencyUSD", "started_ts": "dateTimeAsIso"},
        colors=OUTCOME_COLORS, color_columns=("status", "outcome"), width=24, height=10,
        section="Pick a run"),
    Panel(
        "run_summary", "drilldown", "Run",
        "What the run was, how it ended and what it cost.",
        f"""SELECT run_id, agent, task_type, model, prompt_version, deployment, traffic_slice,
       status, outcome, terminal_reason, steps, llm_calls, tool_calls,
       tool_errors + llm_errors AS errors, input_tokens, output_tokens, cache_read_input_tokens,
       cost_usd, loop_detected, loop_summary, started_ts, closed_ts
FROM runs FINAL
WHERE {RUN}""",
        "table", ("run_id", "agent", "task_type", "model", "prompt_version", "deployment",
                  "traffic_slice", "status", "outcome", "terminal_reason", "steps", "llm_calls",
                  "tool_calls", "errors", "input_tokens", "output_tokens",
                  "cache_read_input_tokens", "cost_usd", "loop_detected", "loop_summary",
                  "started_ts", "closed_ts"),
        column_units={"cost_usd": "currencyUSD", "started_ts": "dateTimeAsIso",
                      "closed_ts": "dateTimeAsIso"},
        colors=OUTCOME_COLORS, color_columns=("status", "outcome"), width=24, height=5,
        needs_run=True, section="The run"),
    Panel(
        "run_expensive_step", "drilldown", "Most expensive step",
        "The step whose LLM calls cost the most, and its share of the run.",
        f"""SELECT step, sum(cost_usd) AS step_cost_usd, sum(input_tokens) AS input_tokens,
       step_cost_usd / nullIf(sum(step_cost_usd) OVER (), 0) AS share_of_run
FROM llm_calls FINAL
WHERE {RUN}
GROUP BY step
ORDER BY step_cost_usd DESC, step
LIMIT 1""",
        "stat", ("step", "step_cost_usd", "input_tokens", "share_of_run"),
        column_units={"step_cost_usd": "currencyUSD", "share_of_run": "percentunit",
                      "step": "none"},
        base_color="orange", width=8, height=6, needs_run=True, decimals=4,
        section="The run"),
    Panel(
        "run_cost_by_step", "drilldown", "Cost by step",
        "sum(cost_usd) by step number: a step that grows every time is re-reading a "
        "growing context.",
        f"""SELECT concat('step ', ifNull(toString(step), '?')) AS step_label,
       sum(cost_usd) AS cost_usd
FROM llm_calls FINAL
WHERE {RUN}
GROUP BY step
ORDER BY step ASC NULLS LAST""",
        "barchart", ("step_label", "cost_usd"), unit="currencyUSD", decimals=4,
        colors={"cost_usd": "#FF9830"}, width=16, height=6, needs_run=True, section="The run"),
    Panel(
        "run_timeline", "drilldown", "Timeline",
        "Every step, LLM call and tool call in order (a timed-out call when it timed out, "
        "though its event arrived when it really ended). `repeats` counts the run's calls "
        "with the same tool and args hash: 3 or more is the loop signature.",
        f"""SELECT time, event, step, name, args_hash, repeats, latency_ms, input_tokens,
       output_tokens, cost_usd, error
FROM (
    SELECT ts - toIntervalMillisecond(toInt64(if(timed_out = 1 AND late_completion_ms IS NOT NULL,
               late_completion_ms - latency_ms, 0))) AS time,
           'tool.call' AS event, step, toString(tool) AS name,
           args_hash, toNullable(count() OVER (PARTITION BY tool, args_hash)) AS repeats,
           toNullable(latency_ms) AS latency_ms, CAST(NULL, 'Nullable(UInt64)') AS input_tokens,
           CAST(NULL, 'Nullable(UInt64)') AS output_tokens,
           CAST(NULL, 'Nullable(Float64)') AS cost_usd,
           multiIf(timed_out = 1, 'timeout', toString(error_type)) AS error
    FROM tool_calls FINAL
    WHERE {RUN}
    UNION ALL
    SELECT ts, 'llm.call', step, toString(model), '', NULL, latency_ms, input_tokens,
           output_tokens, cost_usd,
           if(rate_limited = 1, 'rate limited (429)', toString(error_type))
    FROM llm_calls FINAL
    WHERE {RUN}
    UNION ALL
    SELECT ts, toString(event_type), JSONExtract(payload, 'step', 'Nullable(UInt32)'),
           multiIf(event_type = 'run.end', JSONExtractString(payload, 'terminal_reason'),
                   event_type = 'label', JSONExtractString(payload, 'verdict'),
                   event_type = 'step', JSONExtractString(payload, 'step_type'), ''),
           '', NULL, if(event_type = 'step', JSONExtractFloat(payload, 'duration_ms'), NULL),
           NULL, NULL, NULL, ''
    FROM events FINAL
    WHERE {RUN} AND event_type IN ('run.start', 'step', 'run.end', 'label')
)
ORDER BY time, event != 'run.start', event = 'run.end', step
LIMIT 2000""",
        "table", ("time", "event", "step", "name", "args_hash", "repeats", "latency_ms",
                  "input_tokens", "output_tokens", "cost_usd", "error"),
        column_units={"time": "dateTimeAsIso", "latency_ms": "ms", "cost_usd": "currencyUSD"},
        thresholds=(Threshold(3, "red"),), threshold_columns=("repeats",), base_color="text",
        width=24, height=14,
        needs_run=True, section="Timeline"),
    Panel(
        "run_repeated_args", "drilldown", "Repeated actions",
        "The same tool with the same arguments more than once, and between which steps.",
        f"""SELECT tool, args_hash, count() AS calls, min(step) AS first_step,
       max(step) AS last_step
FROM tool_calls FINAL
WHERE {RUN}
GROUP BY tool, args_hash
HAVING calls >= 2
ORDER BY calls DESC, tool""",
        "table", ("tool", "args_hash", "calls", "first_step", "last_step"),
        thresholds=(Threshold(3, "red"),), threshold_columns=("calls",), base_color="text",
        width=8, height=6,
        needs_run=True, section="Timeline"),
    Panel(
        "run_raw_events", "drilldown", "Raw events",
        "Exactly what the agent sent (prompt and response bodies are stored as hashes).",
        f"""SELECT ts, event_type, event_id, payload
FROM events FINAL
WHERE {RUN}
ORDER BY ts, event_type
LIMIT 1000""",
        "table", ("ts", "event_type", "event_id", "payload"),
        column_units={"ts": "dateTimeAsIso"}, width=16, height=10, needs_run=True,
        section="Timeline"),
)

PANELS: Final[tuple[Panel, ...]] = REALTIME + TRENDS + DRILLDOWN
PANELS_BY_ID: Final[dict[str, Panel]] = {panel.id: panel for panel in PANELS}

ANNOTATION: Final = Annotation(
    "Deploys, model and prompt changes",
    f"""SELECT ts AS time, toString(kind) AS title,
       concat(toString(kind), if(agent IN ('', '*'), '', concat(' · ', agent)),
              if(new_value = '', '', concat(': ', old_value, ' → ', new_value)),
              if(message = '', '', concat(' — ', message))) AS text,
       arrayFilter(x -> x != '', [toString(kind), toString(agent), toString(deployment),
                   toString(model), toString(prompt_version)]) AS tags
FROM annotations FINAL
WHERE $__timeFilter(ts) AND (agent = '*' OR {filters("agent")})
ORDER BY ts
LIMIT 500""",
    "#8AB8FF",
)

TIERS: Final[tuple[Tier, ...]] = (
    Tier("realtime", "loopwatch-realtime", "loopwatch · Operational health",
         "Real time: what is failing now, and what it costs. 1-minute buckets, 30 s refresh.",
         "now-1h", "30s", FILTER_VARIABLES, ("now-15m", "now-1h", "now-3h", "now-12h")),
    Tier("trends", "loopwatch-trends", "loopwatch · Historical trends",
         "Hourly buckets over 7 days, daily buckets over 30 days.",
         "now-7d", "5m", FILTER_VARIABLES, ("now-24h", "now-7d", "now-30d")),
    Tier("drilldown", "loopwatch-run", "loopwatch · Run drill-down",
         "One run: its timeline, its most expensive step, its repeated actions and the raw "
         "events.", "now-24h", "", ("run_id", *FILTER_VARIABLES),
         ("now-1h", "now-24h", "now-7d")),
)
TIERS_BY_ID: Final[dict[TierId, Tier]] = {tier.id: tier for tier in TIERS}


def panels_of(tier: TierId) -> tuple[Panel, ...]:
    return tuple(panel for panel in PANELS if panel.tier == tier)


def title_of(column: str) -> str:
    """A column's display title (its name with spaces when none is defined)."""
    return TITLES.get(column, column.replace("_", " "))
