"""A scripted fleet whose every figure is known in advance (computed here by hand,
not by loopwatch's code), used as the end-to-end test vector.

Prices: claude-sonnet-4 at $3 / $15 per million input / output tokens; cache writes
1.25x, reads 0.1x. One success run is the seed's prompt-cache example: 15 steps, a
6,000-token stable block, 400 new tokens per step ($0.396 uncached, $0.1737 cached).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from loopwatch.ingest.sdk import Emitter, RunContext
from loopwatch.store.reader import ServiceReader
from tests.conftest import scalar, wait_for, wait_stored

MODEL = "claude-sonnet-4"
SIMPLE_CALL = {"input_tokens": 1000, "output_tokens": 100}
SIMPLE_COST = 1000 * 3e-6 + 100 * 15e-6  # 0.0045
CACHE_RUN_COST = 6000 * 1.25 * 3e-6 + 14 * 6000 * 0.1 * 3e-6 + 42000 * 3e-6  # 0.1737


@dataclass
class Expected:
    run_ids: dict[str, list[str]] = field(default_factory=dict)
    events: int = 0

    def add(self, outcome: str, run_id: str, events: int) -> None:
        self.run_ids.setdefault(outcome, []).append(run_id)
        self.events += events


def emit_fleet(emitter: Emitter, agent: str) -> Expected:
    """10 closed runs: 4 success (one is the cache example), 1 hard_error, 2
    budget_exhausted, 1 gave_up, 1 looped (detector only: the agent says model_done),
    1 abandoned (no run.end). Tool ``search`` (timeout 1000 ms) times out 5 times: true
    durations 1100, 1250, 1300 (near-misses, <= 1.3 x), 2000 (not), one unknown."""
    expected = Expected()
    common = {"agent": agent, "task_type": "qa", "model": MODEL, "prompt_version": "p1",
              "deployment": "d1"}

    with emitter.run(**common) as run:  # the cache example: 15 llm calls
        for k in range(15):
            run.step()
            run.llm_call(input_tokens=6000 + 400 * k,
                         cache_creation_input_tokens=6000 if k == 0 else 0,
                         cache_read_input_tokens=0 if k == 0 else 6000)
        run.end("model_done")
    expected.add("success", run.run_id, 1 + 30 + 1)

    late = [1100.0, 1250.0, 1300.0, 2000.0]
    for index in range(3):
        with emitter.run(**common) as run:
            run.step()
            run.llm_call(**SIMPLE_CALL)
            run.tool_call("search", args={"q": index}, latency_ms=200, timeout_ms=1000)
            run.tool_call("search", args={"q": index + 10}, latency_ms=1000, timeout_ms=1000,
                          timed_out=True, error_type="timeout", late_completion_ms=late.pop())
            run.end("model_done")
        expected.add("success", run.run_id, 6)

    with emitter.run(**common) as run:
        run.step()
        run.llm_call(**SIMPLE_CALL)
        run.tool_call("search", args={"q": "x"}, latency_ms=1000, timeout_ms=1000,
                      timed_out=True, error_type="timeout", late_completion_ms=late.pop())
        run.tool_call("search", args={"q": "y"}, latency_ms=1000, timeout_ms=1000,
                      timed_out=True, error_type="timeout")
        run.end("crash", error_type="ToolCrash")
    expected.add("hard_error", run.run_id, 6)

    for _ in range(2):
        with emitter.run(**common, step_cap=2) as run:
            run.step()
            run.llm_call(**SIMPLE_CALL)
            run.step()
            run.llm_call(**SIMPLE_CALL)
            run.end("cap", cap="step")
        expected.add("budget_exhausted", run.run_id, 6)

    with emitter.run(**common) as run:
        run.step()
        run.llm_call(**SIMPLE_CALL)
        run.end("cannot_complete")
    expected.add("gave_up", run.run_id, 4)

    with emitter.run(**common) as run:
        for _ in range(3):
            run.step()
            run.llm_call(**SIMPLE_CALL)
            run.tool_call("grep", args={"pattern": "TODO"}, latency_ms=5)
        run.end("model_done")
    expected.add("looped", run.run_id, 1 + 9 + 1)

    crashed = RunContext(emitter, uuid.uuid4().hex, dict(common))
    crashed.start()
    crashed.step()
    crashed.llm_call(**SIMPLE_CALL)  # ... and the worker died: no run.end, ever
    expected.add("abandoned", crashed.run_id, 3)
    return expected


COSTS = {
    "success": CACHE_RUN_COST + 3 * SIMPLE_COST,
    "hard_error": SIMPLE_COST,
    "budget_exhausted": 4 * SIMPLE_COST,
    "gave_up": SIMPLE_COST,
    "looped": 3 * SIMPLE_COST,
    "abandoned": SIMPLE_COST,
}
RUNS = {"success": 4, "hard_error": 1, "budget_exhausted": 2, "gave_up": 1, "looped": 1,
        "abandoned": 1}
CACHE_READ = 14 * 6000
CACHE_WRITE = 6000
UNCACHED = 42000 + 13 * 1000  # the cache run's new tokens + 13 simple calls


def emit_and_wait(bootstrap: str, reader: ServiceReader, agent: str,
                  spool: Path) -> tuple[str, Expected]:
    """Emit the fleet and wait until every event is stored and all 10 runs are closed."""
    with Emitter(bootstrap, spool_dir=spool) as emitter:
        expected = emit_fleet(emitter, agent)
    wait_stored(reader, agent, expected.events)
    wait_for(lambda: scalar(reader, "SELECT count() FROM runs FINAL WHERE agent = {a:String} "
                                    "AND status = 'closed'", a=agent) == 10,
             60, what="all 10 runs closed")
    return agent, expected
