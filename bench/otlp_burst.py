"""OTLP ingest end to end: a burst of GenAI spans POSTed over OTLP/HTTP, timed from the
first POST to the last row stored (``otlp_spans_per_s`` of ``loopwatch bench``).

    python -m loopwatch.bench.otlp_burst [--traces 2000] [--runs 3] [--json]

The burst: ``traces`` traces of one ``invoke_agent`` span (the root) with 5 ``chat``
and 5 ``execute_tool`` children (OTel GenAI attributes), each trace's children before
its root as an SDK's span processor exports them, cut into protobuf
``ExportTraceServiceRequest`` bodies of 512 spans (traces straddle bodies), POSTed over
``connections`` keep-alive connections to a real ``loopwatch up`` child (fresh store,
its own topic and consumer group, joined before the burst; detectors held off as for
the pipeline figure). Content is off, as OTel's GenAI instrumentations default to
(``--content`` adds tool arguments, which become capture messages).

Per run, measured from this process, beside each other:

* ``accept_spans_per_s``: spans / (first POST to the last 200): the receiver's decode,
  map and publish with the broker's ack (the HTTP side alone);
* ``otlp_spans_per_s``: spans / (first POST to the moment ``up``'s store accepted the
  burst's last rows, every event in ``events`` and every run closed in ``runs``, as an
  exact check then confirms; :func:`wait_stored`);
* ``at_check_spans_per_s``: the same, closed when that check ended (the poll's view);
* ``lag_s``: last 200 to the last row stored (the processors' and the store's share);
* ``up_cpu_us_per_span``: CPU the ``up`` child and its receiver process used from the
  first POST to the last row stored, per span (receiver, processors, store, the
  polls): on a shared machine the steadier figure.

The figure is the median over ``runs`` bursts (new trace ids each, same ``up``). It is
a benchmark, not a test: numbers depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1 import trace_pb2

from loopwatch.bench.pipeline import (
    BASE_ENV,
    THROUGHPUT_ENV,
    cpu_seconds,
    stored_at,
    wait_group_stable,
)
from loopwatch.core.config import load_settings
from loopwatch.core.embedded.broker import EmbeddedBroker
from loopwatch.core.processes import children
from loopwatch.core.topics import ensure_topics
from loopwatch.upprocess import UpProcess

TRACES = 2000
SPANS_PER_REQUEST = 512
CHATS = TOOLS = 5
SPANS_PER_TRACE = 1 + CHATS + TOOLS
#: run.start + run.end + one llm.call per chat + one tool.call per tool span
EVENTS_PER_TRACE = 2 + CHATS + TOOLS
POLL_S = 0.1
#: dropped connections one client thread reconnects after before it gives up
MAX_RECONNECTS = 20
TOPIC, GROUP = "bench.otlp", "loopwatch-bench-otlp"
#: the ``up`` child's environment beside the broker's (its own topic and group)
ENV = {"LOOPWATCH_EVENTS_TOPIC": TOPIC, "LOOPWATCH_CONSUMER_GROUP": GROUP}
Progress = Callable[[str], None]


def _kv(key: str, value: str | int) -> KeyValue:
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=value))


def trace_spans(rng: random.Random, start_ns: int, agent: str,
                content: bool = False) -> list[trace_pb2.Span]:
    """One agent run as a GenAI instrumentation exports it: children, then the root;
    with ``content`` the tool spans carry their (opt-in) ``gen_ai.tool.call.arguments``."""
    trace_id, root_id = rng.randbytes(16), rng.randbytes(8)
    spans: list[trace_pb2.Span] = []
    t = start_ns
    for step in range(CHATS):
        chat_end = t + rng.randint(200, 2000) * 1_000_000
        spans.append(trace_pb2.Span(
            trace_id=trace_id, span_id=rng.randbytes(8), parent_span_id=root_id,
            name="chat gpt-4o", kind=trace_pb2.Span.SPAN_KIND_CLIENT,
            start_time_unix_nano=t, end_time_unix_nano=chat_end, attributes=[
                _kv("gen_ai.operation.name", "chat"), _kv("gen_ai.provider.name", "openai"),
                _kv("gen_ai.request.model", "gpt-4o"),
                _kv("gen_ai.response.model", "gpt-4o-2024-08-06"),
                _kv("gen_ai.response.id", f"chatcmpl-{rng.getrandbits(40):x}"),
                _kv("gen_ai.usage.input_tokens", rng.randint(1000, 8000)),
                _kv("gen_ai.usage.output_tokens", rng.randint(10, 400)),
                _kv("gen_ai.usage.cache_read.input_tokens", 512)]))
        tool = rng.choice(("search", "lookup_ticket", "run_sql"))
        tool_end = chat_end + rng.randint(5, 300) * 1_000_000
        spans.append(trace_pb2.Span(
            trace_id=trace_id, span_id=rng.randbytes(8), parent_span_id=root_id,
            name=f"execute_tool {tool}", kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
            start_time_unix_nano=chat_end, end_time_unix_nano=tool_end, attributes=[
                _kv("gen_ai.operation.name", "execute_tool"), _kv("gen_ai.tool.name", tool),
                _kv("gen_ai.tool.call.id", f"call_{step}_{rng.getrandbits(32):x}"),
                *([_kv("gen_ai.tool.call.arguments", json.dumps({"q": rng.randint(0, 99)}))]
                  if content else [])]))
        t = tool_end
    spans.append(trace_pb2.Span(
        trace_id=trace_id, span_id=root_id, name=f"invoke_agent {agent}",
        kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
        start_time_unix_nano=start_ns, end_time_unix_nano=t + 1_000_000, attributes=[
            _kv("gen_ai.operation.name", "invoke_agent"), _kv("gen_ai.agent.name", agent),
            _kv("gen_ai.conversation.id", f"conv-{rng.getrandbits(32):x}")]))
    return spans


def burst_worker(seed: int) -> str:
    """The ``service.instance.id`` of the burst of ``seed``: how its rows are found."""
    return f"otlp-burst-{seed}"


def build_burst(traces: int = TRACES, seed: int = 7, per_request: int = SPANS_PER_REQUEST,
                content: bool = False) -> list[bytes]:
    """The burst as serialized protobuf bodies of ``per_request`` spans (the last one
    shorter), traces starting over the last ten minutes."""
    rng = random.Random(seed)
    now_ns = time.time_ns()
    resource = Resource(attributes=[_kv("service.name", "bench-fleet"),
                                    _kv("service.instance.id", burst_worker(seed))])
    scope = InstrumentationScope(name="opentelemetry.instrumentation.openai_v2")
    spans: list[trace_pb2.Span] = []
    for index in range(traces):
        start = now_ns - rng.randint(60, 600) * 1_000_000_000
        spans.extend(trace_spans(rng, start, ("support-bot", "research-agent")[index % 2],
                                 content))
    bodies = []
    for offset in range(0, len(spans), per_request):
        request = ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(
            resource=resource, scope_spans=[trace_pb2.ScopeSpans(
                scope=scope, spans=spans[offset:offset + per_request])])])
        bodies.append(request.SerializeToString())
    return bodies


def post_all(url: str, bodies: list[bytes], connections: int) -> dict[str, Any]:
    """POST every body (retrying 429/503 and dropped connections as an exporter does)
    over ``connections`` keep-alive connections; the perf_counter times of the first
    POST and the last 200, and the status codes seen (0: a dropped connection)."""
    parts = urlsplit(url)
    queue = list(reversed(bodies))
    lock = threading.Lock()
    codes: dict[int, int] = {}
    done: list[float] = []

    def connect() -> http.client.HTTPConnection:
        return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port,
                                          timeout=120)

    def worker() -> None:
        conn, dropped = connect(), 0
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    body = queue.pop()
                while True:
                    try:
                        conn.request("POST", "/v1/traces", body,
                                     {"Content-Type": "application/x-protobuf"})
                        response = conn.getresponse()
                        response.read()
                    except (ConnectionError, http.client.HTTPException):
                        # a dropped keep-alive connection: reconnect and resend, as
                        # exporters do (event ids make a resent body harmless)
                        dropped += 1
                        if dropped > MAX_RECONNECTS:
                            raise
                        conn.close()
                        conn = connect()
                        with lock:
                            codes[0] = codes.get(0, 0) + 1
                        continue
                    with lock:
                        codes[response.status] = codes.get(response.status, 0) + 1
                    if response.status == 200:
                        with lock:
                            done.append(time.perf_counter())
                        break
                    if response.status not in (429, 503):
                        raise RuntimeError(f"OTLP receiver answered {response.status}")
                    if response.getheader("Connection") == "close":
                        conn.close()
                        conn = connect()
                    time.sleep(0.02)
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(connections)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if len(done) != len(bodies):
        raise RuntimeError(f"{len(done)}/{len(bodies)} OTLP requests answered 200: {codes}")
    return {"started": started, "accepted": max(done), "codes": codes}


def family_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its live children (the OTLP receiver's process)."""
    return cpu_seconds(pid)[1] + sum(cpu_seconds(child)[1] for child in children(pid))


