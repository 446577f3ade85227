"""Retry amplification auditor (the $200 postmortem, PM400; the retry posts).

Nested retry caps multiply: a tool retried 5 times inside a model step re-planned 5
times inside a job re-queued 3 times is 75 attempts per item, and none can succeed when
the error is permanent (a 4xx other than 408 and 429: the request itself is wrong).
Per agent this reads the attempts per logical operation at each layer (tool: same run,
tool and arguments; model: same run and ``logical_op_id``, else step; job: runs sharing
a ``job_id``), their observed maxima and worst-case product, and the model spend on
retries of permanent errors: every permanent-error call of an operation after its first,
counted across the item's runs (the re-queued jobs included). That spend is the saving;
the recommendation is to make those errors terminal at every layer, with the breaker
and the per-run spend ceiling that bound what the caps do not.
"""

from __future__ import annotations

from dataclasses import dataclass

from loopwatch.detectors.advisors.base import WINDOW_FILTER, Context, Finding, money

#: a permanent error: the request is wrong, sending it again fails the same way
PERMANENT = "(http_status BETWEEN 400 AND 499 AND http_status NOT IN (408, 429))"
#: the seed's breaker: open after this many calls at >= half failing
BREAKER_WINDOW = 20
BREAKER_TRIP_RATE = 0.5


@dataclass(frozen=True)
class Amplification:
    """Attempts per item at each layer and what a doomed item costs (PM400).

    >>> a = Amplification(tool=5, model=5, job=3)
    >>> a.attempts_per_item, a.model_calls_per_item
    (75, 15)
    >>> round(a.item_cost(0.024), 2), round(a.item_cost(0.024) * 550)
    (0.36, 198)
    """

    tool: int
    model: int
    job: int

    @property
    def attempts_per_item(self) -> int:
        return self.tool * self.model * self.job

    @property
    def model_calls_per_item(self) -> int:
        """Tool retries cost latency; the model re-plans are the calls that cost money."""
        return self.model * self.job

    def item_cost(self, call_cost_usd: float) -> float:
        return self.model_calls_per_item * call_cost_usd


ITEMS = f"""
SELECT run_id, if(job = '', run_id, job) AS item
FROM (
    SELECT run_id, any(JSONExtractString(payload, 'job_id')) AS job
    FROM events FINAL
    WHERE event_type = 'run.start' AND {WINDOW_FILTER}
    GROUP BY run_id
)
"""

MODEL_SQL = f"""
SELECT agent, max(attempts) AS max_attempts, max(item_attempts) AS max_item_attempts,
       count() AS ops, countIf(permanent >= 2) AS ops_retrying_permanent,
       sum(permanent) AS permanent_calls, sum(greatest(permanent, 1) - 1) AS permanent_retries,
       sum(if(permanent >= 2, permanent_usd * (permanent - 1) / permanent, 0)) AS wasted_usd,
       sum(item_usd) AS spend_usd, uniqExact(item) AS items,
       uniqExactIf(item, permanent >= 2) AS items_retrying_permanent,
       max(item_call_usd) AS max_call_usd
FROM (
    SELECT agent, item_key AS item, op, max(run_attempts) AS attempts,
           sum(run_attempts) AS item_attempts, sum(run_permanent) AS permanent,
           sum(run_permanent_usd) AS permanent_usd, sum(run_usd) AS item_usd,
           max(run_call_usd) AS item_call_usd
    FROM (
        SELECT per_run.*, if(items.item = '', per_run.run_id, items.item) AS item_key
        FROM (
            SELECT agent, run_id, if(logical_op_id != '', logical_op_id, toString(step)) AS op,
                   count() AS run_attempts, countIf({PERMANENT}) AS run_permanent,
                   sumIf(cost_usd, {PERMANENT}) AS run_permanent_usd,
                   sum(cost_usd) AS run_usd, max(cost_usd) AS run_call_usd
            FROM llm_calls FINAL
            WHERE {WINDOW_FILTER}
            GROUP BY agent, run_id, op
        ) AS per_run
        LEFT JOIN ({ITEMS}) AS items USING (run_id)
    )
    GROUP BY agent, item_key, op
)
GROUP BY agent
"""

TOOL_SQL = f"""
SELECT agent, max(attempts) AS max_attempts, countIf(permanent >= 2) AS ops_retrying_permanent,
       sum(permanent) AS permanent_calls, sum(greatest(permanent, 1) - 1) AS permanent_retries
FROM (
    SELECT agent, run_id, tool, args_hash, count() AS attempts,
           countIf({PERMANENT}) AS permanent
    FROM tool_calls FINAL
    WHERE {WINDOW_FILTER}
    GROUP BY agent, run_id, tool, args_hash
)
GROUP BY agent
"""

