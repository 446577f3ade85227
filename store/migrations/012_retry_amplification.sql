-- Retry amplification per tool (RSUCC, A24): the tool view gains the measures of its
-- two variants (D4). Views hold no data: every view is re-created as rendered.
-- Rendered by `python -m loopwatch.core.metrics views` from metrics.toml, the one
-- definition of every derived metric (the panels, rules, report and playbooks render
-- from it too); do not edit: a changed definition is a new migration rendered again.

CREATE OR REPLACE VIEW outcomes_1m AS
SELECT
    toStartOfInterval(closed_ts, INTERVAL 60000 MILLISECOND) AS minute,
    agent, task_type, model, prompt_version, deployment, traffic_slice, outcome,
    count() AS runs,
    sum(cost_usd) AS cost_usd,
    cost_usd / runs AS mean_cost_usd
FROM runs FINAL
WHERE status = 'closed'
GROUP BY minute, agent, task_type, model, prompt_version, deployment, traffic_slice, outcome;

CREATE OR REPLACE VIEW run_metrics_1m AS
SELECT
    minute, agent, task_type, model, prompt_version, deployment, traffic_slice,
    sumIf(runs, outcome != 'unknown') AS closed_runs,
    sumIf(runs, outcome IN ('budget_exhausted', 'gave_up', 'looped', 'wrong')) AS silent_failures,
    sumIf(runs, outcome = 'hard_error') AS hard_errors,
    sumIf(runs, outcome = 'success') AS successes,
    sumIf(cost_usd, outcome != 'unknown') AS cost_usd,
    silent_failures / nullIf(closed_runs, 0) AS silent_failure_ratio,
    hard_errors / nullIf(closed_runs, 0) AS exception_rate,
    cost_usd / nullIf(successes, 0) AS cost_per_successful_run
FROM outcomes_1m
GROUP BY minute, agent, task_type, model, prompt_version, deployment, traffic_slice;

CREATE OR REPLACE VIEW tool_metrics_1m AS
SELECT
    toStartOfInterval(ts, INTERVAL 60000 MILLISECOND) AS minute,
    agent, task_type, tool, traffic_slice,
    count() AS calls,
    sum(timed_out) AS timeouts,
    countIf(near_miss IS NOT NULL) AS timeouts_known_duration,
    countIf(near_miss = 1) AS near_misses,
    sum(is_error) AS errors,
    timeouts / calls AS timeout_rate,
    near_misses / nullIf(timeouts_known_duration, 0) AS near_miss_ratio,
    errors / calls AS error_rate,
    quantileTDigest(0.5)(latency_ms) AS latency_p50_ms,
    quantileTDigest(0.95)(latency_ms) AS latency_p95_ms,
    quantileTDigest(0.99)(latency_ms) AS latency_p99_ms,
    countIf(attempt = 1) AS first_attempts,
    countIf(attempt = 2) AS retried_operations,
    sum((attempt > 1) + (attempt = 2)) AS retried_operation_attempts,
    retried_operation_attempts / nullIf(retried_operations, 0) AS retry_amplification,
    calls / nullIf(first_attempts, 0) AS attempts_per_operation
FROM tool_calls FINAL
GROUP BY minute, agent, task_type, tool, traffic_slice;

CREATE OR REPLACE VIEW cache_metrics_1m AS
SELECT
    toStartOfInterval(ts, INTERVAL 60000 MILLISECOND) AS minute,
    agent, task_type, model, prompt_version, deployment, traffic_slice,
    count() AS calls,
    sum(cache_read_input_tokens) AS cache_read_input_tokens,
    sum(cache_creation_input_tokens) AS cache_creation_input_tokens,
    sum(uncached_input_tokens) AS uncached_input_tokens,
    cache_read_input_tokens / nullIf(cache_read_input_tokens + cache_creation_input_tokens + uncached_input_tokens, 0) AS cache_hit_rate,
    sum(cost_usd) AS cost_usd,
    sum(rate_limited) AS rate_limited,
    sum(is_error) AS errors,
    cache_read_input_tokens AS cache_read_tokens,
    cache_creation_input_tokens AS cache_creation_tokens
FROM llm_calls FINAL
GROUP BY minute, agent, task_type, model, prompt_version, deployment, traffic_slice;