def stored(up: UpProcess, worker: str) -> tuple[int, int]:
    """(distinct events, closed runs) of one burst (its resource's
    ``service.instance.id``, stored as ``worker_id``): distinct, as a run whose agent
    claim improves has its earlier rows written again (duplicates until merges); a run
    counts once a row of it says it closed (its ``run.end`` folded and stored)."""
    row = up.reader.query(
        "SELECT (SELECT uniqExact(event_id) FROM events WHERE worker_id = {w:String}), "
        "(SELECT uniqExact(run_id) FROM runs WHERE worker_id = {w:String} "
        "AND closed_ts IS NOT NULL)", {"w": worker}).rows[0]
    return int(row[0]), int(row[1])


def _stored_at(up: UpProcess) -> tuple[int, float | None]:
    """(events the processors folded so far, when ``up``'s store last accepted events,
    on this process's perf_counter clock): ``up``'s status, which costs it no query."""
    health = up.health()
    return int(health["counters"]["events"]), stored_at(health, time.perf_counter)


def wait_stored(up: UpProcess, worker: str, want: tuple[int, int], folded_target: int,
                started: float, timeout_s: float) -> tuple[float, float, tuple[int, int],
                                                          list[tuple[float, int, int]]]:
    """Wait until the burst's ``want`` (events, closed runs) are stored; returns (when the
    store accepted the last of them, when the check that saw them ended, the counts,
    the timeline of exact checks).

    ``up``'s status is polled (no query) until its processors folded ``folded_target``
    events and its store's last acceptance (``events_stored_at``) held still over a
    poll; then the exact distinct counts are read (:func:`stored`), and again after
    each later acceptance. The burst ends where the store accepted its last rows, as
    ``loopwatch bench`` closes the pipeline's window, bounded by the check that saw
    them. The acceptance is read once more a poll after that check: a write's rows are
    visible before the write returns and stamps its time, so a stamp read during it is
    the previous write's.

    An exact check costs an idle ``up`` ~50 ms of CPU and takes ~0.18 s. Polling with
    them every 0.1 s after the last 200, as this bench did before, closed the burst at
    the check that first saw every row: up to a check and a poll (~0.3 s) late."""
    deadline = time.monotonic() + timeout_s
    timeline: list[tuple[float, int, int]] = []
    checked_stamp: float | None = None
    previous: float | None = None
    polls = 0
    while True:
        folded, stamp = _stored_at(up)
        polls += 1
        settled = stamp is not None and stamp == previous and stamp != checked_stamp
        if (folded >= folded_target and settled) or polls % 20 == 0:
            checked_stamp = stamp
            seen = stored(up, worker)
            seen_at = time.perf_counter()
            timeline.append((round(seen_at - started, 3), *seen))
            if seen[0] >= want[0] and seen[1] >= want[1]:
                time.sleep(POLL_S)  # the write that stored them may not have returned yet
                _, stamp = _stored_at(up)
                done = seen_at if stamp is None else min(seen_at, stamp)
                return done, seen_at, seen, timeline
        if time.monotonic() > deadline:
            raise TimeoutError(f"stored {timeline[-1][1:] if timeline else 'nothing'} of "
                               f"{want} (events, runs) in {timeout_s:.0f}s")
        previous = stamp
        time.sleep(POLL_S)