JOB_SQL = f"""
SELECT agent, max(runs) AS max_runs_per_job, countIf(runs > 1) AS requeued_jobs
FROM (
    SELECT agent, JSONExtractString(payload, 'job_id') AS job, count() AS runs
    FROM events FINAL
    WHERE event_type = 'run.start' AND {WINDOW_FILTER}
    GROUP BY agent, job
    HAVING job != ''
)
GROUP BY agent
"""

CEILING_SQL = """
SELECT agent, quantileExact(0.95)(cost_usd) AS p95_success_usd
FROM runs FINAL
WHERE outcome = 'success'
  AND started_ts >= {since:DateTime64(3, 'UTC')} AND started_ts < {until:DateTime64(3, 'UTC')}
  AND ({agent:String} = '' OR agent = {agent:String})
GROUP BY agent
"""

EVIDENCE_SQL = f"""
SELECT 'model' AS layer, http_status, error_type, count() AS calls,
       round(sum(cost_usd), 4) AS cost_usd, max(attempt) AS max_attempt
FROM llm_calls FINAL
WHERE {WINDOW_FILTER} AND {PERMANENT}
GROUP BY http_status, error_type
UNION ALL
SELECT 'tool' AS layer, http_status, error_type, count() AS calls, 0 AS cost_usd,
       max(attempt) AS max_attempt
FROM tool_calls FINAL
WHERE {WINDOW_FILTER} AND {PERMANENT}
GROUP BY http_status, error_type
ORDER BY calls DESC
"""


def _by_agent(rows: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    return {str(row["agent"]): row for row in rows}


def _int(row: dict[str, object] | None, key: str, default: int = 0) -> int:
    value = (row or {}).get(key)
    return default if value is None else int(value)  # type: ignore[call-overload]


def _float(row: dict[str, object] | None, key: str) -> float:
    value = (row or {}).get(key)
    return 0.0 if value is None else float(value)  # type: ignore[arg-type]


class RetryAdvisor:
    kind = "retry_amplification"

    def findings(self, context: Context) -> list[Finding]:
        tools = _by_agent(context.rows(TOOL_SQL))
        jobs = _by_agent(context.rows(JOB_SQL))
        ceilings = _by_agent(context.rows(CEILING_SQL))
        results = []
        for model in context.rows(MODEL_SQL):
            agent = str(model["agent"])
            tool, job = tools.get(agent), jobs.get(agent)
            wasted = _float(model, "wasted_usd")
            permanent_retries = _int(model, "permanent_retries") + _int(tool, "permanent_retries")
            if permanent_retries == 0:
                continue
            saving = context.per_day(agent, wasted)
            if not context.worth(agent, saving):
                continue
            layers = Amplification(tool=max(1, _int(tool, "max_attempts", 1)),
                                   model=max(1, _int(model, "max_attempts", 1)),
                                   job=max(1, _int(job, "max_runs_per_job", 1)))
            ceiling = 2 * _float(ceilings.get(agent), "p95_success_usd")
            failed = _int(model, "permanent_calls") + _int(tool, "permanent_calls")
            evidence: dict[str, object] = {
                "layers": {"tool": layers.tool, "model": layers.model, "job": layers.job},
                "worst_case_attempts_per_item": layers.attempts_per_item,
                "worst_case_model_calls_per_item": layers.model_calls_per_item,
                "observed_max_model_calls_per_op": _int(model, "max_item_attempts"),
                "worst_case_item_cost_usd": round(layers.item_cost(
                    _float(model, "max_call_usd")), 6),
                "items": _int(model, "items"),
                "items_retrying_permanent_errors": _int(model, "items_retrying_permanent"),
                "permanent_error_calls": failed,
                "permanent_error_retries": permanent_retries,
                "wasted_usd_in_window": round(wasted, 6),
                "breaker": {"window": BREAKER_WINDOW, "trip_rate": BREAKER_TRIP_RATE,
                            "calls_avoided": max(0, failed - BREAKER_WINDOW)},
                "spend_ceiling_usd_per_run": round(ceiling, 6),
                "formula": "attempts per item = tool x model x job; wasted = the cost of "
                           "every permanent-error model call of an operation after its "
                           "first, across the item's runs; saving = wasted per day",
            }
            recommendation = (
                f"Stop retrying permanent errors (4xx other than 408/429): make them "
                f"terminal at every layer. Observed caps multiply to {layers.tool} x "
                f"{layers.model} x {layers.job} = {layers.attempts_per_item} attempts per "
                f"item; {permanent_retries} retries of permanent errors cost "
                f"{money(wasted)} in the window. Add a breaker (open at "
                f"{BREAKER_TRIP_RATE:.0%} failures over {BREAKER_WINDOW} calls) and a "
                f"per-run spend ceiling of {money(ceiling)} (2 x the p95 successful run).")
            results.append(Finding(
                kind="retry_amplification", agent=agent, subject="permanent_errors",
                evidence=evidence, recommendation=recommendation,
                saving_usd_per_day=round(saving, 4),
                query=context.query_text(EVIDENCE_SQL, agent=agent),
                recommended=float(layers.attempts_per_item)))
        return results
