-- name: top_cost_runs
-- The most expensive closed runs, with what they ended as.
SELECT run_id, agent, outcome, steps, tool_calls, round(cost_usd, 4) AS cost_usd
FROM runs FINAL
WHERE status = 'closed' AND ({agent:String} = '' OR agent = {agent:String})
ORDER BY cost_usd DESC, run_id
LIMIT 10;

-- name: loop_pattern
-- One run's repeated actions: the same tool with the same arguments, and where.
SELECT tool, args_hash, count() AS calls, min(step) AS first_step, max(step) AS last_step
FROM tool_calls FINAL
WHERE run_id = {run_id:String}
GROUP BY tool, args_hash
HAVING calls >= 2
ORDER BY calls DESC, tool;

-- name: outcome_mix_by_prompt_version
-- Outcome mix per prompt version: did a prompt change move failures around?
SELECT prompt_version, outcome, sum(runs) AS runs,
       round(runs / sum(runs) OVER (PARTITION BY prompt_version), 3) AS share
FROM outcomes_1m
WHERE {agent:String} = '' OR agent = {agent:String}
GROUP BY prompt_version, outcome
ORDER BY prompt_version, runs DESC, outcome;

-- name: near_misses_by_tool
-- Timeouts per tool and how many were near-misses (the timeout is set too low).
SELECT tool, sum(calls) AS calls, sum(timeouts) AS timeouts,
       sum(timeouts_known_duration) AS known_durations, sum(near_misses) AS near_misses,
       round(near_misses / nullIf(known_durations, 0), 3) AS near_miss_ratio
FROM tool_metrics_1m
WHERE {agent:String} = '' OR agent = {agent:String}
GROUP BY tool
ORDER BY timeouts DESC, tool;

-- name: cache_hit_rate_by_deployment
-- Prompt-cache hit rate per deployment and prompt version: a silent miss shows as ~0.
SELECT deployment, prompt_version, sum(calls) AS calls,
       round(sum(cache_read_input_tokens) / nullIf(sum(cache_read_input_tokens + cache_creation_input_tokens
             + uncached_input_tokens), 0), 3) AS cache_hit_rate
FROM cache_metrics_1m
WHERE {agent:String} = '' OR agent = {agent:String}
GROUP BY deployment, prompt_version
ORDER BY cache_hit_rate, deployment, prompt_version;
