"""Smoke run of ``loopwatch bench``: every figure present with its type; no timing claims."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

import orjson
import pytest
import typer
from typer.testing import CliRunner

from loopwatch.bench.cli import register
from loopwatch.bench.pipeline import KEYS

FLOATS = ("pipeline_events_per_s", "raw_consume_events_per_s", "ratio", "emitter_events_per_s",
          "emitter_baseline_events_per_s", "emitter_spool_ratio",
          "alert_latency_p50_s", "alert_latency_p95_s", "processor_peak_rss_mb",
          "memory_per_open_run_bytes", "stored_bytes_per_event", "otlp_spans_per_s",
          "otlp_accept_spans_per_s", "otlp_at_check_spans_per_s", "otlp_lag_s",
          "otlp_up_cpu_us_per_span")


@pytest.mark.stack  # starts its own brokers, `loopwatch up`-like processors and workers
def test_bench_smoke() -> None:
    app = typer.Typer()
    register(app)

    @app.callback()
    def main() -> None:
        """A fresh app with only ``bench`` (the lead wires it into the real CLI)."""

    events, traces = 3000, 40
    result = CliRunner().invoke(
        app, ["bench", "--events", str(events), "--workers", "2", "--query-events", "2000",
              "--otlp-traces", str(traces), "--json"])
    assert result.exit_code == 0, result.output
    figures = orjson.loads(result.stdout.strip().splitlines()[-1])
    assert list(figures) == list(KEYS)
    assert figures["events"] == events
    for key in FLOATS:
        assert figures[key] is None or isinstance(figures[key], float), key
    for key in ("pipeline_events_per_s", "raw_consume_events_per_s", "ratio",
                "emitter_events_per_s", "emitter_baseline_events_per_s",
                "processor_peak_rss_mb", "stored_bytes_per_event"):
        assert figures[key] > 0, key
    assert figures["emitter_spool_ratio"] == (
        figures["emitter_events_per_s"] / figures["emitter_baseline_events_per_s"])
    assert isinstance(figures["query_latency_s"], dict) and figures["query_latency_s"]
    assert all(isinstance(value, float) and value > 0
               for value in figures["query_latency_s"].values())
    assert figures["workers"]["1"] == figures["pipeline_events_per_s"]
    assert isinstance(figures["workers"]["2"], float) and figures["workers"]["2"] > 0
    # the 2-worker window's CPU, each process apart, each with its own fold thread
    # (within its own note: the match may cross a wrapped line, never into the next note)
    for process in ("up", "worker"):
        assert re.search(rf"2 workers, {process}:\s+CPU\s+per\s+event\s+by\s+thread:"
                         r"(?:(?!2 workers)[\s\S])*?fold\s+thread\s+\d", result.stderr), process
    assert figures["machine"]["cores"] == os.cpu_count()
    assert figures["machine"]["cpu"] and figures["machine"]["python"] == platform.python_version()
    before, after = figures["raw_consume_bracket"]
    assert figures["raw_consume_events_per_s"] == (before + after) / 2
    budget = figures["cpu_budget"]
    assert budget["budget_us"] == pytest.approx(
        (os.cpu_count() or 1) * 1e6 / (figures["raw_consume_events_per_s"] / 3))
    assert budget["left_for_processors_us"] == (
        budget["budget_us"] - budget["store_us"] - budget["broker_us"])
    assert budget["store_us"] > 0 and budget["processors_us"] > 0
    # three OTLP bursts of `traces` traces, 11 spans each: every run's 12 events
    # (run.start, 5 llm.call, 5 tool.call, run.end) stored once, every run closed
    assert figures["otlp_stored"] == [[12 * traces, traces]] * 3
    assert figures["otlp_spans_per_s"] > 0 and figures["otlp_accept_spans_per_s"] > 0
    # closed where the store accepted the last rows, never after the check that saw them
    assert figures["otlp_spans_per_s"] >= figures["otlp_at_check_spans_per_s"] > 0
    assert figures["otlp_lag_s"] >= 0 and figures["otlp_up_cpu_us_per_span"] > 0


def test_fold_bench_smoke_stores_every_event_once() -> None:
    """``python -m loopwatch.bench.fold`` in its own process (chdb opens one store per process,
    and the test process has its own): every generated event is folded and stored
    once, none dead-lettered."""
    events = 3000
    done = subprocess.run([sys.executable, "-m", "loopwatch.bench.fold", "--events", str(events),
                           "--json"], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    figures = orjson.loads(done.stdout.strip().splitlines()[-1])
    assert (figures["events"], figures["stored_events"], figures["dead_letters"]) == (
        events, events, 0)
    assert figures["fold_us_per_event"] > 0
    assert figures["insert_calling_thread_us_per_event"] > 0
    assert figures["threads"].startswith("CPU per event by thread: main thread")


def test_otlp_burst_is_the_issue_s_span_mix() -> None:
    """The burst is what issue 27 asks for: per trace one invoke_agent root after its 5
    chat and 5 execute_tool children, in protobuf bodies of at most 512 spans; the
    receiver's own decode and mapping make 12 events of each trace, none dead-lettered."""
    from loopwatch.bench.otlp_burst import build_burst
    from loopwatch.ingest.otlp.decode import decode_protobuf
    from loopwatch.ingest.otlp.mapping import map_spans

    bodies = build_burst(100, seed=3)
    decoded = [decode_protobuf(body) for body in bodies]
    assert [len(d.spans) for d in decoded] == [512, 512, 76]
    spans = [span for d in decoded for span in d.spans]
    assert len({span.trace_id for span in spans}) == 100
    operations = [span.attributes["gen_ai.operation.name"] for span in spans[:11]]
    assert operations == ["chat", "execute_tool"] * 5 + ["invoke_agent"]
    kinds: dict[str, int] = {}
    for d in decoded:
        batch = map_spans(d.spans, d.bad)
        assert batch.unmapped == [] and batch.ignored == 0
        for event in batch.events:
            kinds[event.event_type] = kinds.get(event.event_type, 0) + 1
    assert kinds == {"run.start": 100, "llm.call": 500, "tool.call": 500, "run.end": 100}