def burst(up: UpProcess, bodies: list[bytes], traces: int, worker: str,
          connections: int = 4, timeout_s: float = 300) -> dict[str, Any]:
    """POST ``bodies`` (``traces`` traces of resource ``worker``) to ``up``'s receiver;
    wait until every event and run is stored (:func:`wait_stored`); the run's figures,
    and the exact distinct counts stored."""
    spans = traces * SPANS_PER_TRACE
    want = (traces * EVENTS_PER_TRACE, traces)
    pid = up.process.pid if up.process is not None else 0
    folded_before, _ = _stored_at(up)
    cpu_before = family_cpu_s(pid)
    posted = post_all(up.info["otlp_url"], bodies, connections)
    done, seen_at, seen, timeline = wait_stored(
        up, worker, want, folded_before + want[0], posted["started"], timeout_s)
    up_cpu_us = (family_cpu_s(pid) - cpu_before) * 1e6 / spans
    elapsed, accept_s = done - posted["started"], posted["accepted"] - posted["started"]
    return {"spans": spans, "requests": len(bodies), "seconds": elapsed,
            "otlp_spans_per_s": spans / elapsed, "accept_spans_per_s": spans / accept_s,
            "at_check_spans_per_s": spans / (seen_at - posted["started"]),
            "lag_s": done - posted["accepted"], "codes": posted["codes"],
            "stored": seen,
            "accept_s": accept_s, "up_cpu_us_per_span": up_cpu_us, "timeline": timeline}


