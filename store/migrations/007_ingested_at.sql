-- Retention counts from when loopwatch stored a row (`ingested_at`), not from the
-- event's own time: imported history is kept for its retention too, and no event time
-- the contract accepts (1900 .. 2299) can expire a row at once. The TTLs are set by
-- loopwatch/store/retention.py on this column, as DateTime64 arithmetic (no 32-bit
-- `toDateTime`, which wraps: 2250 became 1978, 1969-12-31 23:59:59.999 became 2106).
--
-- Writers stamp the column (processors/rows.py, events_in's view); the DEFAULT covers
-- any writer that leaves it out. Rows stored before this migration get the time of the
-- upgrade (MATERIALIZE COLUMN writes the DEFAULT into every existing part once, so it
-- is not re-evaluated at each read or merge): they are kept a full retention from then.
-- `events` has carried ingested_at since the first release; it gains the DEFAULT.
ALTER TABLE events MODIFY COLUMN ingested_at DEFAULT now64(3);

ALTER TABLE llm_calls ADD COLUMN IF NOT EXISTS ingested_at DateTime64(3, 'UTC') DEFAULT now64(3) CODEC(ZSTD(1));
ALTER TABLE llm_calls MATERIALIZE COLUMN ingested_at SETTINGS mutations_sync = 2;

ALTER TABLE tool_calls ADD COLUMN IF NOT EXISTS ingested_at DateTime64(3, 'UTC') DEFAULT now64(3) CODEC(ZSTD(1));
ALTER TABLE tool_calls MATERIALIZE COLUMN ingested_at SETTINGS mutations_sync = 2;

ALTER TABLE runs ADD COLUMN IF NOT EXISTS ingested_at DateTime64(3, 'UTC') DEFAULT now64(3) CODEC(ZSTD(1));
ALTER TABLE runs MATERIALIZE COLUMN ingested_at SETTINGS mutations_sync = 2;

ALTER TABLE labels ADD COLUMN IF NOT EXISTS ingested_at DateTime64(3, 'UTC') DEFAULT now64(3) CODEC(ZSTD(1));
ALTER TABLE labels MATERIALIZE COLUMN ingested_at SETTINGS mutations_sync = 2;

ALTER TABLE annotations ADD COLUMN IF NOT EXISTS ingested_at DateTime64(3, 'UTC') DEFAULT now64(3) CODEC(ZSTD(1));
ALTER TABLE annotations MATERIALIZE COLUMN ingested_at SETTINGS mutations_sync = 2;

-- The TTLs written in their own migrations, on columns stamped with the wall clock:
-- the same DateTime64 arithmetic, so they too never wrap.
ALTER TABLE pipeline_gauges MODIFY TTL ts + INTERVAL 30 DAY;
ALTER TABLE capture_staging_blobs MODIFY TTL staged_at + INTERVAL 7 DAY;
ALTER TABLE capture_staging MODIFY TTL staged_at + INTERVAL 7 DAY;
