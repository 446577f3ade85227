"""One agent for every row of a trace: the processors' half of
:mod:`loopwatch.ingest.attribution`.

Where "trace -> best agent so far" lives: in the run's state (a trace is a run, and a
run's events come in order on one partition, to one processor), which is changelogged
and kept in ``runs.state`` like the rest of it. The receiver stays stateless: each
event carries the claim its request could make, and here

- a claim better than the run's replaces it
  (:meth:`loopwatch.ingest.attribution.Claim.beats`), and the run's rows stored before
  are revised: one ``INSERT ... SELECT`` per table
  (:func:`loopwatch.store.revisions.revise`) rewrites the run's ``llm_calls`` /
  ``tool_calls`` rows under the new agent with the new rank, which, being the tables'
  version, replaces them (migration 010): the per-minute views read ``FINAL`` and count
  each call once;
- any other event is stored under the run's agent, with the run's rank.

A revision is a row of the pseudo-table
:data:`loopwatch.store.revisions.REVISIONS_TABLE` in the batch that raised the claim:
the sink applies it after the batch's call rows and before its ``runs`` rows
(:func:`loopwatch.store.sink.write_order`), so a crash before the ``runs`` row (which
holds the new claim) re-delivers the batch and revises again; a revision run twice
writes the same rows. A redelivered row of the old claim loses to the revised one
whatever order they are inserted in (a lower version), and is stamped with the run's
claim anyway. Rows the emitter named (rank ``EXPLICIT``) are never revised.

A run first folded since the last settle has no row stored yet: every row of its so far
is in the write that settle makes, so a better claim patches those rows in place
(:func:`patch_rows`) instead of a revision statement, which costs the store a ``FINAL``
read of both tables per batch (27-50 ms of CPU each, for one run as for many). A run
first folded in the settle before has all its stored rows in that settle's write, which
the pipeline keeps until the next settle: a better claim writes copies of them again
under it (:func:`revised_copies`), again with no statement (an OTLP trace whose root
comes in the next export request, the common case of a burst, raised one per table in
most batches). The tables end the same: a revision inserts the patched rows beside the
old ones, which then lose to them.
"""

from __future__ import annotations

from typing import Any

from loopwatch.ingest.attribution import EXPLICIT, Claim
from loopwatch.ingest.events import EventBase
from loopwatch.processors.runs import RunState
from loopwatch.store.revisions import REVISIONS_TABLE


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


#: a call row and its table (``llm_calls`` or ``tool_calls``)
CallRow = tuple[str, dict[str, Any]]


def _revised(state: RunState, row: dict[str, Any]) -> bool:
    """Whether a revision to the run's claim rewrites ``row`` (the statement's
    condition: below :data:`EXPLICIT`, and of a lower rank or another agent)."""
    rank = row["agent_rank"]
    return bool(rank < EXPLICIT and (rank < state.agent_rank or row["agent"] != state.agent))


def patch_rows(state: RunState, call_rows: list[dict[str, Any]]) -> None:
    """What a :func:`revision_row` makes the store do, done to call rows not written
    yet: a run first folded in this settle's batch has no row stored before it, so its
    rows below :data:`EXPLICIT` take the run's claim here, and no statement is needed
    (every row's time is inside the run's span, which bounds the revision)."""
    for row in call_rows:
        if _revised(state, row):
            row["agent"] = state.agent
            row["agent_rank"] = state.agent_rank


def revised_copies(state: RunState, stored: list[CallRow]) -> list[CallRow]:
    """What a :func:`revision_row` makes the store insert, built from the rows it
    would read: copies of the ``stored`` rows it rewrites, under the run's claim. The
    rows themselves are left as they are (a write may still be encoding them).

    >>> from loopwatch.processors.runs import RunState
    >>> state = RunState(run_id="t", partition=0, agent="bot", agent_rank=3)
    >>> rows = [("llm_calls", {"agent": "svc", "agent_rank": 0}),
    ...         ("tool_calls", {"agent": "me", "agent_rank": EXPLICIT})]
    >>> revised_copies(state, rows), rows[0][1]
    ([('llm_calls', {'agent': 'bot', 'agent_rank': 3})], {'agent': 'svc', 'agent_rank': 0})
    """
    copies = []
    for table, row in stored:
        if _revised(state, row):
            copy = dict(row)
            copy["agent"] = state.agent
            copy["agent_rank"] = state.agent_rank
            copies.append((table, copy))
    return copies


def revision_row(state: RunState) -> dict[str, Any]:
    """The revision of a run's stored rows to its claim: the run's event-time span
    bounds the rows to read (the tables are ordered by time); 1 ms either side covers
    times ClickHouse stored to the millisecond from finer ones."""
    return {"run_id": state.run_id, "agent": state.agent, "agent_rank": state.agent_rank,
            "since_ms": min(state.first_ms, state.last_ms) - 1, "until_ms": state.last_ms + 1}


__all__ = ["REVISIONS_TABLE", "CallRow", "attribute", "patch_rows", "revised_copies",
           "revision_row", "run_claim"]
