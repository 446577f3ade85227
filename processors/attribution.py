"""One agent for every row of a trace: the processors' half of :mod:`ingest.attribution`.

Where "trace -> best agent so far" lives: in the run's state (a trace is a run, and a
run's events come in order on one partition, to one processor), which is changelogged
and kept in ``runs.state`` like the rest of it. The receiver stays stateless: each
event carries the claim its request could make, and here

- a claim better than the run's replaces it (:meth:`ingest.attribution.Claim.beats`),
  and the run's rows stored before are revised: one ``INSERT ... SELECT`` per table
  (:func:`revise`) rewrites the run's ``llm_calls`` / ``tool_calls`` rows under the new
  agent with the new rank, which, being the tables' version, replaces them (migration
  010): the per-minute views read ``FINAL`` and count each call once;
- any other event is stored under the run's agent, with the run's rank.

A revision is a row of the pseudo-table :data:`REVISIONS_TABLE` in the batch that
raised the claim: the sink applies it after the batch's call rows and before its
``runs`` rows (:func:`processors.sink.write_order`), so a crash before the ``runs`` row
(which holds the new claim) re-delivers the batch and revises again; a revision run
twice writes the same rows. A redelivered row of the old claim loses to the revised
one whatever order they are inserted in (a lower version), and is stamped with the
run's claim anyway. Rows the emitter named (rank ``EXPLICIT``) are never revised.
"""

from __future__ import annotations

from typing import Any

from clickhouse_connect.driver.client import Client

from ingest.attribution import EXPLICIT, RANKS, Claim
from ingest.events import EventBase
from processors.runs import RunState

#: the batch's "table" of revisions: applied by the sink, never inserted
REVISIONS_TABLE = "agent_revisions"
#: the tables whose rows a revision rewrites (keyed by (ts, event_id), version agent_rank)
REVISED_TABLES = ("llm_calls", "tool_calls")

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


def run_claim(state: RunState) -> Claim | None:
    """The run's best claim so far; None for a run no claim reached (an SDK run)."""
    if state.agent_rank < 0:
        return None
    return Claim(state.agent, state.agent_rank, state.agent_named_at)


def attribute(state: RunState, event: EventBase, claim: Claim
              ) -> tuple[EventBase, int, bool]:
    """(the event as stored, its rows' ``agent_rank``, whether the run's stored rows
    must be revised) for an event making ``claim`` on its run."""
    current = run_claim(state)
    if current is None or claim.beats(current):
        state.agent = claim.agent
        state.agent_rank = claim.rank
        state.agent_named_at = claim.named_at
        # a run with events but no claim: folded by a build before claims (an upgrade)
        return event, claim.rank, current is not None or state.version > 0
    if claim.rank == EXPLICIT:
        return event, EXPLICIT, False
    if event.agent != current.agent:
        event = event.model_copy(update={"agent": current.agent})
    return event, current.rank, False


def revision_row(state: RunState) -> dict[str, Any]:
    """The revision of a run's stored rows to its claim: the run's event-time span
    bounds the rows to read (the tables are ordered by time); 1 ms either side covers
    times ClickHouse stored to the millisecond from finer ones."""
    return {"run_id": state.run_id, "agent": state.agent, "agent_rank": state.agent_rank,
            "since_ms": min(state.first_ms, state.last_ms) - 1, "until_ms": state.last_ms + 1}


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
