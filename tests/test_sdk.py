"""The emitter SDK against a real broker: batching, the spool, timed tool calls."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from kafka.admin import KafkaAdminClient, NewTopic
from pydantic import ValidationError

from loopwatch.bench.pipeline import read_topic
from loopwatch.core.embedded.broker import EmbeddedBroker, free_port
from loopwatch.ingest.capture import assemble_part, blob_hash, part_hash
from loopwatch.ingest.events import LlmCall, Step
from loopwatch.ingest.handoff import Handoff
from loopwatch.ingest.sdk import Emitter, ToolTimeout, partition_for
from loopwatch.ingest.wire import decode_message, message_value
from loopwatch.processors.capture import parse_capture


def create_topic(bootstrap: str, name: str, partitions: int = 3) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(name, partitions, 1)])
    admin.close()


def read_all(bootstrap: str, topic: str) -> list[tuple[int, dict]]:
    """(partition, event) for every event on the topic, envelopes unpacked."""
    return [(message.partition, orjson.loads(event.model_dump_json()))
            for message in read_topic(bootstrap, topic)
            for event in decode_message(message.value, 10_000_000).events]


def test_the_handoff_passes_every_item_once_in_each_putters_order():
    """Four threads put while the sender's loop takes, as the emitter's does."""
    handoff: Handoff[tuple[int, int]] = Handoff()
    per_thread = 20_000

    def put_all(thread: int) -> None:
        for n in range(per_thread):
            handoff.put((thread, n))

    putters = [threading.Thread(target=put_all, args=(t,)) for t in range(4)]
    for putter in putters:
        putter.start()
    got: list[tuple[int, int]] = []
    while len(got) < 4 * per_thread:
        first = handoff.get(timeout=10)
        assert first is not None, f"nothing arrived for 10 s after {len(got)} items"
        got.append(first)
        got.extend(handoff.take(500))
    for putter in putters:
        putter.join()
    assert len(handoff) == 0
    for thread in range(4):
        assert [n for t, n in got if t == thread] == list(range(per_thread))


def test_a_waiting_get_returns_the_item_put_while_it_waits():
    handoff: Handoff[str] = Handoff()
    waiting = threading.Event()
    got: list[str | None] = []

    def get() -> None:
        waiting.set()
        got.append(handoff.get(timeout=120))

    getter = threading.Thread(target=get, daemon=True)
    getter.start()
    waiting.wait(5)
    time.sleep(0.1)  # let it reach the wait; had it not, the item is there on its look
    handoff.put("event")
    getter.join(20)
    assert not getter.is_alive(), "the put did not wake the waiting get"
    assert got == ["event"]
    assert handoff.get(timeout=0) is None


def test_events_of_a_run_stay_ordered_on_the_run_partition(broker, tmp_path: Path):
    topic = f"sdk-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap, topic)
    with Emitter(broker.bootstrap, topic, tmp_path) as emitter:
        runs = []
        for _ in range(5):
            with emitter.run(agent="a") as run:
                for _ in range(20):
                    run.step()
            runs.append(run.run_id)
    found = read_all(broker.bootstrap, topic)
    assert len(found) == 5 * 22
    assert emitter.stats.messages < len(found)  # envelopes carried several events each
    for run_id in runs:
        mine = [(p, e) for p, e in found if e["run_id"] == run_id]
        assert {p for p, _ in mine} == {partition_for(run_id, 3)}
        assert [e["event_type"] for _, e in mine] == ["run.start", *["step"] * 20, "run.end"]
        assert [e["step"] for _, e in mine[1:-1]] == list(range(20))
        assert mine[-1][1]["total_steps"] == 20  # the SDK's count, checked by steps_lost


def test_a_burst_makes_one_full_envelope_per_partition(broker, tmp_path: Path):
    """Events gather per partition: a burst of ``max_batch`` events for each of 3
    partitions leaves as 3 envelopes of ``max_batch``, not as ``max_batch`` events at a
    time split over every partition's messages."""
    topic = f"sdk-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap, topic)
    run_of: dict[int, str] = {}
    for n in range(100):
        run_of.setdefault(partition_for(f"run-{n}", 3), f"run-{n}")
    with Emitter(broker.bootstrap, topic, tmp_path, max_batch=10, linger_s=1.0) as emitter:
        emitter.emit(Step(run_id=run_of[0], agent="a", step=0))  # connects: 3 partitions
        assert emitter.flush(30)
        for step in range(1, 11):
            for partition in range(3):
                emitter.emit(Step(run_id=run_of[partition], agent="a", step=step))
        assert emitter.flush(30)
    sizes = sorted((len(decode_message(message.value, 10_000_000).events), message.partition)
                   for message in read_topic(broker.bootstrap, topic))
    assert sizes == [(1, 0), (10, 0), (10, 1), (10, 2)]