@pytest.mark.stack  # the session's broker
def test_the_bench_emits_a_run_larger_than_the_sdk_s_default_spool(
        broker, tmp_path, monkeypatch) -> None:
    """The SDK counts the events queued for its sender against the spool's cap, and the
    bench emits its whole run at once: with the default cap, ``--events 2000000`` was
    refused (``spool full``). Here the default shrinks to 64 KB, under the 3,000 events'
    ~1 MB: both of the bench's modes must still send every event."""
    from datetime import UTC, datetime

    from loopwatch.bench.pipeline import emit_all, generate_events
    from loopwatch.core.config import Settings
    from loopwatch.core.topics import ensure_topics
    from loopwatch.ingest.sdk import Emitter

    monkeypatch.setitem(Emitter.__init__.__kwdefaults__, "spool_max_bytes", 64 * 1024)
    events = generate_events(3000, seed=5, end=datetime.now(UTC))
    topic = "test.bench-emit-spool"
    ensure_topics(broker.bootstrap, Settings(data_dir=tmp_path / "data", events_topic=topic))
    for write_ahead in (False, True):
        _, sent = emit_all(broker.bootstrap, events, tmp_path / f"spool-{write_ahead}",
                           topic, write_ahead=write_ahead)
        assert sent == len(events)


def test_store_path_bench_smoke_stores_the_same_tables_both_ways() -> None:
    """``python -m loopwatch.bench.store_path``: today's path (Python rows) and the
    generated views, each in a process and store of its own, store equal tables (the
    bench exits non-zero otherwise) with every generated event once."""
    events = 3000
    done = subprocess.run([sys.executable, "-m", "loopwatch.bench.store_path", "--events",
                           str(events), "--runs", "1", "--only", "python_rows", "views",
                           "--json"], capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr
    figures = orjson.loads(done.stdout.strip().splitlines()[-1])
    assert figures["tables"]["events"] == events
    assert figures["tables"]["llm_calls"] > 0 and figures["tables"]["tool_calls"] > 0
    for name in ("python_rows", "views"):
        assert figures["alternatives"][name]["us_per_event"] > 0
        assert figures["alternatives"][name]["bytes_per_event"] > 0


def test_store_stages_bench_smoke_takes_each_stage_away() -> None:
    """``python -m loopwatch.bench.store_stages``: each variant stores rows in exactly
    the tables its stages write (the bench exits non-zero otherwise, and the rows are
    checked here again), the same ``runs`` rows in all, and the stages' own costs add
    up to the whole store's."""
    events = 3000
    done = subprocess.run([sys.executable, "-m", "loopwatch.bench.store_stages", "--events",
                           str(events), "--runs", "1", "--json"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    figures = orjson.loads(done.stdout.strip().splitlines()[-1])
    stages = figures["stages"]
    assert list(stages) == ["runs", "events_in", "parse", "events", "all"]
    rows = {stage: stages[stage]["rows"] for stage in stages}
    assert len({found["runs"] for found in rows.values()}) == 1 and rows["runs"]["runs"] > 0
    assert [found["events"] for found in rows.values()] == [0, 0, 0, events, events]
    for table in ("llm_calls", "tool_calls", "labels"):
        assert [found[table] > 0 for found in rows.values()] == [False] * 4 + [True]
    assert sum(stage["stage_us_per_event"] for stage in stages.values()) == \
        pytest.approx(stages["all"]["us_per_event"])
    assert len(done.stdout.strip().splitlines()) == 1 and "round 1/1: all" in done.stderr


def test_store_stages_bench_refuses_nothing_to_measure_in_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "loopwatch.bench.store_stages", "--events",
                           "0"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "python -m loopwatch.bench.store_stages: --events and --runs must be at least 1"]


def test_the_log_line_counts_each_partition_read_again(tmp_path) -> None:
    """A successful bench removes the processors' logs with its folder: its log line is
    where re-reads show, each logged one (a hole, a stalled end) counted once."""
    import logging

    from loopwatch.bench.pipeline import log_signals
    from loopwatch.processors.continuity import PartitionContinuity

    logs = tmp_path / "logs"
    logs.mkdir()
    handler = logging.FileHandler(logs / "worker.log")
    logger = logging.getLogger("loopwatch.processors.continuity")
    logger.addHandler(handler)
    try:
        now = [0.0]
        seen = PartitionContinuity(clock=lambda: now[0])
        seen.admit([(0, 1), (0, 3)])  # a hole at 2
        seen.admit([(1, 5)])
        seen.stalled({1: 9}, quiet_s=5.0)  # 6..8 seen waiting
        now[0] += 6.0
        seen.stalled({1: 9}, quiet_s=5.0)  # still waiting: partition 1's end
    finally:
        logger.removeHandler(handler)
        handler.close()
    (logs / "worker-2.log").write_text("faust: producer buffer full, size 7\n")
    assert log_signals(logs) == (
        "log: sweep-runs timer overran 0x (max 0.0s, sum 0.0s), commit timer overran 0x "
        "(max 0.0s), 'producer buffer full' 1x, partitions read again 2x")


def test_the_fold_thread_s_wait_for_a_core_is_read_from_its_own_schedstat() -> None:
    """The CPU note's "waiting for a core" of the fold thread is that thread's run queue
    wait, found by the OS name ``up`` gives it, and nobody else's: read while the named
    thread is blocked (its counters then stand still), the sample holds exactly what
    its ``schedstat`` says (other tests' fold threads here stand idle); a process
    without a fold thread has none."""
    import threading
    import time
    from pathlib import Path

    from loopwatch.bench.pipeline import CpuSample
    from loopwatch.core.threads import FOLD_THREAD_NAME, name_os_thread

    named = threading.Event()
    release = threading.Event()
    tids: list[int] = []

    def fold_like() -> None:
        name_os_thread(FOLD_THREAD_NAME)
        tids.append(threading.get_native_id())
        sum(range(200_000))
        named.set()
        release.wait()

    before = CpuSample.take(os.getpid(), 0)
    thread = threading.Thread(target=fold_like)
    thread.start()
    try:
        assert named.wait(30)
        task = Path(f"/proc/{os.getpid()}/task/{tids[0]}")
        while (task / "stat").read_text().rsplit(")", 1)[1].split()[0] != "S":
            time.sleep(0.01)  # until it sleeps in release.wait()
        sample = CpuSample.take(os.getpid(), 0)
        expected = int((task / "schedstat").read_text().split()[1]) / 1e9
    finally:
        release.set()
        thread.join()
    # to the nanosecond the file counts in (a float difference of two sums)
    assert sample.fold_waiting - before.fold_waiting == pytest.approx(expected, abs=1e-9)
    without = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert CpuSample.take(without.pid, 0).fold_waiting == 0.0
    finally:
        without.kill()
        without.wait()
