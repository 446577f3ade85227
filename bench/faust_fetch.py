"""faust's own fetch path against a plain aiokafka consumer, on the same data in one run.

    python -m loopwatch.bench.faust_fetch [--events N] [--repeats R] [--json]
        [--faust SETTING=VALUE ...] [--take N] [--within S]

One embedded broker; the bench's event mix (:func:`loopwatch.bench.pipeline.generate_events`)
emitted once through the SDK; then, ``R`` times in turn: the raw consumer of
``loopwatch bench`` (:func:`loopwatch.bench.pipeline.raw_consume`: aiokafka, no group, every
partition, ``orjson.loads`` of each message) and a faust worker in a child process with
the processor's own app (:func:`loopwatch.processors.app.faust_app`: its settings and
consumer) and its ``take_events`` batching, that does the same ``orjson.loads`` and
nothing else: no fold, no writes. Each reads the whole topic (the faust child in a fresh
consumer group, its join excluded: both rates run from the first batch to the N-th
event). ``ratio`` is the median of the paired ``faust / raw`` rates: what faust leaves of
the raw consumer before the processor does any work; beside it the CPU per event of each
(faust's process from its first batch; the raw consumer's whole call, its connection
included). ``--faust`` overrides a faust setting in the child (values are JSON, else
strings), ``--take`` and ``--within`` the batching, to tune them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from loopwatch.core.config import load_settings

#: how long the faust child may take to join and read everything
CHILD_TIMEOUT_S = 900


def _count(value: bytes | None) -> int:
    """Events in a message, read as the raw consumer reads them."""
    body = orjson.loads(value or b"null")
    if isinstance(body, dict) and "envelope_version" in body:
        return len(body["events"])
    return 1


def child(bootstrap: str, expected: int, group: str, overrides: dict[str, Any],
          take: int, within: float, out: Path) -> None:
    """The faust side (in its own process: a faust worker owns its event loop): write
    ``out``, events/s and process CPU per event, once ``expected`` events came (faust's
    worker takes stdout over for its log)."""
    import faust

    from loopwatch.processors.app import faust_app

    settings = load_settings()
    app = faust_app(group, settings, bootstrap, **overrides)
    topic = app.topic(settings.events_topic, key_type=bytes, value_type=bytes,
                      key_serializer="raw", value_serializer="raw",
                      partitions=settings.partitions)
    seen = 0
    first = first_cpu = 0.0

    async def fetch(stream: Any) -> None:
        nonlocal seen, first, first_cpu
        async for events in stream.take_events(take, within=within):
            if not first:
                first, first_cpu = time.monotonic(), time.process_time()
            for event in events:
                seen += _count(event.message.value)
            if seen >= expected:
                elapsed = time.monotonic() - first
                cpu = time.process_time() - first_cpu
                out.write_bytes(orjson.dumps({"events_per_s": seen / elapsed,
                                              "cpu_us_per_event": cpu * 1e6 / seen}))
                os._exit(0)  # the figure is out; a faust shutdown takes seconds

    app.agent(topic, name="fetch-only")(fetch)
    worker = faust.Worker(app, loglevel="WARNING", quiet=True)
    worker.execute_from_commandline()


def faust_consume(bootstrap: str, expected: int, group: str, overrides: dict[str, Any],
                  take: int, within: float) -> dict[str, float]:
    """Run :func:`child` and return its figures."""
    argv = [sys.executable, "-m", "loopwatch.bench.faust_fetch", "--child",
            "--bootstrap", bootstrap, "--expected", str(expected), "--group", group,
            "--take", str(take), "--within", str(within)]
    for name, value in overrides.items():
        argv += ["--faust", f"{name}={orjson.dumps(value).decode()}"]
    with tempfile.TemporaryDirectory(prefix="loopwatch-faust-fetch-") as cwd:
        out = Path(cwd) / "figures.json"
        done = subprocess.run([*argv, "--out", str(out)], capture_output=True,
                              timeout=CHILD_TIMEOUT_S, cwd=cwd,
                              env={**os.environ, "LOOPWATCH_KAFKA_BOOTSTRAP": bootstrap})
        if not out.exists():
            raise RuntimeError(f"the faust child wrote no figure (exit {done.returncode}): "
                               f"{(done.stdout + done.stderr).decode()[-3000:]}")
        figures: dict[str, float] = orjson.loads(out.read_bytes())
    return figures


def measure_fetch(events: int, repeats: int, overrides: dict[str, Any], take: int | None,
                  within: float | None) -> dict[str, Any]:
    """Emit ``events`` once, then ``repeats`` paired passes: raw consumer, faust."""
    from loopwatch.bench.pipeline import emit_all, generate_events, raw_consume
    from loopwatch.core.embedded.broker import EmbeddedBroker
    from loopwatch.core.topics import ensure_topics

    settings = load_settings()
    take = take or settings.batch_max_events
    within = within or settings.batch_max_wait_s
    with tempfile.TemporaryDirectory(prefix="loopwatch-fetch-") as tmp:
        root = Path(tmp)
        with EmbeddedBroker(root / "broker.log") as broker:
            ensure_topics(broker.bootstrap, settings)
            generated = generate_events(events, seed=7,
                                        end=datetime.now(UTC) - timedelta(minutes=1))
            _, sent = emit_all(broker.bootstrap, generated, root / "spool")
            del generated
            raw: list[float] = []
            raw_cpu: list[float] = []
            fetched: list[dict[str, float]] = []
            for index in range(repeats):
                cpu = time.process_time()
                raw.append(raw_consume(broker.bootstrap, settings.events_topic, sent))
                raw_cpu.append((time.process_time() - cpu) * 1e6 / sent)
                fetched.append(faust_consume(broker.bootstrap, sent,
                                             f"bench-faust-fetch-{os.getpid()}-{index}",
                                             overrides, take, within))
    ratios = [f["events_per_s"] / r for f, r in zip(fetched, raw, strict=True)]
    return {"events": sent, "take": take, "within": within, "faust_overrides": overrides,
            "raw_events_per_s": raw, "raw_cpu_us_per_event": raw_cpu,
            "faust_events_per_s": [f["events_per_s"] for f in fetched],
            "faust_cpu_us_per_event": [f["cpu_us_per_event"] for f in fetched],
            "ratios": ratios, "ratio": statistics.median(ratios)}


def _setting(text: str) -> tuple[str, Any]:
    name, _, value = text.partition("=")
    try:
        return name, orjson.loads(value)
    except orjson.JSONDecodeError:
        return name, value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loopwatch.bench.faust_fetch",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--faust", action="append", default=[], type=_setting,
                        metavar="SETTING=VALUE")
    parser.add_argument("--take", type=int, default=None)
    parser.add_argument("--within", type=float, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--expected", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--group", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    overrides = dict(args.faust)
    if args.child:
        sys.argv = [sys.argv[0], "worker"]  # what faust's command line reads
        child(args.bootstrap, args.expected, args.group, overrides, args.take, args.within,
              args.out)
        return
    result = measure_fetch(args.events, args.repeats, overrides, args.take, args.within)
    if args.json:
        print(orjson.dumps(result).decode())
        return
    pairs = ", ".join(f"{f / 1e3:.0f}k/{r / 1e3:.0f}k" for f, r in
                      zip(result["faust_events_per_s"], result["raw_events_per_s"], strict=True))
    print(f"{result['events']} events, take_events({result['take']}, within="
          f"{result['within']}) {overrides or ''}: faust/raw {result['ratio']:.3f} "
          f"(median of {pairs}); faust CPU "
          f"{statistics.median(result['faust_cpu_us_per_event']):.2f} µs/event, raw "
          f"{statistics.median(result['raw_cpu_us_per_event']):.2f} (its start-up included)")


if __name__ == "__main__":
    main()