@pytest.mark.stack  # starts its own broker / `loopwatch up`
def test_broker_unreachable_events_spool_and_are_resent_once_it_is_back(tmp_path: Path):
    """Guarantee: nothing is lost while the broker is down; resends are by event_id."""
    port = free_port()
    emitter = Emitter(f"127.0.0.1:{port}", "spooled", tmp_path / "spool",
                      producer_config={"max_block_ms": 500, "bootstrap_timeout_ms": 500})
    with emitter.run(agent="a") as run:
        run.step()
        run.llm_call(input_tokens=10)
    assert emitter.flush(30)
    assert emitter.stats.spooled == 4
    assert emitter.spool.size() > 0
    with EmbeddedBroker(tmp_path / "broker.log", port=port) as late_broker:
        create_topic(late_broker.bootstrap, "spooled")
        deadline = time.monotonic() + 60
        while emitter.stats.sent < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        emitter.close()
        found = read_all(late_broker.bootstrap, "spooled")
    assert emitter.stats.sent == 4
    assert sorted(e["event_type"] for _, e in found) == ["llm.call", "run.end", "run.start",
                                                         "step"]
    assert emitter.spool.size() == 0


@pytest.mark.parametrize("damaged", [b'{"event_type": "step", "run_id": "torn', b'[1, 2]',
                                     b'{"run_id": 7}', b"\xff\xfe"])
def test_a_damaged_spool_line_is_sent_on_and_the_emitter_keeps_going(
        broker, tmp_path: Path, damaged: bytes):
    """A spool line torn by a crash mid-write (or otherwise not an event object) is
    resent like any other; the processors dead-letter it with its reason. It used to
    raise in the emitter's thread while the envelope's key was read, which ended the
    thread: every later event waited in memory and nothing was sent again."""
    topic = f"sdk-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap, topic, partitions=1)
    spool = tmp_path / "spool"
    spool.mkdir()
    good = Step(run_id="after-torn", agent="a", step=1).model_dump_json().encode()
    (spool / "spool.jsonl").write_bytes(damaged + b"\n" + good + b"\n")
    with Emitter(broker.bootstrap, topic, spool) as emitter:
        deadline = time.monotonic() + 30
        while emitter.stats.resent < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert emitter.flush(30)
        emitter.emit(Step(run_id="after-torn", agent="a", step=2))
        assert emitter.flush(30)
    assert (emitter.stats.resent, emitter.stats.sent) == (2, 3)
    values = [message.value for message in read_topic(broker.bootstrap, topic)]
    decoded = [decode_message(value, 10_000_000) for value in values]
    assert sorted(event.step for d in decoded for event in d.events) == [1, 2]  # type: ignore[attr-defined]
    assert sum(len(d.dead) for d in decoded) == 1


