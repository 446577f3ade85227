-- The prompt-cache token columns take the SDK's names (ingest/sdk.py
-- `cache_read_input_tokens` / `cache_creation_input_tokens`, after OTel's
-- `gen_ai.usage.cache_read.input_tokens`): until now the SDK said one thing and the
-- tables another. RENAME COLUMN only rewrites metadata, so the upgrade is instant.
-- The old names stay one release as ALIAS columns over the new ones (read-only, left
-- out of SELECT *), so saved queries keep working; they go in a later migration.
-- A RENAME whose new name exists is done: the migration runner skips it (see
-- loopwatch/store/schema_versions.py), so this file can run again after a crash.
-- No materialized view reads these columns (events_in_split writes `events`, whose
-- payload carries the SDK's names already): nothing to drop and recreate.
ALTER TABLE llm_calls RENAME COLUMN IF EXISTS cache_read_tokens TO cache_read_input_tokens;
ALTER TABLE llm_calls RENAME COLUMN IF EXISTS cache_creation_tokens TO cache_creation_input_tokens;
ALTER TABLE llm_calls ADD COLUMN IF NOT EXISTS cache_read_tokens UInt64 ALIAS cache_read_input_tokens;
ALTER TABLE llm_calls ADD COLUMN IF NOT EXISTS cache_creation_tokens UInt64 ALIAS cache_creation_input_tokens;

ALTER TABLE runs RENAME COLUMN IF EXISTS cache_read_tokens TO cache_read_input_tokens;
ALTER TABLE runs RENAME COLUMN IF EXISTS cache_creation_tokens TO cache_creation_input_tokens;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS cache_read_tokens UInt64 ALIAS cache_read_input_tokens;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS cache_creation_tokens UInt64 ALIAS cache_creation_input_tokens;

-- The per-minute view reads the new names; it answers under both for the same release.
CREATE OR REPLACE VIEW cache_metrics_1m AS
SELECT
    toStartOfInterval(ts, INTERVAL 60000 MILLISECOND) AS minute,
    agent, task_type, model, prompt_version, deployment, traffic_slice,
    count() AS calls,
    sum(cache_read_input_tokens) AS cache_read_input_tokens,
    sum(cache_creation_input_tokens) AS cache_creation_input_tokens,
    sum(uncached_input_tokens) AS uncached_input_tokens,
    cache_read_input_tokens / nullIf(cache_read_input_tokens + cache_creation_input_tokens
        + uncached_input_tokens, 0) AS cache_hit_rate,
    sum(cost_usd) AS cost_usd,
    sum(rate_limited) AS rate_limited,
    sum(is_error) AS errors,
    cache_read_input_tokens AS cache_read_tokens,
    cache_creation_input_tokens AS cache_creation_tokens
FROM llm_calls FINAL
GROUP BY minute, agent, task_type, model, prompt_version, deployment, traffic_slice;
