"""What capture costs the agent: caller-side time per ``llm_call`` and Kafka bytes.

    python -m loopwatch.bench.capture_overhead              # ~20 s, prints a table
    python -m loopwatch.bench.capture_overhead --steps 3000 --json

Capture must never block or slow the agent (issue 9), so this measures the only part
the agent waits for: the ``llm_call`` itself, in the caller's thread. Every step sends a
realistic prompt (the agent's ~4.5 KB system prompt plus the conversation so far,
growing to ~20 KB over a 10-step run, as chat agents re-send it on every call) and gets
a ~1 KB response. Three modes, each against one embedded Tansu broker on loopback:

* ``no bodies``: ``llm_call`` with token counts only (what loopwatch cost before capture);
* ``capture off``: bodies given, ``capture="off"``: redaction and hashing only, so the
  event can carry ``prompt_hash``/``response_hash`` and sizes, nothing sent;
* ``capture on``: redaction, hashing, splitting into content-addressed parts, and
  building the capture message, queued for the background sender (which serialises
  it, leaving out bodies the broker already acknowledged).

Reported per step: median and mean microseconds in the caller, the ratio to ``no
bodies``, and the bytes each step puts on Kafka (events topic + captures topic, before
compression; the events include each run's ``run.start``/``step``/``run.end``). The
sender thread shares the GIL with the caller, so its work shows up here as far as it
delays the caller. It is a benchmark, not a test: numbers depend on
what else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

STEPS_PER_RUN = 10
MODES = ("no bodies", "capture off", "capture on")


def conversation(rng: random.Random, steps: int) -> list[tuple[list[dict[str, Any]], str]]:
    """(prompt, response) per step of one run: the prompt grows from ~5 KB to ~20 KB."""
    from loopwatch.simulator import _sentence, system_prompt

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt("bench-agent", 1100)},
        {"role": "user", "content": _sentence(rng, 40) + " Reply to ann@example.com."},
    ]
    calls = []
    for _ in range(steps):
        response = " ".join(_sentence(rng, rng.randint(8, 16)) for _ in range(12))
        calls.append((list(messages), response))
        tool_output = " ".join(_sentence(rng, rng.randint(8, 16)) for _ in range(12))
        messages = [*messages, {"role": "assistant", "content": response},
                    {"role": "tool", "content": tool_output}]
    return calls


def measure(bootstrap: str, folder: Path, mode: str, runs: int, seed: int) -> dict[str, Any]:
    from loopwatch.ingest.sdk import Emitter

    rng = random.Random(seed)
    scripts = [conversation(rng, STEPS_PER_RUN) for _ in range(runs)]
    prompt_bytes = [sum(len(m["content"].encode()) for m in prompt)
                    for script in scripts for prompt, _ in script]
    emitter = Emitter(bootstrap, spool_dir=folder / f"spool-{mode.replace(' ', '-')}",
                      capture="off" if mode == "capture off" else "failures")
    timings: list[int] = []
    try:
        for script in scripts:
            with emitter.run(agent="bench-agent", model="gpt-4o") as run:
                for prompt, response in script:
                    run.step()
                    bodies = {} if mode == "no bodies" else {"prompt": prompt,
                                                            "response": response}
                    started = time.perf_counter_ns()
                    run.llm_call(input_tokens=4000, output_tokens=300, **bodies)
                    timings.append(time.perf_counter_ns() - started)
        emitter.flush(120)
    finally:
        emitter.close()
    steps = len(timings)
    stats = emitter.stats
    return {
        "mode": mode, "steps": steps,
        "median_us": statistics.median(timings) / 1000,
        "mean_us": statistics.fmean(timings) / 1000,
        "p99_us": sorted(timings)[int(0.99 * (steps - 1))] / 1000,
        "prompt_kb_mean": statistics.fmean(prompt_bytes) / 1024,
        "event_bytes_per_step": stats.event_bytes / steps,
        "capture_bytes_per_step": stats.capture_bytes / steps,
        "kafka_bytes_per_step": (stats.event_bytes + stats.capture_bytes) / steps,
        "captures_sent": stats.captures_sent, "events_sent": stats.sent,
    }


def run(steps: int, seed: int = 7) -> dict[str, Any]:
    from loopwatch.core.config import Settings
    from loopwatch.core.embedded.broker import EmbeddedBroker
    from loopwatch.core.topics import ensure_topics

    folder = Path(tempfile.mkdtemp(prefix="capture-bench-"))
    settings = Settings(data_dir=folder)
    runs = max(1, steps // STEPS_PER_RUN)
    results: dict[str, Any] = {}
    with EmbeddedBroker(folder / "broker.log") as broker:
        ensure_topics(broker.bootstrap, settings)
        measure(broker.bootstrap, folder, "capture on", 2, seed + 1)  # connect, warm up
        for mode in MODES:
            results[mode] = measure(broker.bootstrap, folder, mode, runs, seed)
    base = results["no bodies"]["median_us"]
    for mode in MODES:
        results[mode]["ratio_to_no_bodies"] = results[mode]["median_us"] / base
    return {"steps_per_mode": runs * STEPS_PER_RUN, "modes": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.steps, args.seed)
    if args.json:
        print(json.dumps(result))
        return
    modes = result["modes"]
    print(f"{result['steps_per_mode']} llm_call steps per mode, prompts "
          f"{modes['capture on']['prompt_kb_mean']:.1f} KB on average (5-20 KB)")
    print(f"{'mode':<12} {'median µs':>10} {'mean µs':>9} {'p99 µs':>8} {'x no bodies':>12} "
          f"{'Kafka B/step':>13} {'of which capture':>17}")
    for mode in MODES:
        row = modes[mode]
        print(f"{mode:<12} {row['median_us']:>10.1f} {row['mean_us']:>9.1f} "
              f"{row['p99_us']:>8.1f} {row['ratio_to_no_bodies']:>12.2f} "
              f"{row['kafka_bytes_per_step']:>13,.0f} {row['capture_bytes_per_step']:>17,.0f}")


if __name__ == "__main__":
    main()