def test_an_unexpected_failure_in_the_sender_spools_its_batch_and_sending_goes_on(
        broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The emitter's one sender thread must outlive any error: an exception nobody
    foresaw (injected here into one send; the broker is real) spools the batch it was
    sending, counts it, and the batch is resent from the spool with everything after."""
    topic = f"sdk-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap, topic, partitions=1)
    with Emitter(broker.bootstrap, topic, tmp_path / "spool") as emitter:
        emitter.emit(Step(run_id="sender-fails", agent="a", step=0))
        assert emitter.flush(30)
        send_message = emitter._send_message
        failures: list[int] = []

        def fail_once(partition: int, chunk: list[bytes], key: str, tracked: Any) -> None:
            if not failures:
                failures.append(len(chunk))
                raise RuntimeError("injected: a failure nobody foresaw")
            send_message(partition, chunk, key, tracked)

        monkeypatch.setattr(emitter, "_send_message", fail_once)
        for step in (1, 2, 3):
            emitter.emit(Step(run_id="sender-fails", agent="a", step=step))
        deadline = time.monotonic() + 30
        while not (failures and emitter.stats.resent >= failures[0]) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        emitter.emit(Step(run_id="sender-fails", agent="a", step=4))
        assert emitter.flush(30)
        assert emitter._thread.is_alive()
    assert (emitter.stats.send_errors, emitter.stats.spooled, emitter.stats.resent) == (
        1, failures[0], failures[0])
    assert emitter.spool.size() == 0
    steps = [event["step"] for _, event in read_all(broker.bootstrap, topic)]
    assert sorted(steps) == [0, 1, 2, 3, 4]


def test_an_extra_integer_beyond_64_bits_is_sent_digit_for_digit(broker, tmp_path: Path):
    """emit() raised TypeError in the agent's own code for such an unknown field (a
    30-digit id); it now travels exactly, with the events around it."""
    topic = f"sdk-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap, topic, partitions=1)
    big = 123456789012345678901234567890
    with Emitter(broker.bootstrap, topic, tmp_path) as emitter:
        for step, extra in ((1, {}), (2, {"order_id": big}), (3, {})):
            emitter.emit(Step(run_id="big", agent="a", step=step, **extra))
    (message,) = read_topic(broker.bootstrap, topic)
    assert b'"order_id":123456789012345678901234567890' in message.value
    events = decode_message(message.value, 10_000_000).events
    assert [(event.step, event.model_extra) for event in events] == [
        (1, {}), (2, {"order_id": big}), (3, {})]


def test_emit_writes_plain_events_as_pydantic_does_and_redacts_the_others(
        broker, tmp_path: Path):
    """emit() has two routes: an event with nothing to redact is written by pydantic's
    serializer as it is; one with free text or extras is dumped, redacted and encoded.
    Each event's bytes on the topic are exactly what its route makes, in order."""
    topic = f"sdk-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap, topic, partitions=1)
    plain = Step(run_id="r", agent="a", step=1, tool="grep")
    free_text = LlmCall(run_id="r", agent="a", error_type="mail ann.lee@example.com")
    extra = Step(run_id="r", agent="a", step=2, note="ann.lee@example.com")
    none_free = LlmCall(run_id="r", agent="a", error_type=None, stop_reason=None)
    with Emitter(broker.bootstrap, topic, tmp_path) as emitter:
        for event in (plain, free_text, extra, none_free):
            emitter.emit(event)
        assert emitter.flush(30)
    (message,) = read_topic(broker.bootstrap, topic)
    lines = [orjson.dumps(line) for line in orjson.loads(message.value)["events"]]
    assert message.value == message_value(lines)  # each line as sent, byte for byte
    assert lines[0] == plain.__pydantic_serializer__.to_json(plain, exclude_none=True)
    assert lines[3] == none_free.__pydantic_serializer__.to_json(none_free, exclude_none=True)
    assert orjson.loads(lines[1])["error_type"] == "mail [REDACTED:email]"
    assert orjson.loads(lines[2])["note"] == "[REDACTED:email]"
    assert (emitter.stats.queued, emitter.stats.sent) == (4, 4)
    assert emitter.stats.event_bytes == sum(len(line) for line in lines)


