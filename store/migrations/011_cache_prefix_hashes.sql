-- The prompt-cache doctor (detectors/advisors/cache.py) asks which part of a call's
-- prefix changed since the previous call: the system prompt (system_prompt_hash, 001),
-- the tool definitions or the re-sent history. The contract gained `tools_hash` and
-- `history_hash` on llm.call (ingest/events.py); their columns start empty for old rows.
ALTER TABLE llm_calls ADD COLUMN IF NOT EXISTS tools_hash String CODEC(ZSTD(1));
ALTER TABLE llm_calls ADD COLUMN IF NOT EXISTS history_hash String CODEC(ZSTD(1));
