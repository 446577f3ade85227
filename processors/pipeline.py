"""The engine-free core of the processors: Kafka messages in, state and rows out.

faust (``loopwatch.processors.app``) feeds it batches and writes what it returns; tests can
drive it directly. It never raises on bad input: what cannot be decoded becomes a
dead letter (table row + dead-letter topic) with its reason, and is counted.

An event the fold itself raises on (a loopwatch bug, or run state it cannot read), or a
message whose events cannot be stored, is a dead letter too, reason ``processing
failed: ...``: the batch, the other runs and the partition's offsets go on, and
``loopwatch dlq replay`` re-applies it once fixed.

Time is event time. The watermark is the newest event time seen minus the late
allowance; when no event has arrived for ``idle_advance_s`` it follows the wall clock,
so an idle fleet still abandons its stuck runs. An event stamped further ahead of the
wall clock than ``max_clock_skew_s`` is stored but does not move event time: one agent
with a broken clock must not abandon every open run of the fleet.

A label for a run not known yet (none in state, none in the store) is stored and
waits in state, ``awaiting_run``, with no ``runs`` row: the run's events fold into it if
they come within the label window (counted ``pending_labels_matched``), else the sweep
forgets it (``pending_labels_expired``). Both count among ``labels_unmatched`` first.

An OTLP span's event claims its trace's agent (:mod:`loopwatch.processors.attribution`): the
run keeps the best claim, stores every later row under it, and a better claim revises
the rows stored before it (a revision row of the batch that raised the claim).

The sweep does not scan every state: each run the pipeline stores is filed under its
next deadline (abandonment while open, forgetting once closed) in coarse buckets of
event time, and a sweep only visits the buckets the watermark has passed. The index is
rebuilt from the store when the owner says the state changed under it (a rebalance).
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import ClassVar, Protocol

import msgspec
import orjson
from mypy_extensions import mypyc_attr

from loopwatch.core.config import Settings
from loopwatch.ingest.attribution import EXPLICIT, claim_of
from loopwatch.ingest.events import Annotation, EventBase, LlmCall
from loopwatch.ingest.structs import STRUCTS
from loopwatch.ingest.wire import DeadLetter, Decoded, decode_message, encode_event
from loopwatch.processors import attribution, rows
from loopwatch.processors.attribution import CallRow
from loopwatch.processors.deadletter import DeadLetterRecord, bounded, payload_limit
from loopwatch.processors.pricing import PriceTable, cost_mismatch
from loopwatch.processors.runs import (
    ANNOTATION,
    LABEL,
    LLM_CALL,
    RUN_START,
    TOOL_CALL,
    RunState,
    abandon_if_expired,
    apply_event,
    kind_of,
    ms,
    new_state,
    note_folded,
)
from loopwatch.store import letters, tables
from loopwatch.store.sink import RowBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RawMessage:
    topic: str
    partition: int
    offset: int
    value: bytes | None


class RunStore(Protocol):
    """Per-run state owned by this worker (a faust table in production)."""

    def get(self, run_id: str) -> RunState | None: ...

    def put(self, state: RunState) -> None: ...

    def delete(self, state: RunState) -> None: ...

    def states(self) -> Iterable[RunState]:
        """States of the partitions this worker actively owns."""
        ...


def _event_json(event: EventBase) -> bytes:
    """An event's JSON for its dead letter: a model's, or its struct's (the same fields,
    and the extras a struct of :func:`loopwatch.ingest.structs.mirror_claims` has apart)."""
    if isinstance(event, msgspec.Struct):
        extras = getattr(event, "__pydantic_extra__", None)
        if not extras:
            return msgspec.json.encode(event)
        return orjson.dumps({**msgspec.json.decode(msgspec.json.encode(event)), **extras})
    return encode_event(event)


#: width of a deadline bucket (event-time ms): a sweep revisits at most one bucket's
#: runs that are not due yet
DEADLINE_BUCKET_MS = 10_000
#: a fold decodes this many events ahead (whole messages) before folding them, so the
#: runs among them that must be looked up in the store are asked for in one query
LOOKUP_WINDOW_EVENTS = 16_384

#: reads the stored states of runs this worker does not hold, by run id (those found)
RunLookup = Callable[[Sequence[str]], dict[str, RunState]]


@dataclass
class Counters:
    messages: int = 0
    events: int = 0
    duplicates: int = 0
    dead_letters: int = 0
    runs_closed: int = 0
    runs_abandoned: int = 0
    runs_revised: int = 0
    cost_mismatches: int = 0
    #: events stamped beyond the clock + max_clock_skew_s: kept, but event time ignores them
    future_events: int = 0
    #: events (or whole messages) the processors raised on, dead-lettered (also counted
    #: in ``dead_letters``)
    processing_errors: int = 0
    #: labels for a run not known when they came (stored; no run row made for them)
    labels_unmatched: int = 0
    #: runs that arrived with such labels waiting, applied to them
    pending_labels_matched: int = 0
    #: runs whose waiting labels were forgotten: no event of theirs within the label window
    pending_labels_expired: int = 0


@dataclass
class Work:
    """What one batch produced: rows to store, dead letters to publish."""

    rows: RowBatch = field(default_factory=RowBatch)
    dead: list[DeadLetterRecord] = field(default_factory=list)


@mypyc_attr(allow_interpreted_subclasses=True)  # the reference folds (bench, tests)
class Pipeline:
    #: decode messages the msgspec mirror accepts into its structs, not models (the
    #: fold reads fields only); a reference fold over models sets it False
    decode_structs: ClassVar[bool] = True

    def __init__(
        self,
        settings: Settings,
        store: RunStore,
        prices: PriceTable | None = None,
        lookup_run: Callable[[str], RunState | None] | None = None,
        clock: Callable[[], float] = time.time,
        python_rows: bool = False,
        lookup_runs: RunLookup | None = None,
        incarnation_ms: int = 0,
    ) -> None:
        """``python_rows``: build every event's ``llm_calls`` / ``tool_calls`` /
        ``labels`` row here, not only a claim event's (see :func:`rows.built_here`): for
        a writer whose prices or settings are not those the store's views were rendered
        for (``reprocess`` with a new price table), which writes no ``events_in`` rows.

        A run this worker does not hold, whose first event in a fold is not its
        ``run.start``, is read from the store: ``lookup_runs`` asks for every such run
        of :data:`LOOKUP_WINDOW_EVENTS` events in one call (each lookup is a query, ~5-20
        ms, and an OTLP exporter sends a trace's children before its root, often in
        another request); without it, ``lookup_run`` is asked once per run.

        ``incarnation_ms``: when the embedded broker the messages come from started (0
        for a cluster), which the states' ``folded_offset`` is counted from."""
        self.settings = settings
        self.incarnation_ms = incarnation_ms
        self.python_rows = python_rows
        self.store = store
        self.prices = prices or PriceTable.load(settings.prices_file)
        self.lookup_run = lookup_run or (
            (lambda run_id: lookup_runs([run_id]).get(run_id)) if lookup_runs is not None
            else (lambda run_id: None))
        self._lookup_runs = lookup_runs
        #: the window's runs looked up ahead: run id -> its stored state, or None
        self._looked_up: dict[str, RunState | None] = {}
        self.clock = clock
        self.counters = Counters()
        self.max_event_ms = 0
        self.last_event_wall = clock()
        #: event times beyond this (clock + max_clock_skew_s, per fold) don't move event time
        self._future_ms = 0.0
        self._label_window_ms = int(settings.label_window_s * 1000)
        self._letter_limit = payload_limit(settings)
        #: the settings the fold reads for every event, read once (each read of a
        #: pydantic field, and ``loop_for``'s call, is interpreted Python)
        self._loop = settings.loop
        self._loop_by_task_type = dict(settings.loop_by_task_type)
        self._cost_tolerance = settings.cost_mismatch_tolerance
        self._due: dict[int, set[str]] = {}
        self._bucket_of: dict[str, int] = {}
        self._buckets: list[int] = []
        self._index_stale = True
        #: runs whose stored rows a better agent claim must revise (next settle)
        self._revise: set[str] = set()
        #: runs first folded since the last settle (no row of theirs stored yet), and
        #: the call rows built for them since, which a better claim patches instead
        self._fresh: dict[str, list[CallRow]] = {}
        #: fresh runs whose claim improved since their first rows were built
        self._patch: set[str] = set()
        #: the runs first folded in the last settle that built call rows, with those rows
        #: as written: all their stored rows, so a better claim in this settle writes
        #: them again under it instead of a revision statement (an OTLP trace whose root
        #: comes in the next export request, most often the next batch: each statement
        #: read both tables ``FINAL``, 30-50 ms of the store's CPU for one run)
        self._recent: dict[str, list[CallRow]] = {}
        #: the call rows built since the last settle for the runs in ``_recent``
        self._since: dict[str, list[CallRow]] = {}

    def watermark_ms(self) -> int:
        late_ms = int(self.settings.late_allowance_s * 1000)
        mark = self.max_event_ms - late_ms
        now = self.clock()
        if now - self.last_event_wall >= self.settings.idle_advance_s:
            mark = max(mark, int(now * 1000) - late_ms)
        return mark

    def process(self, messages: list[RawMessage]) -> Work:
        """Decode, fold into run state, and build every row the batch implies."""
        touched: dict[str, RunState] = {}
        work = self.fold(messages, touched)
        work.rows.extend(self.settle(touched).rows)
        return work

    def fold(self, messages: list[RawMessage], touched: dict[str, RunState]) -> Work:
        """Decode and fold into the states in ``touched`` (filled from the store as runs
        appear), without storing them: several folds can share one :meth:`settle`, so
        a run touched by many chunks of a batch is changelogged and written once. Rows
        but ``events_in`` are written with that settle's (the processor defers them):
        the settle may still patch a new run's call rows to its claim."""
        work = Work()
        now = datetime.now(UTC)
        self._future_ms = (self.clock() + self.settings.max_clock_skew_s) * 1000
        for window in self._windows(messages):
            self._look_up_ahead(window, touched)
            try:
                for message, decoded in window:
                    self._fold_message(work, touched, message, decoded, now)
            finally:
                self._looked_up.clear()
        return work

    def _windows(self, messages: list[RawMessage]
                 ) -> Iterator[list[tuple[RawMessage, Decoded]]]:
        """The messages decoded, in consecutive runs of about
        :data:`LOOKUP_WINDOW_EVENTS` events (a message is never split)."""
        window: list[tuple[RawMessage, Decoded]] = []
        events = 0
        for message in messages:
            self.counters.messages += 1
            decoded = decode_message(message.value, self.settings.max_message_bytes,
                                     structs=self.decode_structs)
            window.append((message, decoded))
            events += len(decoded.events)
            if events >= LOOKUP_WINDOW_EVENTS:
                yield window
                window, events = [], 0
        if window:
            yield window

    def _look_up_ahead(self, window: list[tuple[RawMessage, Decoded]],
                       touched: dict[str, RunState]) -> None:
        """Ask the store at once for every run of ``window`` that :meth:`_state_for`
        would look up one by one: not held, and its first event here (annotations
        aside, which touch no state) is no ``run.start``. A lookup that fails leaves
        them to :meth:`_state_for`, which fails as before, event by event."""
        if self._lookup_runs is None:
            return
        first: set[str] = set()
        wanted: list[str] = []
        for _, decoded in window:
            for event in decoded.events:
                run_id = event.run_id
                if run_id in first:
                    continue
                kind = kind_of(event)
                if kind == ANNOTATION:
                    continue
                first.add(run_id)
                if kind != RUN_START and run_id not in touched \
                        and self.store.get(run_id) is None:
                    wanted.append(run_id)
        if not wanted:
            return
        try:
            found = self._lookup_runs(wanted)
        except Exception:
            log.warning("looking up %d runs in the store failed; looking up one by one",
                        len(wanted), exc_info=True)
            return
        self._looked_up = {run_id: found.get(run_id) for run_id in wanted}

    def _fold_message(self, work: Work, touched: dict[str, RunState], message: RawMessage,
                      decoded: Decoded, now: datetime) -> None:
        for index, letter in enumerate(decoded.dead):
            self._dead_letter(work, message, index, letter, now)
        if decoded.events:
            self.last_event_wall = self.clock()
        letter_index = len(decoded.dead)
        try:
            self._store_events(work, message, decoded, now)
        except Exception as exc:  # none of its events is stored, so none is folded
            self._processing_failed(work, message, letter_index, exc, now,
                                    message.value or b"")
            return
        for position, event in enumerate(decoded.events, start=letter_index):
            try:
                self._handle_event(work, touched, message, event, now)
            except Exception as exc:  # a bug must cost one event, not the pipeline
                self._processing_failed(work, message, position, exc, now,
                                        _event_json(event), event.run_id)

    @staticmethod
    def _store_events(work: Work, message: RawMessage, decoded: Decoded,
                      now: datetime) -> None:
        """The message's raw events, for ClickHouse to split into ``events`` rows (every
        event, duplicates too: the table dedups)."""
        if decoded.events_json is not None:
            work.rows.add(rows.EVENTS_IN_TABLE, rows.events_in_row(
                message.partition, message.offset, now, decoded.events_json,
                decoded.events_extras))
        elif decoded.events:
            events_json, extras = rows.validated_events_json(decoded.events)
            work.rows.add(rows.EVENTS_IN_TABLE, rows.events_in_row(
                message.partition, message.offset, now, events_json, extras))

    def settle(self, touched: dict[str, RunState]) -> Work:
        """Store the folded states (changelog) and build their ``runs`` rows. A state
        that cannot be (only a damaged one: recovered from an incompatible build, say)
        costs its own run's row, logged and counted, not the batch's."""
        work = Work()
        now = datetime.now(UTC)
        for state in touched.values():
            try:
                row = None if state.awaiting_run else rows.run_row(state, now)
                self._put(state)
            except Exception as exc:
                self._state_failed("settling", state.run_id, exc)
                continue
            if row is not None:  # labels waiting for their run have no row
                work.rows.add(tables.RUNS, row)
                if state.run_id in self._revise:
                    self._revise_run(work, state)
                elif state.run_id in self._patch:
                    attribution.patch_rows(state, [call for _, call in
                                                   self._fresh[state.run_id]])
            self._revise.discard(state.run_id)
        self._recent = {run_id: calls for run_id, calls in self._fresh.items() if calls}
        self._since.clear()
        self._fresh.clear()
        self._patch.clear()
        return work

    def _revise_run(self, work: Work, state: RunState) -> None:
        """A better claim for a run with rows stored: a revision statement, or, for a
        run first folded in the last settle, its rows written again under the claim
        (the statement's effect: a higher version replaces them) and this settle's
        patched in place, as the statement would have rewritten them too."""
        recent = self._recent.get(state.run_id)
        if recent is None:
            work.rows.add(attribution.REVISIONS_TABLE, attribution.revision_row(state))
            return
        attribution.patch_rows(state, [call for _, call in
                                       self._since.get(state.run_id, [])])
        for table, call in attribution.revised_copies(state, recent):
            work.rows.add(table, call)

    def sweep(self) -> Work:
        """Abandon runs past their TTL (event time); forget closed runs past the label window."""
        work = Work()
        mark = self.watermark_ms()
        if self._index_stale:
            self._reindex()
        limit = mark // DEADLINE_BUCKET_MS
        due: list[str] = []
        while self._buckets and self._buckets[0] <= limit:
            members = self._due.pop(heapq.heappop(self._buckets), None)
            if members:
                for run_id in members:
                    del self._bucket_of[run_id]
                due.extend(members)
        now = datetime.now(UTC)
        for run_id in due:
            try:
                self._sweep_one(work, run_id, mark, now)
            except Exception as exc:  # left out of the index: not retried every sweep
                self._state_failed("sweeping", run_id, exc)
        return work

    def _sweep_one(self, work: Work, run_id: str, mark: int, now: datetime) -> None:
        state = self.store.get(run_id)
        if state is None:
            return
        if state.awaiting_run:
            if state.last_ms + self._label_window_ms < mark:
                self.store.delete(state)
                self.counters.pending_labels_expired += 1
            else:
                self._file(state)
            return
        if abandon_if_expired(state, mark, self.abandon_ttl_ms(state)):
            work.rows.add(tables.RUNS, rows.run_row(state, now))
            self._put(state)
            self.counters.runs_abandoned += 1
            self.counters.runs_closed += 1
        elif state.closed and (state.closed_ms or 0) + self._label_window_ms < mark:
            self.store.delete(state)
        else:
            self._file(state)  # not due yet (a partly passed bucket)

    def invalidate_index(self) -> None:
        """The store changed behind the pipeline's back (partitions assigned, changelog
        recovered): the next sweep rebuilds the deadline index from ``store.states()``,
        and no run's rows are known to be all in the last settle's write any more."""
        self._index_stale = True
        self._recent.clear()

    def _reindex(self) -> None:
        self._due.clear()
        self._bucket_of.clear()
        self._buckets.clear()
        for state in self.store.states():
            try:
                self._file(state)
            except Exception as exc:
                self._state_failed("indexing", state.run_id, exc)
        self._index_stale = False

    def _put(self, state: RunState) -> None:
        self.store.put(state)
        self._file(state)

    def _file(self, state: RunState) -> None:
        """File a run under the bucket of its next deadline (moving it if that changed)."""
        if state.awaiting_run:
            deadline = state.last_ms + self._label_window_ms + 1
        elif state.closed:
            deadline = (state.closed_ms or 0) + self._label_window_ms + 1
        else:
            deadline = state.last_ms + self.abandon_ttl_ms(state)
        bucket = deadline // DEADLINE_BUCKET_MS
        run_id = state.run_id
        old = self._bucket_of.get(run_id)
        if old == bucket:
            return
        if old is not None:
            previous = self._due.get(old)
            if previous is not None:
                previous.discard(run_id)
        members = self._due.get(bucket)
        if members is None:
            members = self._due[bucket] = set()
            heapq.heappush(self._buckets, bucket)
        members.add(run_id)
        self._bucket_of[run_id] = bucket

    def abandon_ttl_ms(self, state: RunState) -> int:
        """Per task_type if configured, else 2 x the run's declared time cap, else default."""
        by_task = self.settings.abandon_ttl_by_task_type.get(state.task_type)
        if by_task is not None:
            return int(by_task * 1000)
        if state.time_cap_s:
            return int(2 * state.time_cap_s * 1000)
        return int(self.settings.abandon_ttl_s * 1000)

    def adopt(self, states: Iterable[RunState]) -> int:
        """Take over runs rebuilt from the store that this worker's state does not have."""
        adopted = 0
        for state in states:
            if self.store.get(state.run_id) is None:
                try:
                    self._put(state)
                except Exception as exc:
                    self._state_failed("adopting", state.run_id, exc)
                    continue
                adopted += 1
        return adopted

    def _dead_letter(
        self, work: Work, message: RawMessage, index: int, letter: DeadLetter, now: datetime
    ) -> None:
        source = f"{message.topic}:{message.partition}:{message.offset}:{index}"
        record = bounded(letters.letter_id(source), source, letter.reason, letter.run_id,
                         letter.payload, self._letter_limit)
        self.counters.dead_letters += 1
        work.dead.append(record)
        work.rows.add(tables.DEAD_LETTERS, letters.dead_letter_row(
            record.letter_id, source, record.reason, record.run_id, record.payload, now))

    def _processing_failed(self, work: Work, message: RawMessage, letter_index: int,
                           exc: Exception, now: datetime, payload: bytes,
                           run_id: str = "") -> None:
        """Dead-letter what the processors raised on, with the error as its reason:
        ``payload`` is a message none of whose events could be stored (its raw bytes),
        or an event the fold failed on (its JSON; the event is already in ``events``).

        Unless the error came from folding an event into its run's state (pure
        arithmetic on validated fields: only a damaged state can make that raise), the
        run has not seen it and a replay is applied in full; otherwise the replay counts
        as a redelivery, so nothing is counted twice. The first failures and every
        thousandth are logged with their traceback; all are counted."""
        self._count_failure(exc, "on %s:%d:%d, run %r", message.topic, message.partition,
                            message.offset, run_id)
        reason = letters.failure_reason("processing failed", exc)
        self._dead_letter(work, message, letter_index, DeadLetter(reason, payload, run_id),
                          now)

    def _state_failed(self, doing: str, run_id: str, exc: Exception) -> None:
        """Count and log a run state the pipeline raised on outside any event: the run
        keeps its last stored row, its events are stored all the same."""
        self._count_failure(exc, "%s the state of run %r", doing, run_id)

    def _count_failure(self, exc: Exception, where: str, *args: object) -> None:
        """Count a processing failure; log it with its traceback for the first ten and
        then every thousandth (``where`` and ``args`` say what failed, %-style)."""
        self.counters.processing_errors += 1
        failures = self.counters.processing_errors
        if failures <= 10 or failures % 1000 == 0:
            log.error("processing failed (%d so far) " + where, failures, *args, exc_info=exc)

    def _state_for(
        self, touched: dict[str, RunState], event: EventBase, partition: int, when: int,
        kind: int,
    ) -> RunState:
        state = touched.get(event.run_id) or self.store.get(event.run_id)
        if state is None and kind != RUN_START:
            if event.run_id in self._looked_up:
                state = self._looked_up.pop(event.run_id)
            else:
                state = self.lookup_run(event.run_id)
        if state is None:
            state = new_state(event, partition, when)
            self._fresh[event.run_id] = []
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
            if event_ms > self.max_event_ms:
                self.max_event_ms = event_ms
        else:
            self.counters.future_events += 1
        kind = kind_of(event)
        if kind == ANNOTATION:
            note: Annotation = event  # type: ignore[assignment]
            work.rows.add(tables.ANNOTATIONS, rows.annotation_row(note, now))
            return
        agent_rank = EXPLICIT
        # only a model carries extras, hence a claim: a struct (no extras) makes none
        claim = None if type(event) in STRUCTS else claim_of(event)
        if claim is not None:  # an OTLP span's: the run's agent decides (see module)
            event, agent_rank, revise = attribution.attribute(
                self._state_for(touched, event, message.partition, event_ms, kind),
                event, claim)
            if revise:
                # rows of a run first folded since the last settle are all still here,
                # in this settle's write: they take the claim in place (no statement)
                (self._patch if event.run_id in self._fresh else self._revise).add(
                    event.run_id)
        priced_cost = 0.0
        loop = self._loop
        priced = None
        mismatch = False
        # the store's views write every other event's row (loopwatch.store.event_views);
        # a struct carries no extras, so no claim: never one of those built here
        rows_here = self.python_rows or (type(event) not in STRUCTS
                                         and rows.built_here(event))
        if kind == LLM_CALL:
            call: LlmCall = event  # type: ignore[assignment]  # or its struct
            priced_cost = self.prices.dollars(
                call.model, call.input_tokens, call.output_tokens,
                call.cache_read_input_tokens, call.cache_creation_input_tokens,
                call.cache_ttl,
            )
            if rows_here:  # its row keeps the price's version
                priced = self.prices.priced(call.model, priced_cost)
            mismatch = cost_mismatch(call.cost_usd, priced_cost, self._cost_tolerance)
            self.counters.cost_mismatches += int(mismatch)
        if rows_here:
            call_row = None
            table = ""
            if kind == LLM_CALL:
                assert priced is not None
                call_row = rows.llm_call_row(
                    event, priced, mismatch, now, agent_rank)  # type: ignore[arg-type]
                table = tables.LLM_CALLS
            elif kind == TOOL_CALL:
                call_row = rows.tool_call_row(
                    event, self.settings.near_miss_factor, now,  # type: ignore[arg-type]
                    agent_rank)
                table = tables.TOOL_CALLS
            elif kind == LABEL:
                work.rows.add(tables.LABELS, rows.label_row(event, now))  # type: ignore[arg-type]
            if call_row is not None:
                work.rows.add(table, call_row)
                fresh = self._fresh.get(event.run_id)
                if fresh is not None:
                    fresh.append((table, call_row))
                elif event.run_id in self._recent:
                    self._since.setdefault(event.run_id, []).append((table, call_row))
        state = self._state_for(touched, event, message.partition, event_ms, kind)
        if kind == TOOL_CALL:  # only a tool call reads the loop detector's settings
            loop = self._loop_by_task_type.get(event.task_type or state.task_type, loop)
        was_closed = state.closed
        was_waiting = state.awaiting_run
        if kind == LABEL and state.version == 0:  # no run known: it waits
            state.awaiting_run = True
        applied = apply_event(
            state, event, priced_cost=priced_cost,
            loop_window=loop.window, loop_repeats=loop.repeats, when=event_ms, kind=kind,
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
