"""A simulated agent fleet that emits through the real SDK, in compressed time.

Each run is a generator that yields how long to wait before its next action; one
scheduler thread interleaves all runs, so hundreds of concurrent runs cost one thread.
Every run is planned with an outcome up front (drawn from its agent's outcome mix), so
the fleet knows its own ground truth: ``SimulatorResult.planned`` is what the pipeline
must find. Tool latency has a long (log-normal) tail; one tool's timeout is set a bit
too low, so most of its timeouts are near-misses; one agent's system prompt starts with
the current time, a volatile prefix, so it never reads the prompt cache.

With ``bodies`` (the default) the runs also carry what a real agent would capture
(docs/capture.md): every model call sends the agent's system prompt (the same few KB
on every call of that agent, so capture stores it once) and the conversation so far,
and gets a response; every tool call has arguments and an output. Some user messages
contain an e-mail address or a card number, as real ones do, so redaction has work.
``bodies=False`` (load tests that only need events) skips all of it.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import math
import random
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from loopwatch.ingest.sdk import Emitter, RunContext
from loopwatch.processors.pricing import PriceTable

Plan = Iterator[float]


@dataclass(frozen=True)
class ToolProfile:
    name: str
    median_ms: float
    sigma: float
    timeout_ms: float
    error_rate: float = 0.01


@dataclass(frozen=True)
class AgentProfile:
    name: str
    task_types: tuple[str, ...]
    model: str
    prompt_version: str
    deployment: str
    tools: tuple[ToolProfile, ...]
    outcome_mix: dict[str, float]
    system_tokens: int = 4000
    cache_stable: bool = True
    step_cap: int = 12
    steps: tuple[int, int] = (3, 8)


SEARCH = ToolProfile("web_search", median_ms=700, sigma=0.5, timeout_ms=1500)
FETCH = ToolProfile("fetch_page", median_ms=250, sigma=0.7, timeout_ms=3000)
SQL = ToolProfile("run_sql", median_ms=120, sigma=0.6, timeout_ms=2000)
TICKET = ToolProfile("lookup_ticket", median_ms=80, sigma=0.4, timeout_ms=1000)
REFUND = ToolProfile("issue_refund", median_ms=300, sigma=0.5, timeout_ms=2500, error_rate=0.03)

DEFAULT_FLEET: tuple[AgentProfile, ...] = (
    AgentProfile(
        "support-bot", ("refund", "faq"), "claude-sonnet-4", "support-v12", "deploy-41",
        (TICKET, REFUND, SEARCH),
        {"success": 0.70, "hard_error": 0.04, "budget_exhausted": 0.05, "gave_up": 0.06,
         "looped": 0.05, "wrong": 0.06, "abandoned": 0.04},
    ),
    AgentProfile(
        "research-agent", ("literature", "market"), "claude-opus-4-1", "research-v3",
        "deploy-41", (SEARCH, FETCH),
        {"success": 0.62, "hard_error": 0.03, "budget_exhausted": 0.10, "gave_up": 0.06,
         "looped": 0.08, "wrong": 0.08, "abandoned": 0.03},
        system_tokens=6000, step_cap=14, steps=(4, 10),
    ),
    AgentProfile(
        "sql-analyst", ("report",), "gpt-4o", "analyst-v7", "deploy-40", (SQL, FETCH),
        {"success": 0.74, "hard_error": 0.05, "budget_exhausted": 0.04, "gave_up": 0.05,
         "looped": 0.04, "wrong": 0.05, "abandoned": 0.03},
        system_tokens=3000, cache_stable=False, steps=(3, 7),
    ),
)


_WORD_TEXT = ("the customer order refund policy account ticket status search result page "
          "query table report revenue region quarter source claim evidence summary step "
          "tool answer check verify escalate priority shipping invoice date amount limit "
          "must should never always first then before after only when unless cite")
_WORDS = tuple(_WORD_TEXT.split())


@functools.lru_cache(maxsize=16)
def system_prompt(agent: str, tokens: int) -> str:
    """The agent's system prompt: ~4 characters per token, fixed per agent (seeded)."""
    rng = random.Random(agent)
    lines = [f"You are {agent}, an agent of the loopwatch demo fleet. Follow the rules."]
    size = len(lines[0])
    rule = 0
    while size < tokens * 4:
        rule += 1
        line = f"{rule}. " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 20)))
        lines.append(line + ".")
        size += len(line) + 2
    return "\n".join(lines)


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(_WORDS, k=words)).capitalize() + "."


