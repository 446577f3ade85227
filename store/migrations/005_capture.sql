-- Capture (docs/capture.md): the bodies behind a run's steps, for replay.
-- Every captured part lands in the staging tables first; when the run's capture
-- decision is made (loopwatch/capture/decide.py) the parts of kept runs are copied
-- into capture_parts / capture_blobs and the rest expire with the staging TTL.
-- Bodies are stored once per content hash (sha256 over encoding, NUL, body).

CREATE TABLE IF NOT EXISTS capture_staging_blobs
(
    hash        String,
    encoding    LowCardinality(String),
    body        String CODEC(ZSTD(6)),
    bytes       UInt32,
    staged_at   DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree
ORDER BY hash
TTL toDateTime(staged_at) + INTERVAL 7 DAY;

CREATE TABLE IF NOT EXISTS capture_staging
(
    event_id    UUID,
    run_id      String,
    agent       LowCardinality(String),
    ts          DateTime64(3, 'UTC'),
    event_type  LowCardinality(String),
    step        Nullable(UInt32),
    tool        String,
    part        LowCardinality(String),
    encoding    LowCardinality(String),
    hashes      Array(String),
    bytes       UInt64,
    truncated   UInt8,
    redactions  UInt32,
    staged_at   DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree
ORDER BY (run_id, event_id, part)
TTL toDateTime(staged_at) + INTERVAL 7 DAY;

CREATE TABLE IF NOT EXISTS capture_blobs
(
    hash        String,
    encoding    LowCardinality(String),
    body        String CODEC(ZSTD(6)),
    bytes       UInt32,
    kept_at     DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(kept_at)
ORDER BY hash;

CREATE TABLE IF NOT EXISTS capture_parts
(
    event_id    UUID,
    run_id      String,
    agent       LowCardinality(String),
    ts          DateTime64(3, 'UTC'),
    event_type  LowCardinality(String),
    step        Nullable(UInt32),
    tool        String,
    part        LowCardinality(String),
    encoding    LowCardinality(String),
    hashes      Array(String),
    bytes       UInt64,
    truncated   UInt8,
    redactions  UInt32,
    kept_at     DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (run_id, event_id, part);

-- One decision per run: keep its payloads or let them expire. Re-deciding is harmless
-- (the newest row wins, and a run is never un-kept).
CREATE TABLE IF NOT EXISTS capture_decisions
(
    run_id      String,
    agent       LowCardinality(String),
    outcome     LowCardinality(String),
    keep        UInt8,
    reason      String,
    parts       UInt32,
    bytes       UInt64,
    decided_at  DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(decided_at)
ORDER BY run_id;
