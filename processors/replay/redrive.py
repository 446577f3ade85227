"""Re-drive agent code against a recording, deterministically (the guide's §2.2 modes).

The model samples and the world moves, so running a changed agent again tells little
about the run that failed. In REPLAY mode (:class:`ReplaySession`) every LLM and tool
call the agent makes is answered from the recording, in order, and compared with what
was recorded: the first place where the agent now does something else (another tool,
other arguments, another prompt, a call too many or too few) is reported with its
position, its kind, and what was expected against what came. ``strict`` raises
:class:`ReplayDivergence` there; lenient mode notes it and goes on answering from the
recording, to show how far the change spreads. In RECORD mode (:class:`RecordSession`)
real callables are wrapped: calls go through and the session keeps an in-memory
recording, which diffs against a stored one with the same rules as ``loopwatch diff``.

Agent code takes the two callables, so the same code runs live, recorded or replayed:

>>> def agent(llm, tool):
...     plan = llm([{"role": "user", "content": "weather in Oslo?"}])
...     found = tool("weather", {"city": plan["city"]})
...     return llm(f"summarise {found}")
>>> recorder = RecordSession(
...     llm=lambda prompt: {"city": "Oslo"} if isinstance(prompt, list) else "cold",
...     tool=lambda name, args: {"temp_c": -3})
>>> agent(recorder.llm, recorder.tool)
'cold'
>>> recording = recorder.recording
>>> [(s.type, s.tool) for s in recording.steps]
[('llm', None), ('tool', 'weather'), ('llm', None)]

Replaying the unchanged agent gives the recorded answers and no divergence:

>>> session = ReplaySession(recording)
>>> agent(session.llm, session.tool), session.finish()
('cold', [])

An agent changed to look up another city diverges at the tool call (position 1):

>>> def changed(llm, tool):
...     llm([{"role": "user", "content": "weather in Oslo?"}])
...     return tool("weather", {"city": "Bergen"})
>>> session = ReplaySession(recording)
>>> try:
...     changed(session.llm, session.tool)
... except ReplayDivergence as exc:
...     print(exc)
step #1: tool input differs: expected {'city': 'Oslo'} vs actual {'city': 'Bergen'}

Lenient mode keeps answering from the recording and lists every divergence, here the
changed input and the LLM call the changed agent never made:

>>> session = ReplaySession(recording, strict=False)
>>> changed(session.llm, session.tool)
{'temp_c': -3}
>>> [(d.index, d.kind) for d in session.finish()]
[(1, 'tool_input'), (2, 'missing_step')]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import orjson

from loopwatch.ingest.capture import TRUNCATION_MARK
from loopwatch.processors.replay.diff import Divergence, DivergenceKind
from loopwatch.processors.replay.recording import CaptureStatus, Recording, Step, StepType

if TYPE_CHECKING:  # the CLI imports this module at every start: the store client waits
    from loopwatch.store.reader import Reader


class ReplayDivergence(AssertionError):
    """The agent did something other than the recording at ``divergence.index``."""

    def __init__(self, divergence: Divergence) -> None:
        self.divergence = divergence
        super().__init__(_describe(divergence))


class ReplayExhausted(ReplayDivergence):
    """The agent made more calls than the recording holds: there is nothing to answer."""


def _describe(divergence: Divergence) -> str:
    """Expected (recorded) against actual (now), for people reading a failed replay."""
    where = f"step #{divergence.index}"
    if divergence.kind == "extra_step":
        return (f"{where}: the recording has no more steps; the agent made an extra "
                f"{divergence.b}")
    if divergence.kind == "missing_step":
        return f"{where}: the agent stopped; the recording still has {divergence.a}"
    label = divergence.kind.replace("_", " ")
    return f"{where}: {label} differs: expected {divergence.a!r} vs actual {divergence.b!r}"


def as_recorded(value: Any) -> Any:
    """``value`` as it reads back from capture: strings as they are, anything else
    through JSON (tuples become lists, keys strings), as the capture codec stores it.

    >>> as_recorded(("a", {1: 2}))
    ['a', {'1': 2}]
    """
    if value is None or isinstance(value, str):
        return value
    return orjson.loads(orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS, default=str))


def _text_of(value: Any) -> str:
    return value if isinstance(value, str) else orjson.dumps(
        value, option=orjson.OPT_NON_STR_KEYS, default=str).decode()


def matches(recorded: Any, actual: Any, truncated: bool = False) -> bool:
    """Whether ``actual`` is what was recorded. A part stored truncated matches any value
    whose encoded body starts with the kept prefix.

    >>> matches("abc" + TRUNCATION_MARK, "abcdef", truncated=True)
    True
    """
    if not truncated:
        return bool(recorded == actual)
    if isinstance(recorded, list) and isinstance(actual, list) and len(recorded) == len(actual):
        return all(matches(r, a, True) for r, a in zip(recorded, actual, strict=True))
    if isinstance(recorded, str) and recorded.endswith(TRUNCATION_MARK):
        return _text_of(actual).startswith(recorded[:-len(TRUNCATION_MARK)])
    return bool(recorded == actual)


class ReplaySession:
    """Answers an agent's calls from a recording, in order, and checks them (REPLAY mode).

    ``normalize`` is applied to what the agent sends before comparing: pass the
    redactor the emitter used when the recording holds redacted bodies.
    """

    def __init__(self, recording: Recording, strict: bool = True,
                 normalize: Callable[[Any], Any] | None = None) -> None:
        if recording.steps and not recording.has_bodies:
            raise ValueError(f"run {recording.run_id} has no captured bodies to replay "
                             f"({recording.capture.status}: {recording.capture.reason})")
        self.recording = recording
        self.strict = strict
        self.normalize = normalize or (lambda value: value)
        self.position = 0
        self.divergences: list[Divergence] = []
        self._finished = False

    @classmethod
    def load(cls, reader: Reader, run_id: str, strict: bool = True,
             normalize: Callable[[Any], Any] | None = None) -> ReplaySession:
        """A session over the stored recording of ``run_id``."""
        from loopwatch.processors.replay.recording import load_recording

        return cls(load_recording(reader, run_id), strict=strict, normalize=normalize)

    # --- what the agent calls -----------------------------------------------------------

    def llm(self, prompt: Any, **_: Any) -> Any:
        """The recorded response of the next step (extra keyword arguments, such as a
        model name or temperature, are accepted and ignored). Where the recording has a
        tool call instead (a ``tool_name`` divergence, lenient mode), its output."""
        recorded = self._next("llm", None)
        if recorded.type == "llm":
            self._check(recorded, "prompt", recorded.prompt, prompt)
        return recorded.response if recorded.type == "llm" else recorded.output

    def tool(self, name: str, args: Any = None) -> Any:
        """The recorded output of the next step (a recorded LLM step's response when the
        recording has an LLM call here: a ``tool_name`` divergence, lenient mode)."""
        recorded = self._next("tool", name)
        if recorded.type == "tool" and recorded.tool == name:
            self._check(recorded, "tool_input", recorded.args, args)
        return recorded.output if recorded.type == "tool" else recorded.response

    def finish(self) -> list[Divergence]:
        """Close the session: steps left in the recording are ``missing_step``
        divergences. Returns every divergence, the first one first."""
        if not self._finished:
            self._finished = True
            for step in self.recording.steps[self.position:]:
                self._diverge(Divergence(step.index, "missing_step", _summary(step), None,
                                         step.step, None))
        return list(self.divergences)

    @property
    def first_divergence(self) -> Divergence | None:
        return self.divergences[0] if self.divergences else None

    @property
    def remaining(self) -> int:
        return len(self.recording.steps) - self.position

    def __enter__(self) -> ReplaySession:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is None:
            self.finish()

    # --- internals ----------------------------------------------------------------------

    def _next(self, kind: StepType, tool: str | None) -> Step:
        steps = self.recording.steps
        if self.position >= len(steps):
            divergence = Divergence(self.position, "extra_step", None,
                                    f"{kind} call" + (f" to {tool}" if tool else ""))
            self.divergences.append(divergence)
            raise ReplayExhausted(divergence)
        recorded = steps[self.position]
        self.position += 1
        if recorded.tool != tool:  # None for an LLM call: another kind of step is here
            self._diverge(Divergence(recorded.index, "tool_name", recorded.tool, tool,
                                     recorded.step, recorded.step))
        return recorded

    def _check(self, recorded: Step, kind: DivergenceKind, expected: Any, actual: Any) -> None:
        part = "prompt" if kind == "prompt" else "args"
        actual = as_recorded(self.normalize(actual))
        if not matches(expected, actual, part in recorded.truncated):
            self._diverge(Divergence(recorded.index, kind, expected, actual,
                                     recorded.step, recorded.step))

    def _diverge(self, divergence: Divergence) -> None:
        self.divergences.append(divergence)
        if self.strict:
            raise ReplayDivergence(divergence)


def _summary(step: Step) -> str:
    return f"{step.type} call" + (f" to {step.tool}" if step.tool else "")


class RecordSession:
    """Wraps real callables (RECORD mode): calls go through unchanged and are kept as an
    in-memory :class:`Recording` that diffs against a stored one."""

    def __init__(self, llm: Callable[..., Any] | None = None,
                 tool: Callable[[str, Any], Any] | None = None,
                 run_id: str = "recorded",
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._llm = llm
        self._tool = tool
        self.run_id = run_id
        self._clock = clock
        self.steps: list[Step] = []

    def llm(self, prompt: Any, **kwargs: Any) -> Any:
        if self._llm is None:
            raise RuntimeError("this RecordSession wraps no LLM callable")
        started = self._clock()
        response = self._llm(prompt, **kwargs)
        self._keep("llm", prompt=as_recorded(prompt), response=as_recorded(response),
                   latency_ms=(self._clock() - started) * 1000)
        return response

    def tool(self, name: str, args: Any = None) -> Any:
        if self._tool is None:
            raise RuntimeError("this RecordSession wraps no tool callable")
        started = self._clock()
        output = self._tool(name, args)
        self._keep("tool", tool=name, args=as_recorded(args), output=as_recorded(output),
                   latency_ms=(self._clock() - started) * 1000)
        return output

    def _keep(self, kind: StepType, **values: Any) -> None:
        index = len(self.steps)
        self.steps.append(Step(index=index, step=index, type=kind, **values))

    @property
    def recording(self) -> Recording:
        parts = 2 * len(self.steps)
        return Recording(run_id=self.run_id, outcome="recorded", steps=tuple(self.steps),
                         capture=CaptureStatus("kept", "recorded in memory", parts))

    def diff(self, stored: Recording) -> list[Divergence]:
        """How this session differs from ``stored`` (A = stored, B = this session)."""
        from loopwatch.processors.replay.diff import diff_recordings

        return diff_recordings(stored, self.recording)


def replay(recording: Recording, agent: Callable[..., Any], strict: bool = True
           ) -> tuple[Any, Sequence[Divergence]]:
    """Run ``agent(llm, tool)`` against ``recording``; its result and the divergences.

    In strict mode the first divergence raises :class:`ReplayDivergence`.
    """
    session = ReplaySession(recording, strict=strict)
    result = agent(session.llm, session.tool)
    return result, session.finish()
