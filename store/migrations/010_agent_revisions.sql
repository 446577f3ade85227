-- OTLP agent attribution (issue 26, item 1): a trace's rows are stored under one agent,
-- whatever the order its spans arrive in. A child span exported before its root is
-- stored under the best agent known then (its own service.name); when the span that
-- decides arrives, the processors revise the trace's earlier rows (docs/otlp.md).
-- A revised row must replace the row it revises, so llm_calls and tool_calls are keyed
-- by what never changes, (ts, event_id), no longer by agent, and the replacement is
-- chosen by `agent_rank`, how authoritative the row's agent is (the version: the most
-- authoritative row wins whatever order the inserts came in, so a redelivered
-- early row cannot undo a revision). The per-minute views read FINAL: one row per
-- call, counted once.
--
-- A sorting key cannot lose a column in place, so each table is rebuilt: a copy under
-- the new key (rows stored before this migration take rank 0: any later claim of
-- their trace revises them), exchanged atomically with the old table, which is then
-- dropped. The migration runner skips the copy and the exchange once the table has
-- the new key (loopwatch/store/schema_versions.py, rebuild_done), so a crash anywhere
-- in between is repaired by running this file again. No materialized view reads or
-- writes these tables, and views resolve them by name: nothing else to recreate.

CREATE TABLE IF NOT EXISTS llm_calls_v010
(
    event_id            UUID CODEC(ZSTD(1)),
    ts                  DateTime64(3, 'UTC') CODEC(ZSTD(1)),
    run_id              String CODEC(ZSTD(1)),
    agent               LowCardinality(String) CODEC(ZSTD(1)),
    task_type           LowCardinality(String) CODEC(ZSTD(1)),
    model               LowCardinality(String) CODEC(ZSTD(1)),
    response_model      LowCardinality(String) CODEC(ZSTD(1)),
    provider            LowCardinality(String) CODEC(ZSTD(1)),
    purpose             LowCardinality(String) CODEC(ZSTD(1)),
    prompt_version      LowCardinality(String) CODEC(ZSTD(1)),
    deployment          LowCardinality(String) CODEC(ZSTD(1)),
    traffic_slice       LowCardinality(String) CODEC(ZSTD(1)),
    step                Nullable(UInt32) CODEC(ZSTD(1)),
    input_tokens        UInt64 CODEC(ZSTD(1)),
    output_tokens       UInt64 CODEC(ZSTD(1)),
    cache_read_input_tokens UInt64 CODEC(ZSTD(1)),
    cache_creation_input_tokens UInt64 CODEC(ZSTD(1)),
    uncached_input_tokens UInt64 CODEC(ZSTD(1)),
    cache_ttl           LowCardinality(String) CODEC(ZSTD(1)),
    token_convention    LowCardinality(String) CODEC(ZSTD(1)),
    cost_usd            Float64 CODEC(ZSTD(1)),
    reported_cost_usd   Nullable(Float64) CODEC(ZSTD(1)),
    cost_mismatch       UInt8 CODEC(ZSTD(1)),
    price_version       LowCardinality(String) CODEC(ZSTD(1)),
    latency_ms          Float64 CODEC(ZSTD(1)),
    ttft_ms             Nullable(Float64) CODEC(ZSTD(1)),
    http_status         UInt16 CODEC(ZSTD(1)),
    error_type          LowCardinality(String) CODEC(ZSTD(1)),
    rate_limited        UInt8 CODEC(ZSTD(1)),
    is_error            UInt8 CODEC(ZSTD(1)),
    attempt             UInt16 CODEC(ZSTD(1)),
    logical_op_id       String CODEC(ZSTD(1)),
    stop_reason         LowCardinality(String) CODEC(ZSTD(1)),
    system_prompt_hash  String CODEC(ZSTD(1)),
    ingested_at         DateTime64(3, 'UTC') DEFAULT now64(3) CODEC(ZSTD(1)),
    agent_rank          UInt8 CODEC(ZSTD(1)),
    cache_read_tokens   UInt64 ALIAS cache_read_input_tokens,
    cache_creation_tokens UInt64 ALIAS cache_creation_input_tokens
)
ENGINE = ReplacingMergeTree(agent_rank)
PARTITION BY toYYYYMM(ts)
ORDER BY (ts, event_id);
INSERT INTO llm_calls_v010 (event_id, ts, run_id, agent, task_type, model, response_model, provider, purpose, prompt_version, deployment, traffic_slice, step, input_tokens, output_tokens, cache_read_input_tokens, cache_creation_input_tokens, uncached_input_tokens, cache_ttl, token_convention, cost_usd, reported_cost_usd, cost_mismatch, price_version, latency_ms, ttft_ms, http_status, error_type, rate_limited, is_error, attempt, logical_op_id, stop_reason, system_prompt_hash, ingested_at, agent_rank)
SELECT event_id, ts, run_id, agent, task_type, model, response_model, provider, purpose, prompt_version, deployment, traffic_slice, step, input_tokens, output_tokens, cache_read_input_tokens, cache_creation_input_tokens, uncached_input_tokens, cache_ttl, token_convention, cost_usd, reported_cost_usd, cost_mismatch, price_version, latency_ms, ttft_ms, http_status, error_type, rate_limited, is_error, attempt, logical_op_id, stop_reason, system_prompt_hash, ingested_at, 0 FROM llm_calls;
EXCHANGE TABLES llm_calls_v010 AND llm_calls;
DROP TABLE IF EXISTS llm_calls_v010;

