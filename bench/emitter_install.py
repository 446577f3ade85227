"""The emitter's rate on the SDK-only install beside the server install (issue #25).

An agent installs ``pip install loopwatch`` (the SDK alone); the bench's emitter figure
is taken in the server's environment. This runs the same emitter loop in both, against
one embedded broker, interleaved (server, SDK, server, SDK, ...) so a noisy machine
shifts both alike, and reports each median and their ratio::

    python -m loopwatch.bench.emitter_install --sdk-python /tmp/sdkvenv/bin/python

The events are generated once here (the simulator is server code) and handed to each
child as JSON lines; a child parses them into the SDK's models before its clock starts,
so only ``Emitter.emit`` and the drain to the broker are timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

#: the child: SDK imports only (``loopwatch`` and ``loopwatch.ingest``), as an agent has
_CHILD = """
import json, sys, time
from loopwatch import Emitter
from loopwatch.ingest.events import parse_event
bootstrap, topic, lines, spool = sys.argv[1:5]
events = [parse_event(json.loads(line)) for line in open(lines)]
emitter = Emitter(bootstrap, topic, spool_dir=spool, confirm="broker")
started = time.monotonic()
for event in events:
    emitter.emit(event)
assert emitter.flush(timeout_s=600), "the emitter did not drain"
elapsed = time.monotonic() - started
assert not emitter.stats.spooled, "events were spooled, not sent"
print(json.dumps({"rate": emitter.stats.sent / elapsed, "sent": emitter.stats.sent,
                  "server_loaded": sorted(m for m in ("faust", "chdb", "scipy")
                                          if m in sys.modules)}))
emitter.close(confirm_timeout_s=0)
"""


def _emit_in(python: str, bootstrap: str, topic: str, lines: Path, spool: Path) -> dict:
    done = subprocess.run([python, "-c", _CHILD, bootstrap, topic, str(lines), str(spool)],
                          capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{python}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdk-python", required=True,
                        help="the python of a venv with only `pip install loopwatch`")
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    from loopwatch.bench.pipeline import generate_events
    from loopwatch.core.config import load_settings
    from loopwatch.core.embedded.broker import EmbeddedBroker
    from loopwatch.core.topics import ensure_topics

    settings = load_settings()
    rates: dict[str, list[float]] = {"server": [], "sdk": []}
    with tempfile.TemporaryDirectory(prefix="loopwatch-emitter-") as tmp:
        root = Path(tmp)
        lines = root / "events.jsonl"
        generated = generate_events(args.events, seed=7,
                                    end=datetime.now(UTC) - timedelta(minutes=1))
        with lines.open("w") as out:
            for event in generated:
                out.write(event.model_dump_json(exclude_none=True) + "\n")
        del generated
        with EmbeddedBroker(root / "broker.log") as broker:
            ensure_topics(broker.bootstrap, settings)
            for round_ in range(args.rounds):
                for name, python in (("server", sys.executable), ("sdk", args.sdk_python)):
                    got = _emit_in(python, broker.bootstrap, settings.events_topic, lines,
                                   root / f"spool-{name}-{round_}")
                    if name == "sdk" and got["server_loaded"]:
                        raise RuntimeError(f"the SDK install loaded {got['server_loaded']}")
                    rates[name].append(got["rate"])
                    print(f"round {round_ + 1}/{args.rounds} {name}: "
                          f"{got['rate'] / 1e3:.1f}k events/s ({got['sent']} sent)",
                          file=sys.stderr, flush=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    print(json.dumps({"events": args.events, "rates": rates, "median": medians,
                      "sdk_over_server": medians["sdk"] / medians["server"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
