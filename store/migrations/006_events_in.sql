-- How processors write raw events (processors/rows.py, events_in_row): one row per
-- Kafka message, carrying its events as JSON objects with every field written out in
-- the models' field order, and their extras (unknown fields) apart as maps of field ->
-- JSON. This view is the one definition of an `events` row: the column fields as
-- columns, every other non-null field and then the extras as the `payload` object,
-- the extras once more as a map. Splitting here rather than in Python moves ~3 µs an
-- event from the processor's interpreter thread to ClickHouse's threads.
-- events_in itself keeps nothing (Null engine).
CREATE TABLE IF NOT EXISTS events_in
(
    kafka_partition UInt32,
    kafka_offset    UInt64,
    ingested_at     DateTime64(3, 'UTC'),
    event_objects   Array(String),
    event_extras    Array(Map(String, String))
)
ENGINE = Null;

CREATE MATERIALIZED VIEW IF NOT EXISTS events_in_split TO events AS
WITH
    JSONExtract(event, 'Tuple(event_id String, event_type String, schema_version String, ts String, run_id String, trace_id Nullable(String), span_id Nullable(String), parent_span_id Nullable(String), agent String, agent_version String, task_type String, model String, prompt_version String, deployment String, traffic_slice String, worker_id String)') AS c,
    arrayFilter(field -> field.2 != 'null' AND field.1 NOT IN ('event_id', 'event_type', 'schema_version', 'ts', 'run_id', 'trace_id', 'span_id', 'parent_span_id', 'agent', 'agent_version', 'task_type', 'model', 'prompt_version', 'deployment', 'traffic_slice', 'worker_id'), JSONExtractKeysAndValuesRaw(event)) AS kept,
    arrayConcat(kept, arrayZip(mapKeys(event_extra), mapValues(event_extra))) AS payload_fields
SELECT
    toUUID(c.event_id) AS event_id,
    c.event_type AS event_type,
    c.schema_version AS schema_version,
    parseDateTime64BestEffort(c.ts, 3, 'UTC') AS ts,
    c.run_id AS run_id,
    ifNull(c.trace_id, '') AS trace_id,
    ifNull(c.span_id, '') AS span_id,
    ifNull(c.parent_span_id, '') AS parent_span_id,
    c.agent AS agent,
    c.agent_version AS agent_version,
    c.task_type AS task_type,
    c.model AS model,
    c.prompt_version AS prompt_version,
    c.deployment AS deployment,
    c.traffic_slice AS traffic_slice,
    c.worker_id AS worker_id,
    concat('{', arrayStringConcat(arrayMap(field -> concat(toJSONString(field.1), ':', field.2), payload_fields), ','), '}') AS payload,
    event_extra AS extras,
    kafka_partition,
    kafka_offset,
    ingested_at
FROM events_in
ARRAY JOIN
    event_objects AS event,
    arrayResize(event_extras, length(event_objects)) AS event_extra;
