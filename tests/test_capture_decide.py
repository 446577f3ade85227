"""Capture decisions when a run's bodies are staged after the run was decided.

The capture topic is consumed apart from the events (and an OTLP exporter sends each
span on its own), so a failed run can be kept before its last parts are staged. Later
passes copy those parts and update the decision's counts; the decision itself (keep,
reason, time) never changes.

Real chdb: the session's in-process store, in a database of this test's own.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
from loopwatch.processors.jobs.capture_decide import decide
from loopwatch.store import tables
from tests.stores import fresh_store

RUN = "late-parts-run"
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
STAGED = ["event_id", "run_id", "agent", "ts", "event_type", "step", "tool", "part",
          "encoding", "hashes", "bytes", "truncated", "redactions", "staged_at"]


def _stage(client: Client, event_id: uuid.UUID, parts: dict[str, str], at: datetime) -> None:
    """One event's parts, each body its own blob, as the capture consumer stages them."""
    client.insert(tables.CAPTURE_STAGING_BLOBS,
                  [[f"h-{body}", "text", body, len(body), at] for body in parts.values()],
                  column_names=["hash", "encoding", "body", "bytes", "staged_at"])
    client.insert(tables.CAPTURE_STAGING,
                  [[event_id, RUN, "a", at, "tool.call", 1, "charge", part, "text",
                    [f"h-{body}"], len(body), 0, 0, at] for part, body in parts.items()],
                  column_names=STAGED)


def test_parts_staged_after_the_decision_are_kept_and_counted(
        local_store: tuple[Settings, Client]) -> None:
    _settings, client = fresh_store(local_store, "late")
    settings = _settings.model_copy(update={"capture": "failures"})
    client.insert(tables.RUNS, [[RUN, "a", "closed", "hard_error", T0, T0, T0, 1]],
                  column_names=["run_id", "agent", "status", "outcome", "started_ts",
                                "last_event_ts", "closed_ts", "version"])
    _stage(client, uuid.uuid4(), {"prompt": "card please", "response": "Done."}, T0)
    first = decide(client, settings, now=T0 + timedelta(seconds=5))
    assert (first.decided, first.kept, first.parts_kept, first.late_runs) == (1, 1, 2, 0)

    _stage(client, uuid.uuid4(), {"args": '{"amount": 12.5}', "output": "declined"},
           T0 + timedelta(seconds=6))
    second = decide(client, settings, now=T0 + timedelta(seconds=10))
    assert (second.decided, second.late_runs) == (0, 1)
    decision = client.query("SELECT keep, reason, parts, bytes, decided_at "
                            "FROM capture_decisions FINAL").result_rows
    decided_at = (T0 + timedelta(seconds=5)).replace(tzinfo=None)  # the client's naive UTC
    assert decision == [(1, "failure:hard_error", 4, 11 + 5 + 16 + 8, decided_at)]
    kept = client.query("SELECT part, hashes FROM capture_parts FINAL ORDER BY ts, part"
                        ).result_rows
    assert kept == [("prompt", ["h-card please"]), ("response", ["h-Done."]),
                    ("args", ['h-{"amount": 12.5}']), ("output", ["h-declined"])]
    assert client.query("SELECT count() FROM capture_blobs FINAL").result_rows == [(4,)]

    third = decide(client, settings, now=T0 + timedelta(seconds=15))
    assert (third.decided, third.late_runs) == (0, 0)
    assert client.query("SELECT count() FROM capture_parts").result_rows == [(4,)]
