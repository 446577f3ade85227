"""An agent process for the delivery fault tests: emits scripted runs through the SDK
found from the data dir, then either waits to be killed or waits for confirmation.

    python -m tests.delivery_agent DATA_DIR AGENT FIRST RUNS SPOOL_NAME hang|confirm

Prints one JSON line of the emitter's figures once everything it emitted is
acknowledged or spooled (``hang``: then sleeps until killed) or confirmed (``confirm``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import orjson

from loopwatch.ingest.events import LlmCall, RunEnd, RunStart, Step
from loopwatch.ingest.sdk import Emitter

#: terminal reason -> outcome, cycled over the runs
SCRIPT = (("model_done", "success"), ("crash", "hard_error"), ("cap", "budget_exhausted"),
          ("cannot_complete", "gave_up"))
EVENTS_PER_RUN = 8  # run.start, 3 x (step, llm.call), run.end


def run_id(agent: str, index: int) -> str:
    return f"{agent}-{index:05d}"


def outcome(index: int) -> str:
    return SCRIPT[index % len(SCRIPT)][1]


def emit_run(emitter: Emitter, agent: str, index: int) -> None:
    """One scripted run of 8 events, emitted back to back (one sender batch)."""
    reason = SCRIPT[index % len(SCRIPT)][0]
    common = {"run_id": run_id(agent, index), "agent": agent, "model": "gpt-4o"}
    events = [RunStart(**common)]
    for step in range(3):
        events += [Step(**common, step=step),
                   LlmCall(**common, step=step, input_tokens=100, output_tokens=10)]
    events.append(RunEnd(**common, terminal_reason=reason, total_steps=3,
                         **({"error_type": "ToolCrash"} if reason == "crash" else {}),
                         **({"cap": "step"} if reason == "cap" else {})))
    for event in events:
        emitter.emit(event)


def main(data_dir: str, agent: str, first: str, runs: str, spool_name: str, mode: str) -> None:
    emitter = Emitter(data_dir=Path(data_dir), spool_name=spool_name, max_message_bytes=100_000,
                      producer_config={"max_block_ms": 500, "bootstrap_timeout_ms": 500})
    for index in range(int(first), int(first) + int(runs)):
        emit_run(emitter, agent, index)
    done = emitter.flush(120) if mode == "hang" else emitter.wait_confirmed(300)
    figures = {"done": done, "spool": str(emitter.spool.directory),
               "unconfirmed": emitter.unconfirmed, "resent": emitter.stats.resent,
               "logged": emitter.stats.logged, "sent": emitter.stats.sent}
    print(orjson.dumps(figures).decode(), flush=True)
    if mode == "hang":
        while True:
            time.sleep(60)
    emitter.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
