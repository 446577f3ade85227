"""Throughput of the OTLP receivers (HTTP and gRPC), with the broker-only baseline in the
same run.

    python -m loopwatch.bench.otlp_receiver                 # ~20 s, prints a table
    python -m loopwatch.bench.otlp_receiver --spans 200000 --json

What is measured, against one embedded Tansu broker on loopback:

* ``broker only``: the same events, already mapped, published with
  ``Emitter.send_and_wait`` (envelopes per partition, acks=all) from one thread: the
  ceiling of the producer path the receiver shares.
* ``receiver``: pre-encoded protobuf OTLP requests (512 spans each: per trace one
  ``invoke_agent``, six ``chat`` and four ``execute_tool`` spans) POSTed over keep-alive
  connections by a separate client process; the receiver (decode, map, publish, wait
  for the ack, answer 200) runs in this process. Spans per second = spans answered 200
  / wall time.
* ``receiver (gRPC)``: the same requests, as raw ``TraceService/Export`` calls over one
  channel per client thread to the gRPC receiver of the same receiver (same export
  path), right after the HTTP pass. Spans per second = spans answered OK / wall time.

It is a benchmark, not a test: numbers depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import random
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1 import trace_pb2

SPANS_PER_REQUEST = 512


def _kv(key: str, value: str | int) -> KeyValue:
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=value))


def _trace(rng: random.Random, now_ns: int) -> list[trace_pb2.Span]:
    trace_id = rng.randbytes(16)
    agent_id = rng.randbytes(8)
    spans = []
    t = now_ns
    for index in range(10):
        start, t = t, t + 2_000_000
        if index % 5 in (1, 3) and index < 9:
            attributes = [_kv("gen_ai.operation.name", "execute_tool"),
                          _kv("gen_ai.tool.name", rng.choice(["search", "lookup", "grep"])),
                          _kv("gen_ai.tool.call.id", f"call_{index}"),
                          _kv("gen_ai.tool.call.arguments", f'{{"q": {rng.randint(0, 9)}}}')]
            name = "execute_tool"
        else:
            attributes = [_kv("gen_ai.operation.name", "chat"),
                          _kv("gen_ai.provider.name", "openai"),
                          _kv("gen_ai.request.model", "gpt-4o"),
                          _kv("gen_ai.response.model", "gpt-4o-2024-08-06"),
                          _kv("gen_ai.usage.input_tokens", rng.randint(1000, 8000)),
                          _kv("gen_ai.usage.output_tokens", rng.randint(10, 400)),
                          _kv("gen_ai.usage.cache_read.input_tokens", 512),
                          _kv("gen_ai.response.id", f"chatcmpl-{index}")]
            name = "chat gpt-4o"
        spans.append(trace_pb2.Span(
            trace_id=trace_id, span_id=rng.randbytes(8), parent_span_id=agent_id, name=name,
            start_time_unix_nano=start, end_time_unix_nano=t, attributes=attributes))
    spans.append(trace_pb2.Span(
        trace_id=trace_id, span_id=agent_id, name="invoke_agent bench",
        start_time_unix_nano=now_ns, end_time_unix_nano=t,
        attributes=[_kv("gen_ai.operation.name", "invoke_agent"),
                    _kv("gen_ai.agent.name", "bench-agent")]))
    return spans


def build_requests(total_spans: int, seed: int = 7) -> list[bytes]:
    rng = random.Random(seed)
    now_ns = time.time_ns()
    bodies: list[bytes] = []
    spans: list[trace_pb2.Span] = []
    resource = Resource(attributes=[_kv("service.name", "bench"),
                                    _kv("service.instance.id", "w1")])
    while sum(1 for _ in bodies) * SPANS_PER_REQUEST < total_spans:
        while len(spans) < SPANS_PER_REQUEST:
            spans.extend(_trace(rng, now_ns))
        chunk, spans = spans[:SPANS_PER_REQUEST], spans[SPANS_PER_REQUEST:]
        request = ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(
            resource=resource, scope_spans=[trace_pb2.ScopeSpans(spans=chunk)])])
        bodies.append(request.SerializeToString())
    return bodies


def _client(port: int, bodies: list[bytes], connections: int,
            results: Any) -> None:
    """Runs in a child process: POST every body once, over ``connections`` threads."""
    codes: dict[int, int] = {}
    lock = threading.Lock()
    queue = list(reversed(bodies))

    def worker() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while True:
            with lock:
                if not queue:
                    break
                body = queue.pop()
            while True:
                conn.request("POST", "/v1/traces", body,
                             {"Content-Type": "application/x-protobuf"})
                response = conn.getresponse()
                response.read()
                with lock:
                    codes[response.status] = codes.get(response.status, 0) + 1
                if response.status == 200:
                    break
                if response.getheader("Connection") == "close":
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                time.sleep(float(response.getheader("Retry-After") or 0.05) / 20)
        conn.close()

    results.put({"seconds": _run_workers(worker, connections), "codes": codes})


def _run_workers(worker: Callable[[], None], connections: int) -> float:
    """Run ``worker`` on ``connections`` threads at once; the seconds until all ended."""
    threads = [threading.Thread(target=worker) for _ in range(connections)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def _grpc_client(address: str, bodies: list[bytes], connections: int,
                 results: Any) -> None:
    """Runs in a child process: Export every body once, over ``connections`` threads,
    each on its own channel (its own HTTP/2 connection)."""
    import grpc

    from loopwatch.ingest.otlp.grpc_server import EXPORT_METHOD

    codes: dict[str, int] = {}
    lock = threading.Lock()
    queue = list(reversed(bodies))

    def worker() -> None:
        with grpc.insecure_channel(address) as channel:
            export = channel.unary_unary(EXPORT_METHOD)
            while True:
                with lock:
                    if not queue:
                        break
                    body = queue.pop()
                while True:
                    try:
                        export(body, timeout=120)
                        code = "OK"
                    except grpc.RpcError as error:
                        code = error.code().name
                    with lock:
                        codes[code] = codes.get(code, 0) + 1
                    if code == "OK":
                        break
                    time.sleep(0.1)

    results.put({"seconds": _run_workers(worker, connections), "codes": codes})


def _timed(target: Any, args: tuple[Any, ...], results: Any) -> tuple[dict[str, Any], float]:
    """Run one client process; its outcome and this process's CPU seconds meanwhile."""
    client = multiprocessing.get_context("spawn").Process(target=target, args=args)
    cpu = time.process_time()
    client.start()
    outcome = results.get()
    cpu = time.process_time() - cpu
    client.join()
    return outcome, cpu


