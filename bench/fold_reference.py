"""The fold as it was before the lean fold (issue #27), kept as the oracle the lean fold
is checked against and measured beside: pydantic models from the decoder, and the
per-event fold of that build (``isinstance`` dispatch, dimensions by name), word for
word. ``tests/test_fold_identity.py`` folds the bench mix through both and compares
every field of every run state and ``runs`` row; ``python -m loopwatch.bench.fold``
reports both builds' µs per event in the same run.

It is no second implementation to maintain: nothing but the test and the bench uses
it, and it changes only if the fold's results are meant to change (then the test says
where, and this copy is updated deliberately with them).
"""

from __future__ import annotations

import sys
from datetime import datetime
from typing import ClassVar

from loopwatch.ingest.attribution import EXPLICIT, claim_of
from loopwatch.ingest.events import (
    Annotation,
    EventBase,
    Label,
    LlmCall,
    RunEnd,
    RunStart,
    Step,
    ToolCall,
)
from loopwatch.processors import attribution, rows
from loopwatch.processors.pipeline import Pipeline, RawMessage, Work
from loopwatch.processors.pricing import cost_mismatch
from loopwatch.processors.runs import (
    DIMENSIONS,
    RunState,
    _detect_loop,
    ms,
    new_state,
    note_folded,
    remember,
)
from loopwatch.store import tables


def _take_dimensions(state: RunState, event: EventBase, authoritative: bool) -> None:
    """Copy the event's dimensions the run lacks (all of them from ``run.start``),
    interned (see :data:`_SHARED_STRINGS`)."""
    for name in DIMENSIONS:
        value = getattr(event, name)
        if value and (authoritative or not getattr(state, name)):
            setattr(state, name, sys.intern(value))


def apply_event(
    state: RunState,
    event: EventBase,
    *,
    priced_cost: float = 0.0,
    loop_window: int = 10,
    loop_repeats: int = 3,
    when: int | None = None,
) -> bool:
    """Fold one event into the run; False when it was already applied (a redelivery)."""
    if not remember(state, event.event_id.bytes):
        return False
    when = ms(event) if when is None else when
    if state.awaiting_run and not isinstance(event, Label):
        state.awaiting_run = False  # the run arrived: its time and dimensions are its own
        state.first_ms = when
        state.last_ms = max(state.last_ms, when)
        for name in DIMENSIONS:
            setattr(state, name, "")
    elif state.version:
        state.last_ms = max(state.last_ms, when)
        state.first_ms = min(state.first_ms, when)
    else:  # the run's first event: any time, 1900 (negative ms) and 1970 (0) included
        state.last_ms = state.first_ms = when
    state.version += 1
    _take_dimensions(state, event, authoritative=isinstance(event, RunStart))
    if isinstance(event, RunStart):
        state.started_ms = when
        state.time_cap_s = event.time_cap_s
    elif isinstance(event, Step):
        state.steps += 1
    elif isinstance(event, LlmCall):
        state.llm_calls += 1
        state.llm_errors += int(event.is_error)
        state.input_tokens += event.input_tokens
        state.output_tokens += event.output_tokens
        state.cache_read_tokens += event.cache_read_input_tokens
        state.cache_creation_tokens += event.cache_creation_input_tokens
        state.cost_usd += priced_cost
        state.reported_cost_usd += event.cost_usd or 0.0
    elif isinstance(event, ToolCall):
        state.tool_calls += 1
        state.tool_errors += int(event.is_error)
        if event.attempt == 1:  # changed with the lean fold: retries are not loops
            _detect_loop(state, f"{event.tool}:{event.args_hash}", loop_window, loop_repeats)
    elif isinstance(event, RunEnd):
        state.end_ms = when
        state.abandoned_ms = None
        state.terminal_reason = sys.intern(event.terminal_reason or "")
        state.cap = sys.intern(event.cap or "")
    elif isinstance(event, Label):
        state.verdict = sys.intern(event.verdict)
        state.label_source = sys.intern(event.label_source)
    return True


class ReferencePipeline(Pipeline):
    """:class:`Pipeline` with the decode and the per-event fold of the build before."""

    decode_structs: ClassVar[bool] = False

    def _state_for(  # type: ignore[override]
        self, touched: dict[str, RunState], event: EventBase, partition: int, when: int
    ) -> RunState:
        state = touched.get(event.run_id) or self.store.get(event.run_id)
        if state is None and not isinstance(event, RunStart):
            state = self.lookup_run(event.run_id)
        if state is None:
            state = new_state(event, partition, when)
        touched[event.run_id] = state
        return state

    def _handle_event(
        self,
        work: Work,
        touched: dict[str, RunState],
        message: RawMessage,
        event: EventBase,
        now: datetime,
    ) -> None:
        self.counters.events += 1
        event_ms = ms(event)
        if event_ms <= self._future_ms:
            self.max_event_ms = max(self.max_event_ms, event_ms)
        else:
            self.counters.future_events += 1
        if isinstance(event, Annotation):
            work.rows.add(tables.ANNOTATIONS, rows.annotation_row(event, now))
            return
        agent_rank = EXPLICIT
        claim = claim_of(event)
        if claim is not None:  # an OTLP span's: the run's agent decides (see module)
            event, agent_rank, revise = attribution.attribute(
                self._state_for(touched, event, message.partition, event_ms), event, claim)
            if revise:
                self._revise.add(event.run_id)
        priced_cost = 0.0
        if isinstance(event, LlmCall):
            priced = self.prices.cost(
                event.model, event.input_tokens, event.output_tokens,
                event.cache_read_input_tokens, event.cache_creation_input_tokens,
                event.cache_ttl,
            )
            mismatch = cost_mismatch(
                event.cost_usd, priced.cost_usd, self.settings.cost_mismatch_tolerance
            )
            self.counters.cost_mismatches += int(mismatch)
            priced_cost = priced.cost_usd
            work.rows.add(tables.LLM_CALLS,
                          rows.llm_call_row(event, priced, mismatch, now, agent_rank))
        elif isinstance(event, ToolCall):
            work.rows.add(tables.TOOL_CALLS, rows.tool_call_row(
                event, self.settings.near_miss_factor, now, agent_rank))
        elif isinstance(event, Label):
            work.rows.add(tables.LABELS, rows.label_row(event, now))
        state = self._state_for(touched, event, message.partition, event_ms)
        was_closed = state.closed
        was_waiting = state.awaiting_run
        if isinstance(event, Label) and state.version == 0:  # no run known: it waits
            state.awaiting_run = True
        loop = self.settings.loop_for(event.task_type or state.task_type)
        applied = apply_event(
            state, event, priced_cost=priced_cost,
            loop_window=loop.window, loop_repeats=loop.repeats, when=event_ms,
        )
        note_folded(state, message.partition, message.offset, self.incarnation_ms)
        if applied and state.awaiting_run:
            self.counters.labels_unmatched += 1
        elif applied and was_waiting:
            self.counters.pending_labels_matched += 1
        if not applied:
            self.counters.duplicates += 1
        elif state.closed and not was_closed:
            self.counters.runs_closed += 1
        elif was_closed:
            self.counters.runs_revised += 1
