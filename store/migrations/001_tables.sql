-- The five tables written per event store every column with ZSTD(1): against the
-- default LZ4 it halves hex ids and random floats (58 -> 39 compressed bytes per event
-- over the bench's mix) for ~15% more insert CPU in ClickHouse.

-- Raw events: every event kept, for investigation and replay. Prompt and response
-- bodies are not stored, only their hashes and sizes (inside `payload`).
-- ReplacingMergeTree on event_id: a redelivered event collapses into one row.
CREATE TABLE IF NOT EXISTS events
(
    event_id        UUID CODEC(ZSTD(1)),
    event_type      LowCardinality(String) CODEC(ZSTD(1)),
    schema_version  LowCardinality(String) CODEC(ZSTD(1)),
    ts              DateTime64(3, 'UTC') CODEC(ZSTD(1)),
    run_id          String CODEC(ZSTD(1)),
    trace_id        String CODEC(ZSTD(1)),
    span_id         String CODEC(ZSTD(1)),
    parent_span_id  String CODEC(ZSTD(1)),
    agent           LowCardinality(String) CODEC(ZSTD(1)),
    agent_version   LowCardinality(String) CODEC(ZSTD(1)),
    task_type       LowCardinality(String) CODEC(ZSTD(1)),
    model           LowCardinality(String) CODEC(ZSTD(1)),
    prompt_version  LowCardinality(String) CODEC(ZSTD(1)),
    deployment      LowCardinality(String) CODEC(ZSTD(1)),
    traffic_slice   LowCardinality(String) CODEC(ZSTD(1)),
    worker_id       LowCardinality(String) CODEC(ZSTD(1)),
    payload         String CODEC(ZSTD(3)),
    extras          Map(String, String) CODEC(ZSTD(1)),
    kafka_partition UInt32 CODEC(ZSTD(1)),
    kafka_offset    UInt64 CODEC(ZSTD(1)),
    ingested_at     DateTime64(3, 'UTC') CODEC(ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (run_id, event_id);

-- One row per LLM call; cost is recomputed from tokens with the price table.
CREATE TABLE IF NOT EXISTS llm_calls
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
    cache_read_tokens   UInt64 CODEC(ZSTD(1)),
    cache_creation_tokens UInt64 CODEC(ZSTD(1)),
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
    system_prompt_hash  String CODEC(ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (agent, ts, event_id);

-- One row per tool call. near_miss is NULL unless the call timed out and its true
-- duration is known (late_completion_ms).
CREATE TABLE IF NOT EXISTS tool_calls
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
    attempt             UInt16 CODEC(ZSTD(1))
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (agent, tool, ts, event_id);

-- One row per run; the processors rewrite it as the run progresses and when a late
-- label revises it. The highest `version` wins: always read with FINAL.
CREATE TABLE IF NOT EXISTS runs
(
    run_id              String CODEC(ZSTD(1)),
    agent               LowCardinality(String) CODEC(ZSTD(1)),
    agent_version       LowCardinality(String) CODEC(ZSTD(1)),
    task_type           LowCardinality(String) CODEC(ZSTD(1)),
    model               LowCardinality(String) CODEC(ZSTD(1)),
    prompt_version      LowCardinality(String) CODEC(ZSTD(1)),
    deployment          LowCardinality(String) CODEC(ZSTD(1)),
    traffic_slice       LowCardinality(String) CODEC(ZSTD(1)),
    worker_id           LowCardinality(String) CODEC(ZSTD(1)),
    status              LowCardinality(String) CODEC(ZSTD(1)),
    outcome             LowCardinality(String) CODEC(ZSTD(1)),
    terminal_reason     LowCardinality(String) CODEC(ZSTD(1)),
    cap                 LowCardinality(String) CODEC(ZSTD(1)),
    label_source        LowCardinality(String) CODEC(ZSTD(1)),
    started_ts          DateTime64(3, 'UTC') CODEC(ZSTD(1)),
    last_event_ts       DateTime64(3, 'UTC') CODEC(ZSTD(1)),
    closed_ts           Nullable(DateTime64(3, 'UTC')) CODEC(ZSTD(1)),
    steps               UInt32 CODEC(ZSTD(1)),
    llm_calls           UInt32 CODEC(ZSTD(1)),
    tool_calls          UInt32 CODEC(ZSTD(1)),
    tool_errors         UInt32 CODEC(ZSTD(1)),
    llm_errors          UInt32 CODEC(ZSTD(1)),
    input_tokens        UInt64 CODEC(ZSTD(1)),
    output_tokens       UInt64 CODEC(ZSTD(1)),
    cache_read_tokens   UInt64 CODEC(ZSTD(1)),
    cache_creation_tokens UInt64 CODEC(ZSTD(1)),
    cost_usd            Float64 CODEC(ZSTD(1)),
    reported_cost_usd   Float64 CODEC(ZSTD(1)),
    loop_detected       UInt8 CODEC(ZSTD(1)),
    loop_summary        String CODEC(ZSTD(1)),
    version             UInt64 CODEC(ZSTD(1)),
    state               String CODEC(ZSTD(3))
)
ENGINE = ReplacingMergeTree(version)
ORDER BY run_id;

CREATE TABLE IF NOT EXISTS labels
(
    event_id        UUID CODEC(ZSTD(1)),
    ts              DateTime64(3, 'UTC') CODEC(ZSTD(1)),
    run_id          String CODEC(ZSTD(1)),
    agent           LowCardinality(String) CODEC(ZSTD(1)),
    verdict         LowCardinality(String) CODEC(ZSTD(1)),
    label_source    LowCardinality(String) CODEC(ZSTD(1)),
    quality_score   Nullable(Float64) CODEC(ZSTD(1)),
    hallucination   Nullable(UInt8) CODEC(ZSTD(1))
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