CREATE TABLE IF NOT EXISTS tool_calls_v010
(
    event_id            UUID CODEC(ZSTD(1)),
    ts                  DateTime64(3, 'UTC') CODEC(ZSTD(1)),
    run_id              String CODEC(ZSTD(1)),
    agent               LowCardinality(String) CODEC(ZSTD(1)),
    task_type           LowCardinality(String) CODEC(ZSTD(1)),
    model               LowCardinality(String) CODEC(ZSTD(1)),
    prompt_version      LowCardinality(String) CODEC(ZSTD(1)),
    deployment          LowCardinality(String) CODEC(ZSTD(1)),
    traffic_slice       LowCardinality(String) CODEC(ZSTD(1)),
    tool                LowCardinality(String) CODEC(ZSTD(1)),
    args_hash           String CODEC(ZSTD(1)),
    step                Nullable(UInt32) CODEC(ZSTD(1)),
    latency_ms          Float64 CODEC(ZSTD(1)),
    timeout_ms          Nullable(Float64) CODEC(ZSTD(1)),
    timed_out           UInt8 CODEC(ZSTD(1)),
    late_completion_ms  Nullable(Float64) CODEC(ZSTD(1)),
    near_miss           Nullable(UInt8) CODEC(ZSTD(1)),
    error_type          LowCardinality(String) CODEC(ZSTD(1)),
    http_status         UInt16 CODEC(ZSTD(1)),
    is_error            UInt8 CODEC(ZSTD(1)),
    result_count        Nullable(UInt32) CODEC(ZSTD(1)),
    result_size_bytes   Nullable(UInt64) CODEC(ZSTD(1)),
    attempt             UInt16 CODEC(ZSTD(1)),
    ingested_at         DateTime64(3, 'UTC') DEFAULT now64(3) CODEC(ZSTD(1)),
    agent_rank          UInt8 CODEC(ZSTD(1))
)
ENGINE = ReplacingMergeTree(agent_rank)
PARTITION BY toYYYYMM(ts)
ORDER BY (ts, event_id);
INSERT INTO tool_calls_v010 (event_id, ts, run_id, agent, task_type, model, prompt_version, deployment, traffic_slice, tool, args_hash, step, latency_ms, timeout_ms, timed_out, late_completion_ms, near_miss, error_type, http_status, is_error, result_count, result_size_bytes, attempt, ingested_at, agent_rank)
SELECT event_id, ts, run_id, agent, task_type, model, prompt_version, deployment, traffic_slice, tool, args_hash, step, latency_ms, timeout_ms, timed_out, late_completion_ms, near_miss, error_type, http_status, is_error, result_count, result_size_bytes, attempt, ingested_at, 0 FROM tool_calls;
EXCHANGE TABLES tool_calls_v010 AND tool_calls;
DROP TABLE IF EXISTS tool_calls_v010;
