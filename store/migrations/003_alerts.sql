-- Alert history: one row per alert episode (fingerprint, started_at), rewritten at every
-- transition (pending -> firing -> resolved); the highest version wins, read with FINAL.
CREATE TABLE IF NOT EXISTS alerts
(
    fingerprint     String,
    started_at      DateTime64(3, 'UTC'),
    rule            LowCardinality(String),
    severity        LowCardinality(String),
    state           LowCardinality(String),
    labels          Map(String, String),
    summary         String,
    playbook        LowCardinality(String),
    value           Float64,
    fired_at        Nullable(DateTime64(3, 'UTC')),
    resolved_at     Nullable(DateTime64(3, 'UTC')),
    evidence        String CODEC(ZSTD(3)),
    link            String,
    version         UInt64,
    updated_at      DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(version)
ORDER BY (fingerprint, started_at);

-- The latest evaluation of every rule and label set, including the ones that are not
-- firing because they lack samples or history ("waiting for a baseline").
CREATE TABLE IF NOT EXISTS rule_evaluations
(
    rule            LowCardinality(String),
    labels          Map(String, String),
    state           LowCardinality(String),
    value           Float64,
    samples         Float64,
    detail          String,
    evaluated_at    DateTime64(3, 'UTC'),
    event_time      DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(evaluated_at)
ORDER BY (rule, labels);
