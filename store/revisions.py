"""Agent revisions (issue 26 item 1, migration 010): the store's half of
:mod:`loopwatch.processors.attribution`. A batch carries revisions as rows of the
pseudo-table :data:`REVISIONS_TABLE`; the sink applies them with one ``INSERT ...
SELECT ... FINAL`` per revised table (their version is ``agent_rank``, so a revised row
replaces the one it revises), after the batch's call rows and before its ``runs`` rows.
"""

from __future__ import annotations

from typing import Any

from clickhouse_connect.driver.client import Client

from loopwatch.ingest.attribution import EXPLICIT, RANKS
from loopwatch.store import tables

#: the batch's "table" of revisions: applied by the sink, never inserted
REVISIONS_TABLE = "agent_revisions"
#: the tables whose rows a revision rewrites (keyed by (ts, event_id), version agent_rank)
REVISED_TABLES = (tables.LLM_CALLS, tables.TOOL_CALLS)

#: one statement per table for a batch's revisions: run i's rows take agents[i] and
#: ranks[i] (the condition is inside the subquery: outside it, REPLACE's aliases would
#: shadow the stored agent and rank)
_REVISE = (
    "INSERT INTO {table} SELECT * REPLACE ("
    "{{agents:Array(String)}}[indexOf({{runs:Array(String)}}, run_id)] AS agent, "
    "{{ranks:Array(UInt8)}}[indexOf({{runs:Array(String)}}, run_id)] AS agent_rank) "
    "FROM (SELECT * FROM {table} FINAL "
    "WHERE ts >= fromUnixTimestamp64Milli({{since:Int64}}, 'UTC') "
    "AND ts <= fromUnixTimestamp64Milli({{until:Int64}}, 'UTC') "
    "AND run_id IN {{runs:Array(String)}} AND agent_rank < {explicit} "
    "AND (agent_rank < {{ranks:Array(UInt8)}}[indexOf({{runs:Array(String)}}, run_id)] "
    "OR agent != {{agents:Array(String)}}[indexOf({{runs:Array(String)}}, run_id)]))"
)


def _checked(row: Any) -> dict[str, Any]:
    """A revision row as the sink takes it (it may come over the store service)."""
    if not isinstance(row, dict) or not isinstance(row.get("run_id"), str) \
            or not isinstance(row.get("agent"), str):
        raise ValueError("an agent revision needs run_id and agent strings")
    numbers = [row.get(name) for name in ("agent_rank", "since_ms", "until_ms")]
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers) \
            or row["agent_rank"] not in RANKS:
        raise ValueError("an agent revision needs an agent_rank 0..4 and times in ms")
    return row


def revise(client: Client, rows: list[Any]) -> None:
    """Apply revisions (rows of :data:`REVISIONS_TABLE`) to the revised tables: one
    statement per table for all of them (a batch of SimpleSpanProcessor traces revises
    most of its runs), over the time span of them all; the last revision of a run in
    the list wins (the pipeline writes one per run per batch)."""
    checked = {row["run_id"]: row for row in (_checked(row) for row in rows)}
    if not checked:
        return
    revisions = list(checked.values())
    parameters = {"runs": [row["run_id"] for row in revisions],
                  "agents": [row["agent"] for row in revisions],
                  "ranks": [row["agent_rank"] for row in revisions],
                  "since": min(row["since_ms"] for row in revisions),
                  "until": max(row["until_ms"] for row in revisions)}
    for table in REVISED_TABLES:
        client.command(_REVISE.format(table=table, explicit=EXPLICIT), parameters=parameters)
