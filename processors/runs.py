"""Run assembly: fold a run's events into one state and label it with one outcome.

Pure functions over :class:`RunState`; no I/O. State is a plain dict-able dataclass so
it can live in a faust table (changelogged) and in the ``runs.state`` column (so a
fresh broker can rebuild open runs from ClickHouse). It is on the hot path (one fold
per event, one serialisation per touched run per batch), hence slots and a hand-written
``to_dict``. Memory is per open run, so the set of seen event ids (the redelivery
guard) is one ``bytes`` of their 16-byte forms, oldest first, until it holds
:data:`SEEN_PACKED_IDS` ids (a lookup is a ``find`` over at most 1 KB); longer runs
switch to an insertion-ordered dict. A dict of 20 ids took ~2 KB, the bytes take 353.
The changelog carries them as one base64 string; ``runs.state`` leaves them out.

Outcome precedence, from the agent's terminal reason, the loop detector and labels:

- no ``run.end`` within the TTL: ``abandoned`` (a later ``run.end`` revises it);
- ``crash``: ``hard_error``; ``loop_detector``/``drift_monitor`` or the loop detector
  tripped: ``looped``; ``cap`` or ``budget``: ``budget_exhausted``; ``cannot_complete``:
  ``gave_up``; ``model_done``: ``success``; ``cancelled``: ``abandoned`` (nobody was there
  to receive it); no reason at all (an import without verdict): ``unknown``;
- a ``wrong`` label turns ``success``/``unknown`` into ``wrong``; a ``correct`` label
  turns ``unknown`` into ``success``. Other failures keep their more specific outcome.

A label may come before any event of its run (another system labels it, a replay):
its state then waits, ``awaiting_run``, without a ``runs`` row, and the run's events
fold into it when they come, so the label is applied once, as if it came last.
"""

from __future__ import annotations

import ast
import base64
import sys
import types
import typing
import uuid
from dataclasses import dataclass, fields
from typing import Any

from loopwatch.ingest.events import (
    EVENT_TYPES,
    Annotation,
    EventBase,
    Label,
    LlmCall,
    RunEnd,
    RunStart,
    Step,
    ToolCall,
)
from loopwatch.ingest.structs import CLAIM_MIRRORS, MIRRORS
from loopwatch.processors import native

SEEN_EVENT_IDS = 4096
#: up to this many seen ids are kept packed in one ``bytes``
SEEN_PACKED_IDS = 64
_ID = 16

_REASON_OUTCOME = {
    "crash": "hard_error",
    "loop_detector": "looped",
    "drift_monitor": "looped",
    "cap": "budget_exhausted",
    "budget": "budget_exhausted",
    "cannot_complete": "gave_up",
    "model_done": "success",
    "cancelled": "abandoned",
}


def ms(event: EventBase) -> int:
    return int(event.ts.timestamp() * 1000)


