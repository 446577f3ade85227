-- Per-minute metrics, computed at query time from deduplicated rows (FINAL), so a
-- redelivered event or a reprocessed batch can never be counted twice, and a late
-- `wrong` label revises the minute its run closed in. Ratios with no denominator
-- are NULL. Aggregate over several buckets as sum(numerator) / sum(denominator).

-- Outcome mix and cost per outcome. A run belongs to the minute it closed.
CREATE OR REPLACE VIEW outcomes_1m AS
SELECT
    toStartOfMinute(closed_ts) AS minute,
    agent, task_type, model, prompt_version, deployment, traffic_slice,
    outcome,
    count() AS runs,
    sum(cost_usd) AS cost_usd,
    cost_usd / runs AS mean_cost_usd
FROM runs FINAL
WHERE status = 'closed'
GROUP BY minute, agent, task_type, model, prompt_version, deployment, traffic_slice, outcome;

-- Silent-failure ratio with the exception rate beside it, and cost per successful run
-- (all spend, failures included, over the runs that succeeded). `unknown` (imported
-- without a verdict) stays out of every ratio.
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

-- Per tool: timeout rate and near-miss ratio (timeouts whose true duration was within
-- the near-miss factor of the configured timeout, over timeouts with a known duration).
CREATE OR REPLACE VIEW tool_metrics_1m AS
SELECT
    toStartOfMinute(ts) AS minute,
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
    quantileTDigest(0.99)(latency_ms) AS latency_p99_ms
FROM tool_calls FINAL
GROUP BY minute, agent, task_type, tool, traffic_slice;

-- Prompt-cache hit rate = cache_read / (cache_read + cache_creation + uncached input).
CREATE OR REPLACE VIEW cache_metrics_1m AS
SELECT
    toStartOfMinute(ts) AS minute,
    agent, task_type, model, prompt_version, deployment, traffic_slice,
    count() AS calls,
    sum(cache_read_tokens) AS cache_read_tokens,
    sum(cache_creation_tokens) AS cache_creation_tokens,
    sum(uncached_input_tokens) AS uncached_input_tokens,
    cache_read_tokens / nullIf(cache_read_tokens + cache_creation_tokens + uncached_input_tokens, 0)
        AS cache_hit_rate,
    sum(cost_usd) AS cost_usd,
    sum(rate_limited) AS rate_limited,
    sum(is_error) AS errors
FROM llm_calls FINAL
GROUP BY minute, agent, task_type, model, prompt_version, deployment, traffic_slice;
