"""Agent traffic in simulated (event) time, with an incident injected at a chosen moment.

Unlike the demo's real-time fleet, this generator stamps every event with a simulated
time, so days of history and hour-long incidents cost seconds: the rules run on event
time and cannot tell. Runs are drawn from seeded random streams, so a scenario is
reproducible. An :class:`Injection` changes how the target agent behaves from its start.
"""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from loopwatch.ingest.events import EventBase, Label, LlmCall, RunEnd, RunStart, Step, ToolCall
from loopwatch.processors.pricing import PriceTable


@dataclass(frozen=True)
class Behaviour:
    """How runs of one agent behave; an injection swaps in a modified copy."""

    loop_share: float = 0.0
    gave_up_share: float = 0.01
    budget_share: float = 0.005
    crash_share: float = 0.0
    abandon_share: float = 0.0
    label_share: float = 0.2
    wrong_share_of_labels: float = 0.01
    input_multiplier: float = 1.0
    cache_works: bool = True
    tool_error_share: float = 0.002
    failing_tool: str | None = None
    tool_timeout_ms: float = 8000.0
    tool_median_ms: float = 300.0
    rate_limit_share: float = 0.001
    permanent_400_attempts: int = 0
    #: each call of ``failing_tool`` (every tool if None) takes this many attempts: the
    #: earlier ones fail with a transient 503, the last gets through (RSUCC, A24)
    tool_retry_attempts: int = 1
    #: an orchestrator re-queues each run this many more times, as new runs sharing its
    #: ``job_id`` (the job layer of retry amplification)
    job_retries: int = 0
    #: runs this long (model calls), each re-sending this many more tokens per step
    #: (QUAD: output and the raw tool result); None = the agent's own steps
    steps: tuple[int, int] | None = None
    context_growth: int = 300
    #: this share of successful runs gets both an LLM judge's and a human's label: the
    #: human finds ``human_wrong_share`` wrong; the judge agrees with the human except on
    #: ``judge_flip_share`` of them, or passes everything (``judge_always_pass``)
    judge_share: float = 0.0
    human_wrong_share: float = 0.2
    judge_flip_share: float = 0.0
    judge_always_pass: bool = False
    #: the judge reports a position flip (order swapped, verdict changed) this often
    judge_position_flip_share: float = 0.0
    #: every run takes its agent's tools in the same order: a pipeline, not an agent
    fixed_path: bool = False
    response_model: str = "claude-sonnet-4-20260901"
    output_tokens: tuple[int, int] = (80, 400)


@dataclass(frozen=True)
class Agent:
    name: str
    model: str = "claude-sonnet-4"
    runs_per_minute: float = 3.0
    system_tokens: int = 4000
    tools: tuple[str, ...] = ("search", "fetch", "lookup")
    steps: tuple[int, int] = (2, 5)
    behaviour: Behaviour = field(default_factory=Behaviour)


@dataclass(frozen=True)
class Injection:
    agent: str
    at: datetime
    behaviour: Behaviour


