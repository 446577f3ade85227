-- Per-minute buckets for every event time the contract accepts (1900 .. 2299).
-- toStartOfMinute returns a 32-bit DateTime: it clamped 1900 to 1970-01-01 00:00 and
-- 2250 to 2106-02-07 06:28:15, and with extended results it still put
-- 1969-12-31 23:59:59.999 in the minute 1970-01-01 00:00. toStartOfInterval over a
-- DateTime64 with a millisecond interval is exact over the whole range; `minute` is
-- now DateTime64(3, 'UTC'). Views hold no data, so a changed view replaces the old
-- one (002's definitions otherwise unchanged; run_metrics_1m reads outcomes_1m).

CREATE OR REPLACE VIEW outcomes_1m AS
SELECT
    toStartOfInterval(closed_ts, INTERVAL 60000 MILLISECOND) AS minute,
    agent, task_type, model, prompt_version, deployment, traffic_slice,
    outcome,
    count() AS runs,
    sum(cost_usd) AS cost_usd,
    cost_usd / runs AS mean_cost_usd
FROM runs FINAL
WHERE status = 'closed'
GROUP BY minute, agent, task_type, model, prompt_version, deployment, traffic_slice, outcome;

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
    quantileTDigest(0.99)(latency_ms) AS latency_p99_ms
FROM tool_calls FINAL
GROUP BY minute, agent, task_type, tool, traffic_slice;

CREATE OR REPLACE VIEW cache_metrics_1m AS
SELECT
    toStartOfInterval(ts, INTERVAL 60000 MILLISECOND) AS minute,
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