@dataclass
class SimulatorResult:
    """Ground truth: planned outcomes per agent, and how many events were emitted."""

    planned: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    runs: int = 0

    @property
    def outcomes(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for counts in self.planned.values():
            total.update(counts)
        return total


class RunScript:
    """The actions of one planned run, as a generator of waits (seconds, compressed)."""

    def __init__(self, emitter: Emitter, profile: AgentProfile, outcome: str,
                 rng: random.Random, prices: PriceTable, time_scale: float,
                 after_end: Callable[[float, Plan], None], bodies: bool = True) -> None:
        self.emitter = emitter
        self.profile = profile
        self.outcome = outcome
        self.rng = rng
        self.prices = prices
        self.scale = time_scale
        self.after_end = after_end
        self.args_counter = itertools.count()
        self.bodies = bodies
        self.messages: list[dict[str, Any]] = []
        self.last_response = ""

    def plan(self) -> Plan:
        profile, rng = self.profile, self.rng
        run = RunContext(self.emitter, uuid.UUID(int=rng.getrandbits(128)).hex, {
            "agent": profile.name, "agent_version": "1.4.2",
            "task_type": rng.choice(profile.task_types), "model": profile.model,
            "prompt_version": profile.prompt_version, "deployment": profile.deployment,
            "worker_id": f"worker-{rng.randrange(12)}", "step_cap": profile.step_cap,
        })
        run.start()
        if self.bodies:
            self.messages = [
                {"role": "system", "content": system_prompt(profile.name, profile.system_tokens)},
                {"role": "user", "content": self._task_text(run)},
            ]
        loop_tool = rng.choice(profile.tools)
        steps = {
            "budget_exhausted": profile.step_cap,
            "looped": rng.randint(4, 6),
        }.get(self.outcome, rng.randint(*profile.steps))
        for number in range(steps):
            yield from self._step(run, number, steps, loop_tool)
        yield from self._finish(run)

    def _step(self, run: RunContext, number: int, steps: int, loop_tool: ToolProfile) -> Plan:
        run.step(step_type="plan" if number == 0 else "act",
                 duration_ms=self.rng.uniform(200, 2000))
        self._llm_call(run, number)
        yield self.rng.uniform(0.05, 0.25) * self.scale
        if self.outcome == "looped" and number >= steps - 3:
            yield from self._tool_call(run, loop_tool, {"query": "same thing again"})
        else:
            tool = self.rng.choice(self.profile.tools)
            yield from self._tool_call(run, tool, {"n": next(self.args_counter)})

    def _llm_call(self, run: RunContext, number: int) -> None:
        profile, rng = self.profile, self.rng
        context_tokens = profile.system_tokens + 400 * number + rng.randint(0, 200)
        output = rng.randint(80, 600)
        if profile.cache_stable and number == 0:
            read, creation = 0, profile.system_tokens
        elif profile.cache_stable:
            read, creation = profile.system_tokens, 0
        else:  # a volatile prefix: nothing is ever read from the cache (CACHE)
            read, creation = 0, 0
        status, error = (429, "rate_limited") if rng.random() < 0.01 else (200, None)
        cost = self.prices.cost(profile.model, context_tokens, output, read, creation).cost_usd
        bodies: dict[str, Any] = {}
        if self.bodies:
            if not profile.cache_stable:  # the classic: a timestamp ahead of the breakpoint
                stamp = datetime.now(UTC).isoformat(timespec="microseconds")
                self.messages[0] = {"role": "system", "content": f"Current time: {stamp}\n"
                                    + system_prompt(profile.name, profile.system_tokens)}
            response = " ".join(_sentence(rng, rng.randint(6, 18))
                                for _ in range(max(1, output // 40)))
            bodies = {"prompt": self.messages, "response": response}
            self.last_response = response
        run.llm_call(
            **bodies,
            provider="anthropic" if profile.model.startswith("claude") else "openai",
            response_model=f"{profile.model}-20260901", input_tokens=context_tokens,
            output_tokens=output, cache_read_input_tokens=read,
            cache_creation_input_tokens=creation, cost_usd=round(cost, 8),
            latency_ms=rng.lognormvariate(math.log(900), 0.4), http_status=status,
            error_type=error,
        )
        if self.bodies:  # a copy: the SDK serialised the prompt, the list may change now
            self.messages = [*self.messages, {"role": "assistant", "content": response}]

    def _task_text(self, run: RunContext) -> str:
        rng = self.rng
        text = f"Task ({run.common.get('task_type', '')}): " + _sentence(rng, rng.randint(10, 30))
        if rng.random() < 0.2:
            text += f" Reply to customer{rng.randrange(1000)}@example.com please."
        if rng.random() < 0.05:
            text += " My card is 4111 1111 1111 1111."
        return text

    def _tool_output(self, tool: ToolProfile, args: dict[str, object], size: int) -> Any:
        rng = self.rng
        text = " ".join(_sentence(rng, rng.randint(6, 14)) for _ in range(max(1, size // 90)))
        self.messages = [*self.messages, {"role": "tool", "name": tool.name,
                                          "content": text[:4000]}]
        return {"tool": tool.name, "args": args, "results": text}

    def _tool_call(self, run: RunContext, tool: ToolProfile, args: dict[str, object]) -> Plan:
        rng = self.rng
        duration = rng.lognormvariate(math.log(tool.median_ms), tool.sigma)
        if duration > tool.timeout_ms:
            yield tool.timeout_ms / 1000 * self.scale
            run.tool_call(tool.name, args=args, latency_ms=tool.timeout_ms,
                          timeout_ms=tool.timeout_ms, timed_out=True, error_type="timeout",
                          late_completion_ms=duration)
            return
        yield duration / 1000 * self.scale
        failed = rng.random() < tool.error_rate
        size = rng.randint(200, 20_000)
        output = None
        if self.bodies:
            output = ("503 Service Unavailable" if failed
                      else self._tool_output(tool, args, min(size, 3000)))
        run.tool_call(tool.name, args=args, output=output, latency_ms=duration,
                      timeout_ms=tool.timeout_ms,
                      error_type="http_5xx" if failed else None,
                      http_status=503 if failed else 200,
                      result_count=0 if failed else rng.randint(1, 20),
                      result_size_bytes=size)

    def _finish(self, run: RunContext) -> Plan:
        outcome = self.outcome
        if outcome == "abandoned":
            return  # the worker died: no run.end, ever
        endings: dict[str, tuple[str, dict[str, Any]]] = {
            "hard_error": ("crash", {"error_type": "ToolCrash"}),
            "budget_exhausted": ("cap", {"cap": "step", "step_cap": self.profile.step_cap}),
            "gave_up": ("cannot_complete", {}),
            # half the loopers believe they are done: only the detector catches them
            "looped": (self.rng.choice(("loop_detector", "model_done")), {}),
        }
        reason, extra = endings.get(outcome, ("model_done", {}))
        run.end(reason, **extra)
        if outcome == "wrong" or (outcome == "success" and self.rng.random() < 0.2):
            verdict = "wrong" if outcome == "wrong" else "correct"
            self.after_end(self.rng.uniform(1.0, 3.0) * self.scale,
                           self._label(run, verdict))
        yield 0.0

    @staticmethod
    def _label(run: RunContext, verdict: str) -> Plan:
        run.label(verdict, label_source="post_hoc_check")
        yield 0.0


class FleetSimulator:
    """Starts runs at a Poisson rate and plays them all from one scheduler thread."""

    def __init__(self, emitter: Emitter, fleet: tuple[AgentProfile, ...] = DEFAULT_FLEET,
                 seed: int = 7, time_scale: float = 1.0, bodies: bool = True) -> None:
        self.emitter = emitter
        self.bodies = bodies
        self.fleet = fleet
        self.rng = random.Random(seed)
        self.time_scale = time_scale
        self.prices = PriceTable.load()
        self.result = SimulatorResult()
        self._queue: list[tuple[float, int, Plan]] = []
        self._order = itertools.count()

    def _schedule(self, delay_s: float, plan: Plan) -> None:
        heapq.heappush(self._queue, (time.monotonic() + delay_s, next(self._order), plan))

    def _new_run(self) -> None:
        profile = self.rng.choice(self.fleet)
        outcomes, weights = zip(*profile.outcome_mix.items(), strict=True)
        outcome = self.rng.choices(outcomes, weights)[0]
        self.result.planned[profile.name][outcome] += 1
        self.result.runs += 1
        run_rng = random.Random(self.rng.getrandbits(64) ^ uuid.uuid4().int)
        script = RunScript(self.emitter, profile, outcome, run_rng, self.prices,
                           self.time_scale, self._schedule, bodies=self.bodies)
        self._schedule(0.0, script.plan())

    def run(self, duration_s: float, rate: float, stop: threading.Event | None = None,
            on_tick: Callable[[SimulatorResult], None] | None = None) -> SimulatorResult:
        """Start runs for ``duration_s``, then let every started run play out."""
        stop = stop or threading.Event()
        started = time.monotonic()
        next_run = started
        last_tick = 0.0
        while not stop.is_set():
            now = time.monotonic()
            if now - started < duration_s:
                while next_run <= now:
                    self._new_run()
                    next_run += self.rng.expovariate(rate)
            elif not self._queue:
                break
            while self._queue and self._queue[0][0] <= now:
                _, _, plan = heapq.heappop(self._queue)
                with contextlib.suppress(StopIteration):
                    self._schedule(next(plan), plan)
            if on_tick is not None and now - last_tick >= 0.5:
                last_tick = now
                on_tick(self.result)
            upcoming = [self._queue[0][0]] if self._queue else []
            if now - started < duration_s:
                upcoming.append(next_run)
            wait = min(upcoming, default=now + 0.05) - time.monotonic()
            stop.wait(max(0.0, min(wait, 0.05)))
        return self.result