def test_invalid_fields_raise_at_the_call_site(broker, tmp_path: Path):
    with Emitter(broker.bootstrap, "unused", tmp_path) as emitter:
        with emitter.run(agent="a") as run, pytest.raises(ValidationError, match="output"):
            run.llm_call(output_tokens=-1)
        assert emitter.stats.queued == 2  # run.start and run.end, nothing invalid


def test_timed_tool_call_reports_the_true_duration_of_a_late_completion(broker, tmp_path):
    topic = f"sdk-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap, topic)

    finished = threading.Event()

    def slow_search(q: str) -> str:
        time.sleep(0.6)
        finished.set()
        return q

    with Emitter(broker.bootstrap, topic, tmp_path) as emitter, emitter.run(agent="a") as run:
        with pytest.raises(ToolTimeout):
            run.timed_tool_call("search", slow_search, {"q": "x"}, timeout_s=0.2)
        assert not finished.is_set()  # the caller got the timeout while the call ran on
        assert run.timed_tool_call("search", slow_search, {"q": "y"}, timeout_s=5) == "y"
    calls = [e for _, e in read_all(broker.bootstrap, topic) if e["event_type"] == "tool.call"]
    late = next(e for e in calls if e["timed_out"])
    on_time = next(e for e in calls if not e["timed_out"])
    assert (late["latency_ms"], late["timeout_ms"], late["error_type"]) == (200, 200, "timeout")
    assert late["late_completion_ms"] >= 600
    assert on_time["latency_ms"] >= 600 and on_time["late_completion_ms"] is None


def read_captures(bootstrap: str, topic: str) -> list[tuple[int, bytes, Any]]:
    """(partition, key, checked capture message) for every message on ``topic``."""
    return [(m.partition, m.key, parse_capture(m.value)) for m in read_topic(bootstrap, topic)]


def test_bodies_travel_on_the_captures_topic_serialised_at_the_call(broker, tmp_path: Path):
    """Keyed and partitioned like the run's events; the caller's later changes to its
    message list do not reach what was sent; the event keeps hashes and sizes only."""
    events, captures = f"sdk-{uuid.uuid4().hex[:8]}", f"cap-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap, events)
    create_topic(broker.bootstrap, captures)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with (Emitter(broker.bootstrap, events, tmp_path, captures_topic=captures) as emitter,
          emitter.run(agent="a") as run):
        call = run.llm_call(prompt=messages, response="hello", input_tokens=3)
        messages.append({"role": "assistant", "content": "hello"})
        run.step()  # no bodies: no capture message
    found = read_captures(broker.bootstrap, captures)
    assert [(p, k) for p, k, _ in found] == [(partition_for(run.run_id, 3), run.run_id.encode())]
    message = found[0][2]
    assert (message.event_id, message.event_type, message.step) == (str(call.event_id),
                                                                    "llm.call", 0)
    assert {name: assemble_part(ref, message.blobs) for name, ref in message.parts.items()} == {
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "response": "hello"}
    sent = next(e for _, e in read_all(broker.bootstrap, events) if e["event_type"] == "llm.call")
    assert (sent["prompt_hash"], sent["prompt_bytes"], sent["response_bytes"]) == (
        part_hash(message.parts["prompt"]), 38 + 30, 5)  # the two messages' JSON bodies
    assert sent["response_hash"] == blob_hash("text", "hello")
    assert sent["system_prompt_hash"] == message.parts["prompt"].hashes[0]
    assert "prompt" not in sent
    assert (emitter.stats.captures, emitter.stats.captures_sent) == (1, 1)