def measure(up: UpProcess, runs: int = 3, traces: int = TRACES, connections: int = 4,
            progress: Progress = lambda _m: None, content: bool = False) -> dict[str, Any]:
    """``runs`` bursts (seeds 1..runs) into ``up``; medians and every run's figures."""
    results = []
    for seed in range(1, runs + 1):
        bodies = build_burst(traces, seed=seed, content=content)
        progress(f"OTLP burst {seed}/{runs}: {traces * SPANS_PER_TRACE} spans")
        results.append(burst(up, bodies, traces, burst_worker(seed), connections))
    return {
        "otlp_spans_per_s": statistics.median(r["otlp_spans_per_s"] for r in results),
        "otlp_accept_spans_per_s": statistics.median(r["accept_spans_per_s"] for r in results),
        "otlp_at_check_spans_per_s": statistics.median(r["at_check_spans_per_s"]
                                                       for r in results),
        "otlp_lag_s": statistics.median(r["lag_s"] for r in results),
        "otlp_up_cpu_us_per_span": statistics.median(r["up_cpu_us_per_span"] for r in results),
        "otlp_stored": [list(r["stored"]) for r in results],
        "otlp_runs": results,
    }


def bench_figures(bootstrap: str, data_dir: Path, env: dict[str, str], traces: int,
                  progress: Progress, note: Progress, runs: int = 3) -> dict[str, Any]:
    """``loopwatch bench``'s OTLP figures (:func:`measure`'s medians and stored counts;
    each run's figures go to a note): its own ``up`` (fresh store in ``data_dir``, own
    topic and group on ``bootstrap``)."""
    settings = load_settings().model_copy(update={"events_topic": TOPIC})
    ensure_topics(bootstrap, settings)
    progress("starting loopwatch up for the OTLP burst")
    with UpProcess(data_dir, {**env, **THROUGHPUT_ENV, **ENV}) as up:
        wait_group_stable(bootstrap, GROUP, 1)
        figures = measure(up, runs, traces, progress=progress)
    note(note_for(figures))
    figures.pop("otlp_runs")
    return figures


def note_for(figures: dict[str, Any]) -> str:
    """One line for the bench's notes: every run's persisted/accepted rate and lag."""
    runs = "; ".join(f"{r['otlp_spans_per_s']:,.0f} persisted ({r['at_check_spans_per_s']:,.0f} "
                     f"at the check) / {r['accept_spans_per_s']:,.0f} accepted spans/s, "
                     f"lag {r['lag_s']:.2f}s" for r in figures["otlp_runs"])
    return f"OTLP burst ({len(figures['otlp_runs'])} runs): {runs}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=TRACES)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--content", action="store_true",
                        help="tool spans carry their arguments (capture messages)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    settings = load_settings().model_copy(update={"events_topic": TOPIC})
    with tempfile.TemporaryDirectory(prefix="loopwatch-otlp-burst-") as tmp, \
            EmbeddedBroker(Path(tmp) / "broker.log") as broker:
        ensure_topics(broker.bootstrap, settings)
        env = {**BASE_ENV, **THROUGHPUT_ENV, **ENV,
               "LOOPWATCH_KAFKA_BOOTSTRAP": broker.bootstrap}
        with UpProcess(Path(tmp) / "up", env) as up:
            wait_group_stable(broker.bootstrap, GROUP, 1)
            figures = measure(up, args.runs, args.traces, args.connections,
                              progress=lambda m: print(m, flush=True) if not args.json else None,
                              content=args.content)
    if args.json:
        print(json.dumps(figures))
        return
    print(note_for(figures))
    print(f"median: {figures['otlp_spans_per_s']:,.0f} spans/s persisted, "
          f"{figures['otlp_accept_spans_per_s']:,.0f} accepted, lag {figures['otlp_lag_s']:.2f}s")


if __name__ == "__main__":
    main()
