-- loopwatch's own health, sampled by the process that runs the processors: consumer lag
-- (messages between the group's committed offsets and the end of the events topic),
-- events processed, store retries. Rules read it on the wall clock.
CREATE TABLE IF NOT EXISTS pipeline_gauges
(
    ts      DateTime64(3, 'UTC'),
    name    LowCardinality(String),
    value   Float64
)
ENGINE = MergeTree
ORDER BY (name, ts)
TTL toDateTime(ts) + INTERVAL 30 DAY;
