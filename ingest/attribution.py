"""How authoritative an event's agent name is: the claim a span makes on its trace's agent.

An OTLP receiver sees one export request at a time, and a trace's spans arrive in any
order, over many requests (``SimpleSpanProcessor`` exports each child before its root).
So the receiver states, with every event it maps, where the event's agent came from
(its *rank*), and the processors, which see every event of a run (a trace) in order on
one partition, keep the run's best claim and store every row of the run under it,
revising the rows stored before a better claim arrived (docs/otlp.md).

Ranks, most authoritative last (``agent_rank`` in ``llm_calls`` and ``tool_calls``):

- :data:`CHILD_SERVICE`: the span's own resource ``service.name``, its root not seen;
- :data:`ROOT_SERVICE`: the root span's resource ``service.name``;
- :data:`SPAN_AGENT_NAME`: ``gen_ai.agent.name`` of a span that is not the root;
  between two of them, the span that started first wins (an agent span starts before
  the sub-agents it calls), so the winner does not depend on batching;
- :data:`ROOT_AGENT_NAME`: ``gen_ai.agent.name`` of the root span;
- :data:`EXPLICIT`: ``loopwatch.agent`` set on the root span or its resource: it
  decides the trace. Set on another span it names that span's rows only, which make
  no claim; nor does any event of another source (the SDK's, an import's): their
  emitter named the agent, they are stored at this rank and never revised.

The claim travels as two extras of the event, :data:`RANK_EXTRA` and
:data:`NAMED_AT_EXTRA` (the start of the span that named the agent, ns, for rank
:data:`SPAN_AGENT_NAME`; else 0). A value that is not a rank is no claim at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHILD_SERVICE = 0
ROOT_SERVICE = 1
SPAN_AGENT_NAME = 2
ROOT_AGENT_NAME = 3
EXPLICIT = 4
RANKS = range(CHILD_SERVICE, EXPLICIT + 1)

RANK_EXTRA = "otel_agent_rank"
NAMED_AT_EXTRA = "otel_agent_named_at"


@dataclass(frozen=True, slots=True)
class Claim:
    """An agent name and how authoritative it is."""

    agent: str
    rank: int
    named_at: int = 0

    def beats(self, other: Claim) -> bool:
        """Whether this claim replaces ``other`` as its run's agent.

        >>> Claim("bot", ROOT_AGENT_NAME).beats(Claim("svc", ROOT_SERVICE))
        True
        >>> outer = Claim("support", SPAN_AGENT_NAME, 25)
        >>> inner = Claim("helper", SPAN_AGENT_NAME, 30)
        >>> outer.beats(inner), inner.beats(outer), outer.beats(outer)
        (True, False, False)
        >>> Claim("svc-b", CHILD_SERVICE).beats(Claim("svc-a", CHILD_SERVICE))
        False
        """
        if self.rank != other.rank:
            return self.rank > other.rank
        if self.rank == SPAN_AGENT_NAME:
            return (self.named_at, self.agent) < (other.named_at, other.agent)
        return False


def extras(rank: int, named_at: int = 0) -> dict[str, int]:
    """The event fields that carry a claim (the mapper adds them to every event)."""
    return {RANK_EXTRA: rank, NAMED_AT_EXTRA: named_at}


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def claim_of(event: Any) -> Claim | None:
    """The claim an event makes, or None when it makes none (an SDK event, or extras
    that are no rank: a hostile or broken producer cannot take a run's agent so).

    >>> from loopwatch.ingest.events import Step
    >>> claim_of(Step(run_id="r", agent="a", step=1, otel_agent_rank=2, otel_agent_named_at=7))
    Claim(agent='a', rank=2, named_at=7)
    >>> claim_of(Step(run_id="r", agent="a", step=1))
    >>> claim_of(Step(run_id="r", agent="a", step=1, otel_agent_rank="3"))
    """
    given = getattr(event, "__pydantic_extra__", None)
    if not given or RANK_EXTRA not in given:
        return None
    rank = _integer(given.get(RANK_EXTRA))
    named_at = _integer(given.get(NAMED_AT_EXTRA, 0))
    if rank is None or rank not in RANKS or named_at is None or named_at < 0:
        return None
    return Claim(str(event.agent), rank, named_at)