class Traffic:
    """Generates the events of a fleet over a time range, in time order per run."""

    def __init__(self, agents: tuple[Agent, ...], seed: int) -> None:
        self.agents = agents
        self.seed = seed
        self.prices = PriceTable.load()

    def events(self, start: datetime, end: datetime,
               injection: Injection | None = None) -> Iterator[EventBase]:
        for agent in self.agents:
            rng = random.Random(f"{self.seed}:{agent.name}:{start.isoformat()}")
            moment = start
            while True:
                moment += timedelta(minutes=rng.expovariate(agent.runs_per_minute))
                if moment >= end:
                    break
                behaviour = agent.behaviour
                if injection and injection.agent == agent.name and moment >= injection.at:
                    behaviour = injection.behaviour
                if behaviour.job_retries:
                    yield from self._job(agent, behaviour, moment, rng)
                else:
                    yield from self._run(agent, behaviour, moment, rng)

    def _job(self, agent: Agent, b: Behaviour, start: datetime,
             rng: random.Random) -> Iterator[EventBase]:
        """One work item run ``1 + job_retries`` times, a minute apart."""
        job_id = uuid.UUID(int=rng.getrandbits(128)).hex
        for attempt in range(1 + b.job_retries):
            yield from self._run(agent, b, start + timedelta(minutes=attempt), rng,
                                 {"job_id": job_id, "job_attempt": attempt + 1})

    def _run(self, agent: Agent, b: Behaviour, start: datetime, rng: random.Random,
             job: dict[str, object] | None = None) -> Iterator[EventBase]:
        run_id = uuid.UUID(int=rng.getrandbits(128)).hex
        common = {"run_id": run_id, "agent": agent.name, "model": agent.model,
                  "task_type": "support", "prompt_version": "v1", "deployment": "d1"}
        draw = rng.random()
        shares = [("looped", b.loop_share), ("gave_up", b.gave_up_share),
                  ("budget", b.budget_share), ("crash", b.crash_share),
                  ("abandon", b.abandon_share)]
        fate = "success"
        for name, share in shares:
            if draw < share:
                fate = name
                break
            draw -= share
        steps = rng.randint(*(b.steps or agent.steps)) + (4 if fate in ("looped", "budget")
                                                           else 0)
        clock = start
        yield RunStart(ts=clock, step_cap=12, **common, **(job or {}))  # type: ignore[arg-type]
        for number in range(steps):
            clock += timedelta(seconds=rng.uniform(2, 6))
            yield Step(ts=clock, step=number, **common)
            yield from self._llm(agent, b, clock, number, common, rng)
            if fate == "looped":
                tool = agent.tools[0]
            elif b.fixed_path:
                tool = agent.tools[number % len(agent.tools)]
            else:
                tool = rng.choice(agent.tools)
            args = "loop" if fate == "looped" and number >= steps - 4 else f"{number}"
            if b.tool_retry_attempts > 1 and b.failing_tool in (None, tool):
                yield from self._retried_tool(b, clock, tool, args, common, rng)
            else:
                yield self._tool(b, clock, tool, args, common, rng)
        clock += timedelta(seconds=1)
        if fate == "abandon":
            return
        reason = {"looped": "cap", "gave_up": "cannot_complete", "budget": "cap",
                  "crash": "crash"}.get(fate, "model_done")
        yield RunEnd(ts=clock, terminal_reason=reason,
                     cap="step" if reason == "cap" else None, **common)
        if fate == "success" and rng.random() < b.label_share:
            verdict = "wrong" if rng.random() < b.wrong_share_of_labels else "correct"
            yield Label(ts=clock + timedelta(minutes=1), verdict=verdict, **common)
        if fate == "success" and b.judge_share and rng.random() < b.judge_share:
            yield from self._judged(b, clock, common, rng)

    @staticmethod
    def _judged(b: Behaviour, clock: datetime, common: dict[str, str],
                rng: random.Random) -> Iterator[EventBase]:
        """A judge's label and a human's for one run (JUDGE)."""
        human = "wrong" if rng.random() < b.human_wrong_share else "correct"
        flipped = rng.random() < b.judge_flip_share
        judge = ("correct" if b.judge_always_pass
                 else {"wrong": "correct", "correct": "wrong"}[human] if flipped else human)
        flip = (rng.random() < b.judge_position_flip_share
                if b.judge_position_flip_share else None)
        yield Label(ts=clock + timedelta(minutes=2), verdict=judge, label_source="judge",
                    position_flipped=flip, **common)
        yield Label(ts=clock + timedelta(minutes=3), verdict=human, label_source="human",
                    **common)

    def _llm(self, agent: Agent, b: Behaviour, clock: datetime, number: int,
             common: dict[str, str], rng: random.Random) -> Iterator[EventBase]:
        system = int(agent.system_tokens * b.input_multiplier)
        context = system + b.context_growth * number + rng.randint(0, 100)
        cached = system if b.cache_works and number > 0 else 0
        written = system if number == 0 or not b.cache_works else 0  # broken: every call
        attempts = b.permanent_400_attempts
        for attempt in range(1, attempts + 1):
            yield LlmCall(ts=clock, step=number, provider="anthropic", attempt=attempt,
                          input_tokens=context, http_status=400, error_type="invalid_request",
                          response_model=b.response_model, **common)
        if attempts:
            return
        limited = rng.random() < b.rate_limit_share
        output = rng.randint(*b.output_tokens)
        # the system prompt's hash: one per agent, or (a timestamp ahead of the cache
        # breakpoint) a new one on every call
        system_hash = (f"{agent.name}-system" if b.cache_works
                       else f"{agent.name}-system-{common['run_id']}-{number}")
        yield LlmCall(
            ts=clock, step=number, provider="anthropic", input_tokens=context,
            system_prompt_hash=system_hash,
            output_tokens=0 if limited else output, cache_read_input_tokens=cached,
            cache_creation_input_tokens=written, response_model=b.response_model,
            http_status=429 if limited else 200, error_type="rate_limited" if limited else None,
            latency_ms=rng.lognormvariate(math.log(900), 0.3), **common)

    def _retried_tool(self, b: Behaviour, clock: datetime, tool: str, args: str,
                      common: dict[str, str], rng: random.Random) -> Iterator[ToolCall]:
        """One operation retried until it gets through on its last attempt."""
        for attempt in range(1, b.tool_retry_attempts):
            yield ToolCall(ts=clock + timedelta(milliseconds=attempt), tool=tool,
                           args_hash=args, attempt=attempt, latency_ms=50.0,
                           timeout_ms=b.tool_timeout_ms, error_type="http_5xx",
                           http_status=503, **common)
        last = self._tool(b, clock, tool, args, common, rng)
        yield last.model_copy(update={
            "ts": clock + timedelta(milliseconds=b.tool_retry_attempts),
            "attempt": b.tool_retry_attempts})

    def _tool(self, b: Behaviour, clock: datetime, tool: str, args: str,
              common: dict[str, str], rng: random.Random) -> ToolCall:
        duration = rng.lognormvariate(math.log(b.tool_median_ms), 0.4)
        if duration > b.tool_timeout_ms:
            return ToolCall(ts=clock, tool=tool, args_hash=args, latency_ms=b.tool_timeout_ms,
                            timeout_ms=b.tool_timeout_ms, timed_out=True, error_type="timeout",
                            late_completion_ms=duration, **common)
        share = b.tool_error_share if b.failing_tool in (None, tool) else 0.002
        failed = rng.random() < share
        return ToolCall(ts=clock, tool=tool, args_hash=args, latency_ms=duration,
                        timeout_ms=b.tool_timeout_ms, error_type="http_5xx" if failed else None,
                        http_status=503 if failed else 200, result_count=rng.randint(1, 10),
                        **common)
