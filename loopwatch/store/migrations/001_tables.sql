-- Raw events: every event kept, for investigation and replay. Prompt and response
-- bodies are not stored, only their hashes and sizes (inside `payload`).
-- ReplacingMergeTree on event_id: a redelivered event collapses into one row.
CREATE TABLE IF NOT EXISTS events
(
    event_id        UUID,
    event_type      LowCardinality(String),
    schema_version  LowCardinality(String),
    ts              DateTime64(3, 'UTC'),
    run_id          String,
    trace_id        String,
    span_id         String,
    parent_span_id  String,
    agent           LowCardinality(String),
    agent_version   LowCardinality(String),
    task_type       LowCardinality(String),
    model           LowCardinality(String),
    prompt_version  LowCardinality(String),
    deployment      LowCardinality(String),
    traffic_slice   LowCardinality(String),
    worker_id       LowCardinality(String),
    payload         String CODEC(ZSTD(3)),
    extras          Map(String, String),
    kafka_partition UInt32,
    kafka_offset    UInt64,
    ingested_at     DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (run_id, event_id);

-- One row per LLM call; cost is recomputed from tokens with the price table.
CREATE TABLE IF NOT EXISTS llm_calls
(
    event_id            UUID,
    ts                  DateTime64(3, 'UTC'),
    run_id              String,
    agent               LowCardinality(String),
    task_type           LowCardinality(String),
    model               LowCardinality(String),
    response_model      LowCardinality(String),
    provider            LowCardinality(String),
    purpose             LowCardinality(String),
    prompt_version      LowCardinality(String),
    deployment          LowCardinality(String),
    traffic_slice       LowCardinality(String),
    step                Nullable(UInt32),
    input_tokens        UInt64,
    output_tokens       UInt64,
    cache_read_tokens   UInt64,
    cache_creation_tokens UInt64,
    uncached_input_tokens UInt64,
    cache_ttl           LowCardinality(String),
    token_convention    LowCardinality(String),
    cost_usd            Float64,
    reported_cost_usd   Nullable(Float64),
    cost_mismatch       UInt8,
    price_version       LowCardinality(String),
    latency_ms          Float64,
    ttft_ms             Nullable(Float64),
    http_status         UInt16,
    error_type          LowCardinality(String),
    rate_limited        UInt8,
    is_error            UInt8,
    attempt             UInt16,
    logical_op_id       String,
    stop_reason         LowCardinality(String),
    system_prompt_hash  String
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (agent, ts, event_id);

-- One row per tool call. near_miss is NULL unless the call timed out and its true
-- duration is known (late_completion_ms).
CREATE TABLE IF NOT EXISTS tool_calls
(
    event_id            UUID,
    ts                  DateTime64(3, 'UTC'),
    run_id              String,
    agent               LowCardinality(String),
    task_type           LowCardinality(String),
    model               LowCardinality(String),
    prompt_version      LowCardinality(String),
    deployment          LowCardinality(String),
    traffic_slice       LowCardinality(String),
    tool                LowCardinality(String),
    args_hash           String,
    step                Nullable(UInt32),
    latency_ms          Float64,
    timeout_ms          Nullable(Float64),
    timed_out           UInt8,
    late_completion_ms  Nullable(Float64),
    near_miss           Nullable(UInt8),
    error_type          LowCardinality(String),
    http_status         UInt16,
    is_error            UInt8,
    result_count        Nullable(UInt32),
    result_size_bytes   Nullable(UInt64),
    attempt             UInt16
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (agent, tool, ts, event_id);

-- One row per run; the processors rewrite it as the run progresses and when a late
-- label revises it. The highest `version` wins: always read with FINAL.
CREATE TABLE IF NOT EXISTS runs
(
    run_id              String,
    agent               LowCardinality(String),
    agent_version       LowCardinality(String),
    task_type           LowCardinality(String),
    model               LowCardinality(String),
    prompt_version      LowCardinality(String),
    deployment          LowCardinality(String),
    traffic_slice       LowCardinality(String),
    worker_id           LowCardinality(String),
    status              LowCardinality(String),
    outcome             LowCardinality(String),
    terminal_reason     LowCardinality(String),
    cap                 LowCardinality(String),
    label_source        LowCardinality(String),
    started_ts          DateTime64(3, 'UTC'),
    last_event_ts       DateTime64(3, 'UTC'),
    closed_ts           Nullable(DateTime64(3, 'UTC')),
    steps               UInt32,
    llm_calls           UInt32,
    tool_calls          UInt32,
    tool_errors         UInt32,
    llm_errors          UInt32,
    input_tokens        UInt64,
    output_tokens       UInt64,
    cache_read_tokens   UInt64,
    cache_creation_tokens UInt64,
    cost_usd            Float64,
    reported_cost_usd   Float64,
    loop_detected       UInt8,
    loop_summary        String,
    version             UInt64,
    state               String CODEC(ZSTD(3))
)
ENGINE = ReplacingMergeTree(version)
ORDER BY run_id;

CREATE TABLE IF NOT EXISTS labels
(
    event_id        UUID,
    ts              DateTime64(3, 'UTC'),
    run_id          String,
    agent           LowCardinality(String),
    verdict         LowCardinality(String),
    label_source    LowCardinality(String),
    quality_score   Nullable(Float64),
    hallucination   Nullable(UInt8)
)
ENGINE = ReplacingMergeTree
ORDER BY (run_id, event_id);

CREATE TABLE IF NOT EXISTS annotations
(
    event_id        UUID,
    ts              DateTime64(3, 'UTC'),
    kind            LowCardinality(String),
    agent           LowCardinality(String),
    deployment      LowCardinality(String),
    model           LowCardinality(String),
    prompt_version  LowCardinality(String),
    old_value       String,
    new_value       String,
    actor           String,
    message         String
)
ENGINE = ReplacingMergeTree
ORDER BY (ts, event_id);

-- Input that could not become an event. `id` is derived from where it was read, so
-- reading the same message twice leaves one row; `replayed_at` is set by dlq replay.
CREATE TABLE IF NOT EXISTS dead_letters
(
    id              String,
    received_at     DateTime64(3, 'UTC'),
    source          String,
    reason          String,
    run_id          String,
    payload         String CODEC(ZSTD(3)),
    replayed_at     Nullable(DateTime64(3, 'UTC')),
    version         UInt64
)
ENGINE = ReplacingMergeTree(version)
ORDER BY id;
