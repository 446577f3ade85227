"""The store's table names, one constant each: the migrations create them
(``store/migrations``), and every writer and reader names a table through these, never
by a string of its own (tests/test_layers.py checks both).
"""

from __future__ import annotations

from typing import Final

#: raw events as the processors decoded them (one row per event)
EVENTS: Final = "events"
#: raw Kafka messages as they came in (the processors' own stream of record)
EVENTS_IN: Final = "events_in"
#: every event of ``events_in`` once, parsed into typed columns (a Null table the generated
#: views create and read: store/event_views.py; not a migration's)
EVENTS_PARSED: Final = "events_parsed"
#: what generated schema a store has: name -> the sha256 of its text (a record, like
#: ``schema_migrations``: created by store/event_views.py, not a migration)
GENERATED_VIEWS: Final = "generated_views"
#: one row per run, its last write (labelled outcome, cost, steps)
RUNS: Final = "runs"
LLM_CALLS: Final = "llm_calls"
TOOL_CALLS: Final = "tool_calls"
LABELS: Final = "labels"
ANNOTATIONS: Final = "annotations"
#: refused input, with the reason (``loopwatch deadletters``)
DEAD_LETTERS: Final = "dead_letters"
ALERTS: Final = "alerts"
RULE_EVALUATIONS: Final = "rule_evaluations"
PIPELINE_GAUGES: Final = "pipeline_gauges"
#: capture (docs/capture.md): staged by the processors, kept by the capture decision
CAPTURE_STAGING: Final = "capture_staging"
CAPTURE_STAGING_BLOBS: Final = "capture_staging_blobs"
CAPTURE_PARTS: Final = "capture_parts"
CAPTURE_BLOBS: Final = "capture_blobs"
CAPTURE_DECISIONS: Final = "capture_decisions"

#: every base table above
TABLES: Final = (EVENTS, EVENTS_IN, RUNS, LLM_CALLS, TOOL_CALLS, LABELS, ANNOTATIONS,
                 DEAD_LETTERS, ALERTS, RULE_EVALUATIONS, PIPELINE_GAUGES, CAPTURE_STAGING,
                 CAPTURE_STAGING_BLOBS, CAPTURE_PARTS, CAPTURE_BLOBS, CAPTURE_DECISIONS)