@dataclass(slots=True)
class RunState:
    run_id: str
    partition: int
    agent: str = ""
    agent_version: str = ""
    task_type: str = ""
    model: str = ""
    prompt_version: str = ""
    deployment: str = ""
    traffic_slice: str = ""
    worker_id: str = ""
    started_ms: int | None = None
    first_ms: int = 0
    last_ms: int = 0
    end_ms: int | None = None
    abandoned_ms: int | None = None
    time_cap_s: float | None = None
    terminal_reason: str = ""
    cap: str = ""
    verdict: str = ""
    label_source: str = ""
    steps: int = 0
    llm_calls: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    llm_errors: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_creation_tokens: int = 0
    cost_usd: float = 0.0
    reported_cost_usd: float = 0.0
    loop_detected: bool = False
    loop_summary: str = ""
    #: the last tool calls' ``tool:args_hash`` (None until the first tool call)
    recent_actions: list[str] | None = None
    #: ids (16 bytes) of the events already folded in, oldest first: packed in one
    #: ``bytes``, or an ordered dict past :data:`SEEN_PACKED_IDS` (see :func:`remember`)
    seen: bytes | dict[bytes, None] = b""
    version: int = 0
    #: the rank of ``agent``'s claim (:mod:`loopwatch.ingest.attribution`), -1 while no event
    #: made one (an SDK run); ``agent_named_at``: when its naming span started (ns)
    agent_rank: int = -1
    agent_named_at: int = 0
    #: True while the state holds only labels, for a run not seen yet (a label that
    #: came first): it has no ``runs`` row, and its first other event makes it a run
    awaiting_run: bool = False
    #: the highest offset of a message of ``partition`` folded into the state (-1: none
    #: yet, or a state from a build before it), counted in the broker incarnation that
    #: started at ``folded_since_ms`` (an embedded broker's offsets start again when it is
    #: lost; 0 for a cluster's, which never do): read back from the store, the state has
    #: folded the stored events one of whose copies came at or before that offset, or
    #: was stored before the incarnation (see ``loopwatch.runtime.SEEN_SQL``)
    folded_offset: int = -1
    folded_since_ms: int = 0

    def to_dict(self, with_seen: bool = True) -> dict[str, Any]:
        """A JSON-able dict; ``dataclasses.asdict`` deep-copies every value, ~10x slower,
        and a ``getattr`` loop over the fields costs the compiled fold 3.3 µs a state
        against ~1 written out (twice per run per settle: changelog and ``runs.state``).
        Every field, in the class's order:

        >>> list(RunState("r", 0).to_dict()) == list(_FIELDS)
        True

        ``with_seen=False`` leaves the seen event ids out (``seen`` is ""): that is the
        form the ``runs`` table keeps, where they were two thirds of the row's bytes and
        the ``events`` table already holds them (see :func:`seen_from_ids`).
        """
        return {
            "run_id": self.run_id, "partition": self.partition, "agent": self.agent,
            "agent_version": self.agent_version, "task_type": self.task_type,
            "model": self.model, "prompt_version": self.prompt_version,
            "deployment": self.deployment, "traffic_slice": self.traffic_slice,
            "worker_id": self.worker_id, "started_ms": self.started_ms,
            "first_ms": self.first_ms, "last_ms": self.last_ms, "end_ms": self.end_ms,
            "abandoned_ms": self.abandoned_ms, "time_cap_s": self.time_cap_s,
            "terminal_reason": self.terminal_reason, "cap": self.cap,
            "verdict": self.verdict, "label_source": self.label_source,
            "steps": self.steps, "llm_calls": self.llm_calls,
            "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
            "llm_errors": self.llm_errors, "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cache_read_tokens": self.cache_read_tokens,
            "cache_creation_tokens": self.cache_creation_tokens,
            "cost_usd": self.cost_usd, "reported_cost_usd": self.reported_cost_usd,
            "loop_detected": self.loop_detected, "loop_summary": self.loop_summary,
            "recent_actions": list(self.recent_actions or ()),
            "seen": base64.b64encode(_packed(self.seen)).decode() if with_seen else "",
            "version": self.version, "agent_rank": self.agent_rank,
            "agent_named_at": self.agent_named_at, "awaiting_run": self.awaiting_run,
            "folded_offset": self.folded_offset, "folded_since_ms": self.folded_since_ms,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunState:
        """Also reads states written before the compact form (``seen`` as a list of ids),
        and states a newer build wrote: fields this build does not know are left out, so
        a rollback or a rolling deploy can still fold those runs (a field it lacks takes
        its default). A field of another type (an incompatible build, a hand edit) is a
        ``TypeError`` here, where readers take the run from elsewhere, rather than on
        every later event of the run.

        >>> RunState.from_dict({"run_id": "r", "partition": 0, "cost_usd": 1}).cost_usd
        1
        >>> RunState.from_dict({"run_id": "r", "partition": 0, "started_ms": "at dawn"})
        Traceback (most recent call last):
        ...
        TypeError: run state field started_ms holds a str
        """
        values = {name: value for name, value in data.items() if name in _FIELD_NAMES}
        seen = values.get("seen") or ""
        if isinstance(seen, str):
            values["seen"] = _unpacked(base64.b64decode(seen))
        else:
            values["seen"] = _unpacked(b"".join(uuid.UUID(str(text)).bytes for text in seen))
        values["recent_actions"] = values.get("recent_actions") or None
        _check_types(values)
        for name in _SHARED_STRINGS:
            text = values.get(name)
            if isinstance(text, str):
                values[name] = sys.intern(text)
        return cls(**values)

    @property
    def closed(self) -> bool:
        return self.end_ms is not None or self.abandoned_ms is not None

    @property
    def closed_ms(self) -> int | None:
        return self.end_ms if self.end_ms is not None else self.abandoned_ms

    @property
    def outcome(self) -> str:
        """The one outcome of a closed run; '' while it runs."""
        if self.end_ms is not None:
            base = _REASON_OUTCOME.get(self.terminal_reason, "unknown")
            if self.loop_detected and base in ("success", "budget_exhausted", "gave_up"):
                base = "looped"
        elif self.abandoned_ms is not None:
            base = "abandoned"
        else:
            return ""
        if self.verdict == "wrong" and base in ("success", "unknown"):
            return "wrong"
        if self.verdict == "correct" and base == "unknown":
            return "success"
        return base


_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(RunState))
_FIELD_NAMES = frozenset(_FIELDS)
#: the run's dimensions, copied from its events (see :func:`_take_dimensions`)
DIMENSIONS = ("agent", "agent_version", "task_type", "model", "prompt_version",
              "deployment", "traffic_slice", "worker_id")