def run(total_spans: int, connections: int) -> dict[str, Any]:
    from loopwatch.core.config import Settings
    from loopwatch.core.embedded.broker import EmbeddedBroker, free_port
    from loopwatch.core.topics import ensure_topics
    from loopwatch.ingest.otlp.decode import decode_protobuf
    from loopwatch.ingest.otlp.mapping import map_spans
    from loopwatch.ingest.otlp.server import OtlpReceiver
    from loopwatch.ingest.otlp.settings import OtlpSettings
    from loopwatch.ingest.sdk import Emitter

    bodies = build_requests(total_spans)
    spans = len(bodies) * SPANS_PER_REQUEST
    folder = Path(tempfile.mkdtemp(prefix="otlp-bench-"))
    settings = Settings(data_dir=folder)
    with EmbeddedBroker(folder / "broker.log") as broker:
        ensure_topics(broker.bootstrap, settings)
        # broker-only baseline: the same events, mapped beforehand
        batches = [map_spans(decode_protobuf(body).spans).events for body in bodies]
        events = sum(len(batch) for batch in batches)
        emitter = Emitter(broker.bootstrap, settings.events_topic, folder / "spool",
                          max_message_bytes=settings.max_message_bytes - 4096)
        emitter.send_and_wait(batches[0], 30)  # connect and warm up
        started = time.perf_counter()
        for batch in batches:
            emitter.send_and_wait(batch, 30)
        baseline_s = time.perf_counter() - started
        emitter.close()
        # mapping alone (decode + map), single thread
        started = time.perf_counter()
        for body in bodies[: max(1, len(bodies) // 4)]:
            map_spans(decode_protobuf(body).spans)
        map_s = (time.perf_counter() - started) * len(bodies) / max(1, len(bodies) // 4)
        # the receiver, fed by a client process
        receiver = OtlpReceiver(settings, broker.bootstrap, "127.0.0.1", free_port(),
                                limits=OtlpSettings(max_inflight=connections))
        receiver.start()
        grpc_address = receiver.serve_grpc(0)
        assert grpc_address is not None
        port = int(receiver.url.rsplit(":", 1)[1])
        results: Any = multiprocessing.get_context("spawn").Queue()
        _timed(_client, (port, bodies[:2], 1, results), results)  # warm-up requests
        outcome, cpu = _timed(_client, (port, bodies, connections, results), results)
        _timed(_grpc_client, (grpc_address, bodies[:2], 1, results), results)
        grpc_outcome, grpc_cpu = _timed(
            _grpc_client, (grpc_address, bodies, connections, results), results)
        receiver.stop()
    return {
        "spans": spans, "events": events, "requests": len(bodies),
        "broker_only_events_per_s": events / baseline_s,
        "broker_only_spans_per_s": spans / baseline_s,
        "decode_map_spans_per_s": spans / map_s,
        "receiver_spans_per_s": spans / outcome["seconds"],
        "receiver_events_per_s": events / outcome["seconds"],
        "status_codes": outcome["codes"],
        "receiver_cpu_per_wall_s": cpu / outcome["seconds"],
        "grpc_receiver_spans_per_s": spans / grpc_outcome["seconds"],
        "grpc_receiver_events_per_s": events / grpc_outcome["seconds"],
        "grpc_status_codes": grpc_outcome["codes"],
        "grpc_receiver_cpu_per_wall_s": grpc_cpu / grpc_outcome["seconds"],
        "grpc_to_http_ratio": outcome["seconds"] / grpc_outcome["seconds"],
        "connections": connections,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=100_000)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.spans, args.connections)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['spans']} spans in {result['requests']} requests of {SPANS_PER_REQUEST} "
          f"-> {result['events']} events; {result['connections']} client connections")
    print(f"broker only (send_and_wait) : {result['broker_only_spans_per_s']:>9,.0f} spans/s "
          f"({result['broker_only_events_per_s']:,.0f} events/s)")
    print(f"decode + map (one thread)   : {result['decode_map_spans_per_s']:>9,.0f} spans/s")
    print(f"receiver (HTTP, end to end) : {result['receiver_spans_per_s']:>9,.0f} spans/s "
          f"({result['receiver_events_per_s']:,.0f} events/s)  codes {result['status_codes']}")
    print(f"receiver (gRPC, end to end) : {result['grpc_receiver_spans_per_s']:>9,.0f} spans/s "
          f"({result['grpc_receiver_events_per_s']:,.0f} events/s)  "
          f"codes {result['grpc_status_codes']}")
    print(f"gRPC / HTTP spans/s         : {result['grpc_to_http_ratio']:.2f}")
    print(f"receiver process CPU        : HTTP {result['receiver_cpu_per_wall_s']:.2f}, "
          f"gRPC {result['grpc_receiver_cpu_per_wall_s']:.2f} core-seconds per second")


if __name__ == "__main__":
    main()