def test_bodies_the_broker_already_acknowledged_are_not_sent_again(broker, tmp_path: Path):
    """The system prompt travels once: a later call names it in ``sent_before`` instead
    of carrying it, and the receiver's blobs (staged by hash) reassemble every call."""
    events, captures = f"sdk-{uuid.uuid4().hex[:8]}", f"cap-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap, events)
    create_topic(broker.bootstrap, captures)
    system = {"role": "system", "content": "rules " * 500}
    with (Emitter(broker.bootstrap, events, tmp_path, captures_topic=captures) as emitter,
          emitter.run(agent="a") as run):
        run.llm_call(prompt=[system, {"role": "user", "content": "one"}], response="1")
        assert emitter.flush(30)  # acknowledged: the system prompt is now known sent
        run.llm_call(prompt=[system, {"role": "user", "content": "two"}], response="2")
    first, second = (message for _, _, message in read_captures(broker.bootstrap, captures))
    system_hash = first.parts["prompt"].hashes[0]
    assert system_hash in first.blobs and first.sent_before == []
    assert system_hash not in second.blobs and second.sent_before == [system_hash]
    staged = {**first.blobs, **second.blobs}
    assert assemble_part(second.parts["prompt"], staged) == [
        system, {"role": "user", "content": "two"}]
    assert len(second.model_dump_json()) < len(first.model_dump_json()) - 2000


@pytest.mark.stack  # starts its own broker / `loopwatch up`
def test_capture_messages_spool_with_their_topic_and_are_resent(tmp_path: Path):
    port = free_port()
    emitter = Emitter(f"127.0.0.1:{port}", "spooled", tmp_path / "spool",
                      captures_topic="spooled.captures",
                      producer_config={"max_block_ms": 500, "bootstrap_timeout_ms": 500})
    with emitter.run(agent="a") as run:
        run.tool_call("lookup", args={"id": 7}, output=["row 1"])
    assert emitter.flush(30)
    spooled = emitter.spool.records()
    assert [line.split(b" ", 1)[0] for line in spooled if line.startswith(b"@")] == [
        b"@spooled.captures"]
    assert emitter.stats.spooled == 4
    with EmbeddedBroker(tmp_path / "broker.log", port=port) as late_broker:
        create_topic(late_broker.bootstrap, "spooled.captures")
        create_topic(late_broker.bootstrap, "spooled")
        deadline = time.monotonic() + 60
        while (emitter.stats.sent < 3 or emitter.stats.captures_sent < 1) and (
                time.monotonic() < deadline):
            time.sleep(0.2)
        emitter.close()
        found = read_captures(late_broker.bootstrap, "spooled.captures")
    assert (emitter.stats.sent, emitter.stats.captures_sent) == (3, 1)
    assert [(k, {name: assemble_part(ref, m.blobs) for name, ref in m.parts.items()})
            for _, k, m in found] == [(run.run_id.encode(), {"args": {"id": 7},
                                                             "output": ["row 1"]})]
    assert emitter.spool.size() == 0


def test_a_refused_run_end_raises_and_ends_the_run_as_a_hard_error(emitter, reader, agent):
    """``run.end("finished")`` (a misspelt terminal reason) raised but left the run marked
    ended, so no ``crash`` end followed and the run stayed open until abandoned. Now the
    call still raises, and the run is closed at once as a hard error, the refusal kept."""
    from pydantic import ValidationError

    from tests.conftest import scalar, wait_for

    run_id = f"{agent}-bad-end"
    with pytest.raises(ValidationError), emitter.run(run_id=run_id, agent=agent) as run:
        run.step()
        run.end("finished")
    assert emitter.flush(30)
    wait_for(lambda: scalar(reader, "SELECT status FROM runs FINAL WHERE run_id = {r:String}",
                            r=run_id) == "closed", 90, what="the run closed")
    row = reader.query("SELECT outcome, terminal_reason, steps FROM runs FINAL "
                       "WHERE run_id = {r:String}", {"r": run_id}).rows
    assert row == [["hard_error", "crash", 1]]
    errors = reader.query("SELECT JSONExtractString(payload, 'error_type') FROM events "
                          "WHERE run_id = {r:String} AND event_type = 'run.end'",
                          {"r": run_id}).rows
    assert errors == [["invalid run.end: ValidationError"]]
