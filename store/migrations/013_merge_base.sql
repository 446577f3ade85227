-- Fewer, wider merges for the tables every event writes (issue #27). ClickHouse's merge
-- selector merges a range of parts once their summed size is `merge_selector_base`
-- times the largest (default 5), counting each part 5 MB bigger than it is, so the
-- 1-3 MB parts of 100k-event inserts were merged every 3-5 inserts: over 2M bench
-- events each row was rewritten 0.9 (events) to 2.4 (tool_calls) times. With base 10
-- each row is rewritten 0.36 times, and storing those 2M events costs 0.79 of the CPU
-- (median 15.3 -> 12.1 µs an event; docs/performance.md). The price is more parts to
-- read: up to ~10 per level instead of ~4 (`runs FINAL` plus an `llm_calls` rollup over
-- 2M events 17-19 -> 31-34 ms).
ALTER TABLE events MODIFY SETTING merge_selector_base = 10;
ALTER TABLE llm_calls MODIFY SETTING merge_selector_base = 10;
ALTER TABLE tool_calls MODIFY SETTING merge_selector_base = 10;
ALTER TABLE labels MODIFY SETTING merge_selector_base = 10;
ALTER TABLE runs MODIFY SETTING merge_selector_base = 10;
