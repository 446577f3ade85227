-- The record of generated schema: the views that parse events_in into events,
-- llm_calls, tool_calls and labels are rendered from the event contract, the price
-- table and the settings (loopwatch/store/event_views.py), not written here, so that
-- a new price table or near-miss factor changes them without a migration. Each start
-- renders them and, when the text's sha256 differs from the last one recorded here,
-- drops and re-creates them (and, the first time, migration 006's events_in_split).
CREATE TABLE IF NOT EXISTS generated_views
(
    name          String,
    content_hash  String,
    applied_at    DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(applied_at)
ORDER BY name;