#: the string fields thousands of runs share a few values of, kept interned: a decoder
#: may hand every event its own copy of each string (msgspec does; pydantic caches
#: them), and so does orjson reading a changelog; the copies cost ~330 B per open run
_SHARED_STRINGS = (*DIMENSIONS, "terminal_reason", "cap", "verdict", "label_source")


def _accepted_types(hint: Any) -> tuple[type, ...]:
    """The classes a JSON-read value of a field may have: a float field takes an int
    (JSON does not tell 1.0 from 1)."""
    accepted: list[type] = []
    union = typing.get_origin(hint) in (types.UnionType, typing.Union)
    for part in typing.get_args(hint) if union else (hint,):
        cls = typing.get_origin(part) or part
        accepted.extend((float, int) if cls is float else (cls,))
    return tuple(accepted)


def _declared_types() -> dict[str, Any]:
    """:class:`RunState`'s field annotations, read from this module's source: a compiled
    build (:mod:`loopwatch.processors.native`) keeps ``type`` for every one that is not
    a plain class, so they cannot be read off the class."""
    tree = ast.parse((native.HERE / "runs.py").read_text())
    (body,) = (node.body for node in tree.body
               if isinstance(node, ast.ClassDef) and node.name == RunState.__name__)
    return {node.target.id: eval(ast.unparse(node.annotation), globals())
            for node in body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


_FIELD_TYPES = {name: _accepted_types(hint) for name, hint in _declared_types().items()}


def _check_types(values: dict[str, Any]) -> None:
    """Raise ``TypeError`` unless every value has its field's type (a bool is no
    number here, though Python makes it an int)."""
    for name, value in values.items():
        accepted = _FIELD_TYPES[name]
        if not isinstance(value, accepted) or (type(value) is bool and bool not in accepted):
            raise TypeError(f"run state field {name} holds a {type(value).__name__}")
    if any(type(action) is not str for action in values.get("recent_actions") or ()):
        raise TypeError("run state field recent_actions holds a non-string")


def _packed(seen: bytes | dict[bytes, None]) -> bytes:
    return seen if isinstance(seen, bytes) else b"".join(seen)


def _split(packed: bytes) -> list[bytes]:
    """Packed ids as their 16-byte pieces, in order."""
    return [packed[i:i + _ID] for i in range(0, len(packed), _ID)]


def _unpacked(packed: bytes) -> bytes | dict[bytes, None]:
    """The in-memory form of packed ids: kept packed while short, else an ordered dict."""
    if len(packed) <= SEEN_PACKED_IDS * _ID:
        return packed
    return dict.fromkeys(_split(packed)[-SEEN_EVENT_IDS:])


def seen_ids(state: RunState) -> list[bytes]:
    """The run's seen event ids (16 bytes each), oldest first."""
    return _split(_packed(state.seen))


def seen_from_ids(event_ids: list[str]) -> bytes | dict[bytes, None]:
    """The ``seen`` set of a run read back from the store: its stored event ids, oldest
    first (only the newest :data:`SEEN_EVENT_IDS` are kept, as when folding)."""
    return _unpacked(b"".join(uuid.UUID(text).bytes for text in event_ids[-SEEN_EVENT_IDS:]))


def note_folded(state: RunState, partition: int, offset: int, incarnation_ms: int) -> None:
    """Record that the message at ``offset`` of ``partition`` was folded into the run:
    its ``folded_offset`` rises, and starts again in a new broker incarnation (whose
    offsets start again). A message of another partition leaves it alone.

    >>> s = RunState("r", 0)
    >>> note_folded(s, 0, 500, 1); note_folded(s, 0, 3, 1); (s.folded_offset, s.folded_since_ms)
    (500, 1)
    >>> note_folded(s, 0, 3, 2); note_folded(s, 1, 9, 2); (s.folded_offset, s.folded_since_ms)
    (3, 2)
    """
    if partition == state.partition and (
            offset > state.folded_offset or state.folded_since_ms != incarnation_ms):
        state.folded_offset = offset
        state.folded_since_ms = incarnation_ms


def remember(state: RunState, event_id: bytes) -> bool:
    """Add an event id to the run's seen set; False if it was already there.

    >>> s = RunState("r", 0)
    >>> ids = [bytes([n]) * 16 for n in range(SEEN_PACKED_IDS + 1)]
    >>> [remember(s, i) for i in ids[:2]], remember(s, ids[1]), type(s.seen).__name__
    ([True, True], False, 'bytes')
    >>> all(remember(s, i) for i in ids[2:]), remember(s, ids[0]), type(s.seen).__name__
    (True, False, 'dict')
    """
    seen = state.seen
    if isinstance(seen, bytes):
        at = seen.find(event_id)
        while at >= 0:
            if at % _ID == 0:
                return False
            at = seen.find(event_id, at + 1)
        if len(seen) < SEEN_PACKED_IDS * _ID:
            state.seen = seen + event_id
            return True
        seen = state.seen = dict.fromkeys(_split(seen))
    if event_id in seen:
        return False
    seen[event_id] = None
    if len(seen) > SEEN_EVENT_IDS:
        del seen[next(iter(seen))]
    return True


def new_state(event: EventBase, partition: int, when: int | None = None) -> RunState:
    return RunState(run_id=event.run_id, partition=partition,
                    first_ms=ms(event) if when is None else when)


#: what the fold does with an event, by its class: a model or its msgspec mirror
#: (:func:`loopwatch.ingest.wire.decode_message` with ``structs``) fold alike
RUN_START, STEP, LLM_CALL, TOOL_CALL, RUN_END, LABEL, ANNOTATION = range(7)
_KIND_OF_MODEL: dict[type, int] = {
    RunStart: RUN_START, Step: STEP, LlmCall: LLM_CALL, ToolCall: TOOL_CALL, RunEnd: RUN_END,
    Label: LABEL, Annotation: ANNOTATION}
assert set(_KIND_OF_MODEL) == set(EVENT_TYPES), "a new event type needs its fold kind"
_MODEL_OF_TAG = {model.model_fields["event_type"].default: model for model in EVENT_TYPES}
KINDS: dict[type, int] = {
    **_KIND_OF_MODEL,
    **{struct: _KIND_OF_MODEL[_MODEL_OF_TAG[struct.event_type]]  # type: ignore[attr-defined]
       for struct in MIRRORS},
    **{struct: _KIND_OF_MODEL[model] for struct, model in CLAIM_MIRRORS.items()},
}


def kind_of(event: EventBase) -> int:
    """The fold kind of an event (model or struct), one dict look-up; a subclass of a
    model (none in the code base) is found by its bases.

    >>> kind_of(Step(run_id="r", agent="a", step=1)) == STEP
    True
    """
    kind = KINDS.get(type(event))
    if kind is None:
        kind = next(KINDS[base] for base in type(event).__mro__ if base in KINDS)
    return kind


_intern = sys.intern


def _take_dimensions(state: RunState, event: EventBase, authoritative: bool) -> None:
    """Copy the event's dimensions the run lacks (all of them from ``run.start``),
    interned (see :data:`_SHARED_STRINGS`). Written out field by field: a loop over
    :data:`DIMENSIONS` with ``getattr``/``setattr`` cost twice as much per event."""
    if authoritative:
        for name in DIMENSIONS:
            value = getattr(event, name)
            if value:
                setattr(state, name, _intern(value))
        return
    if not state.agent and event.agent:
        state.agent = _intern(event.agent)
    if not state.agent_version and event.agent_version:
        state.agent_version = _intern(event.agent_version)
    if not state.task_type and event.task_type:
        state.task_type = _intern(event.task_type)
    if not state.model and event.model:
        state.model = _intern(event.model)
    if not state.prompt_version and event.prompt_version:
        state.prompt_version = _intern(event.prompt_version)
    if not state.deployment and event.deployment:
        state.deployment = _intern(event.deployment)
    if not state.traffic_slice and event.traffic_slice:
        state.traffic_slice = _intern(event.traffic_slice)
    if not state.worker_id and event.worker_id:
        state.worker_id = _intern(event.worker_id)


def _detect_loop(state: RunState, action: str, window: int, repeats: int) -> None:
    recent = state.recent_actions
    if recent is None:
        recent = state.recent_actions = []
    recent.append(action)
    if len(recent) > window:
        del recent[:-window]
    if state.loop_detected:
        return
    count = recent.count(action)
    if count >= repeats:
        tool, _, args_hash = action.partition(":")
        state.loop_detected = True
        state.loop_summary = (
            f"{tool} called {count}x with args {args_hash} within {window} tool calls"
        )


def apply_event(
    state: RunState,
    event: EventBase,
    *,
    priced_cost: float = 0.0,
    loop_window: int = 10,
    loop_repeats: int = 3,
    when: int | None = None,
    kind: int | None = None,
) -> bool:
    """Fold one event (a model, or its struct) into the run; False when it was already
    applied (a redelivery). ``when`` (its time, epoch ms) and ``kind``
    (:func:`kind_of`) save the caller's second computation of them.

    >>> from loopwatch.ingest.events import ToolCall
    >>> s = RunState("r", 0)
    >>> calls = [ToolCall(run_id="r", agent="a", tool="grep", args_hash="h") for _ in range(3)]
    >>> [apply_event(s, c) for c in calls], s.loop_detected, apply_event(s, calls[0])
    ([True, True, True], True, False)
    """
    if not remember(state, event.event_id.int.to_bytes(16, "big")):  # UUID.bytes, in C
        return False
    if when is None:
        when = ms(event)
    if kind is None:
        kind = kind_of(event)
    if state.awaiting_run and kind != LABEL:
        state.awaiting_run = False  # the run arrived: its time and dimensions are its own
        state.first_ms = when
        if when > state.last_ms:
            state.last_ms = when
        for name in DIMENSIONS:
            setattr(state, name, "")
    elif state.version:
        if when > state.last_ms:
            state.last_ms = when
        if when < state.first_ms:
            state.first_ms = when
    else:  # the run's first event: any time, 1900 (negative ms) and 1970 (0) included
        state.last_ms = state.first_ms = when
    state.version += 1
    _take_dimensions(state, event, kind == RUN_START)
    if kind == LLM_CALL:
        call: LlmCall = event  # type: ignore[assignment]  # or its struct: same fields
        state.llm_calls += 1
        state.llm_errors += call.is_error
        state.input_tokens += call.input_tokens
        state.output_tokens += call.output_tokens
        state.cache_read_tokens += call.cache_read_input_tokens
        state.cache_creation_tokens += call.cache_creation_input_tokens
        state.cost_usd += priced_cost
        state.reported_cost_usd += call.cost_usd or 0.0
    elif kind == TOOL_CALL:
        tool: ToolCall = event  # type: ignore[assignment]
        state.tool_calls += 1
        state.tool_errors += tool.is_error
        if tool.attempt == 1:  # a retry repeats the call, not the agent's decision
            _detect_loop(state, f"{tool.tool}:{tool.args_hash}", loop_window, loop_repeats)
    elif kind == STEP:
        state.steps += 1
    elif kind == RUN_START:
        start: RunStart = event  # type: ignore[assignment]
        state.started_ms = when
        state.time_cap_s = start.time_cap_s
    elif kind == RUN_END:
        end: RunEnd = event  # type: ignore[assignment]
        state.end_ms = when
        state.abandoned_ms = None
        state.terminal_reason = _intern(end.terminal_reason or "")
        state.cap = _intern(end.cap or "")
    elif kind == LABEL:
        label: Label = event  # type: ignore[assignment]
        state.verdict = _intern(label.verdict)
        state.label_source = _intern(label.label_source)
    return True


def pending_label_state(run_id: str, partition: int, labels: list[dict[str, Any]]
                        ) -> RunState:
    """The state of labels (``labels`` rows: event_id, ts as epoch ms, agent, verdict,
    label_source; oldest first) waiting for their run, as the store rebuilds it when
    the changelog that held it is gone.

    >>> rows = [{"event_id": "0" * 32, "ts": 5_000, "agent": "a", "verdict": "wrong",
    ...          "label_source": "human"}]
    >>> state = pending_label_state("r", 3, rows)
    >>> state.awaiting_run, state.verdict, state.outcome, state.first_ms, len(seen_ids(state))
    (True, 'wrong', '', 5000, 1)
    """
    state = RunState(run_id=run_id, partition=partition, awaiting_run=True)
    for label in labels:
        apply_event(state, Label(run_id=run_id, event_id=uuid.UUID(str(label["event_id"])),
                                 agent=label["agent"], verdict=label["verdict"],
                                 label_source=label["label_source"]),
                    when=int(label["ts"]))
    return state


def abandon_if_expired(state: RunState, watermark_ms: int, ttl_ms: int) -> bool:
    """Close a run with no ``run.end`` once event time passes its last event + TTL.

    >>> s = RunState("r", 0, last_ms=1_000)
    >>> abandon_if_expired(s, 5_000, 10_000), abandon_if_expired(s, 11_000, 10_000), s.outcome
    (False, True, 'abandoned')
    """
    if state.closed or watermark_ms < state.last_ms + ttl_ms:
        return False
    state.abandoned_ms = state.last_ms + ttl_ms
    state.version += 1
    return True
