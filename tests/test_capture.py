"""Capture (docs/capture.md) end to end: the SDK -> the real broker -> the capture agent
of the real ``loopwatch up`` -> staging in chdb -> the decider -> kept parts and blobs.

Every body is read back from ``capture_parts``/``capture_blobs`` and reassembled with
the codec; retention is checked on runs whose ``cityHash64`` is known to fall inside
or outside the 10 % success sample; the label window (24 h in the pipeline) is passed by
runs whose events are two days old."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from kafka import KafkaProducer

from loopwatch.bench.pipeline import read_topic
from loopwatch.ingest.capture import (
    Blob,
    PartRef,
    assemble_part,
    blob_hash,
    build_capture_message,
    part_hash,
)
from loopwatch.ingest.sdk import Emitter
from loopwatch.ingest.wire import exact_json
from tests.conftest import wait_for

SYSTEM = {"role": "system", "content": "You are the refund bot. Be brief. " * 40}
CAPTURES = "loopwatch.captures"


@pytest.fixture()
def emit(broker, pipeline, tmp_path: Path):
    with Emitter(broker.bootstrap, spool_dir=tmp_path / "spool") as emitter:
        yield emitter


def decision(reader: Any, run_id: str) -> list[Any] | None:
    rows = reader.query("SELECT keep, reason, outcome, parts, bytes FROM capture_decisions "
                        "FINAL WHERE run_id = {r:String}", {"r": run_id}).rows
    return list(rows[0]) if rows else None


def wait_decided(reader: Any, run_id: str, parts: int | None = None) -> list[Any]:
    return wait_for(lambda: (found := decision(reader, run_id)) is not None
                    and (parts is None or found[3] == parts) and found,
                    90, what=f"capture decision of {run_id}")


def kept_parts(reader: Any, run_id: str) -> list[dict[str, Any]]:
    return reader.query(
        "SELECT event_id, event_type, step, tool, part, encoding, hashes, bytes, truncated, "
        "redactions FROM capture_parts FINAL WHERE run_id = {r:String} ORDER BY step, "
        "event_type, part", {"r": run_id}).records()


def blobs_of(reader: Any, hashes: list[str], table: str = "capture_blobs") -> dict[str, Blob]:
    rows = reader.query(f"SELECT hash, encoding, body FROM {table} FINAL "
                        "WHERE hash IN {h:Array(String)}", {"h": hashes}).rows
    return {digest: Blob(encoding=encoding, body=body) for digest, encoding, body in rows}


def reassemble(reader: Any, run_id: str) -> list[tuple[str, str, Any]]:
    """(event type, part, value) of every kept part, read back from the store."""
    parts = kept_parts(reader, run_id)
    blobs = blobs_of(reader, [h for part in parts for h in part["hashes"]])
    return [(part["event_type"], part["part"],
             assemble_part(PartRef(encoding=part["encoding"], hashes=part["hashes"],
                                   bytes=part["bytes"]), blobs)) for part in parts]


def test_a_scripted_run_is_captured_and_every_part_reassembles_equal(emit, reader, agent):
    user = {"role": "user", "content": "Refund order 7, please — café ☕ \"quoted\"\n\ttab"}
    first_response = "Looking it up.\n¿Qué? 日本語 \u2028 done"
    args = {"order": 7, "note": "naïve", "nested": {"b": [1, 2.5, None, True], "a": "x"}}
    output = {"status": "shipped", "items": [{"sku": "A-1", "qty": 2}]}
    second_response = "Refunded. ✔"
    with emit.run(agent=agent) as run:
        run.step()
        prompt = [SYSTEM, user]
        first = run.llm_call(prompt=prompt, response=first_response, input_tokens=900)
        prompt.append({"role": "assistant", "content": "changed after the call"})  # too late
        run.tool_call("lookup_order", args=args, output=output, latency_ms=12)
        run.step()
        second_prompt = [SYSTEM, user, {"role": "assistant", "content": first_response},
                         {"role": "tool", "content": orjson.dumps(output).decode()}]
        run.llm_call(prompt=second_prompt, response=second_response)
        assert run.timed_tool_call("issue_refund", lambda order: f"refund {order} ok",
                                   {"order": 7}, timeout_s=5) == "refund 7 ok"
        run.end("cannot_complete")
    assert emit.flush(30)
    assert (emit.stats.captures, emit.stats.captures_sent) == (4, 4)

    found = wait_decided(reader, run.run_id, parts=8)
    assert found[:3] == [1, "failure:gave_up", "gave_up"]
    values = reassemble(reader, run.run_id)
    assert values == [
        ("llm.call", "prompt", [SYSTEM, user]),
        ("llm.call", "response", first_response),
        ("tool.call", "args", args),
        ("tool.call", "output", output),
        ("llm.call", "prompt", second_prompt),
        ("llm.call", "response", second_response),
        ("tool.call", "args", {"order": 7}),
        ("tool.call", "output", "refund 7 ok"),
    ]
    assert values[1][2].encode() == first_response.encode()  # strings byte for byte
    assert list(values[2][2]["nested"]) == ["b", "a"]  # key order kept
    # the decision's bytes are the parts' bytes; the event keeps hashes and sizes only
    assert found[4] == sum(part["bytes"] for part in kept_parts(reader, run.run_id))
    payload = orjson.loads(reader.query(
        "SELECT payload FROM events FINAL WHERE event_id = {e:UUID}",
        {"e": str(first.event_id)}).scalar())
    prompt_part = kept_parts(reader, run.run_id)[0]
    assert payload["prompt_hash"] == part_hash(PartRef(encoding="messages",
                                                       hashes=prompt_part["hashes"], bytes=0))
    assert payload["prompt_bytes"] == prompt_part["bytes"]
    assert payload["response_bytes"] == len(first_response.encode())
    assert payload["system_prompt_hash"] == prompt_part["hashes"][0]
    assert "prompt" not in payload and "response" not in payload


def test_a_system_prompt_repeated_across_calls_and_runs_is_stored_once(emit, reader, agent):
    system_hash = blob_hash("json", orjson.dumps(SYSTEM).decode())
    runs = []
    for number in range(2):
        with emit.run(agent=agent) as run:
            for step in range(3):
                run.step()
                run.llm_call(prompt=[SYSTEM, {"role": "user", "content": f"q{number}.{step}"}],
                             response=f"a{number}.{step}")
            run.end("crash", error_type="ToolCrash")
        runs.append(run.run_id)
    assert emit.flush(30)
    for run_id in runs:
        assert wait_decided(reader, run_id, parts=6)[:2] == [1, "failure:hard_error"]
    references = reader.query(
        "SELECT sum(arrayCount(h -> h = {h:String}, hashes)) FROM capture_parts FINAL "
        "WHERE run_id IN {r:Array(String)}", {"h": system_hash, "r": runs}).scalar()
    copies = reader.query("SELECT count() FROM capture_blobs WHERE hash = {h:String}",
                          {"h": system_hash}).scalar()
    assert (references, copies) == (6, 1)


def _bucket(reader: Any, run_id: str) -> int:
    return int(reader.query("SELECT cityHash64({r:String}) % 10000", {"r": run_id}).scalar())


def _run_ids(reader: Any, agent: str) -> tuple[str, str]:
    """One run id inside the 10 % success sample and one outside, by cityHash64."""
    inside = outside = None
    for number in range(500):
        run_id = f"{agent}-s{number}"
        bucket = _bucket(reader, run_id)
        if bucket < 1000 and inside is None:
            inside = run_id
        elif bucket >= 1000 and outside is None:
            outside = run_id
        if inside and outside:
            return inside, outside
    raise AssertionError("no run ids found on both sides of the sample")


def _old_run(emitter: Emitter, agent: str, run_id: str, reason: str, when: datetime) -> None:
    """A run whose events are from ``when``: closed long before the label window ended."""
    with emitter.run(run_id=run_id, agent=agent, ts=when) as run:
        run.llm_call(prompt="hello", response="world!", ts=when + timedelta(seconds=1))
        run.end(reason, ts=when + timedelta(seconds=2))


def test_retention_keeps_failures_samples_successes_and_a_late_wrong_label_keeps(
        emit, reader, agent):
    sampled, not_sampled = _run_ids(reader, agent)
    failed = f"{agent}-failed"
    two_days_ago = datetime.now(UTC) - timedelta(days=2)
    for run_id, reason in ((sampled, "model_done"), (not_sampled, "model_done"),
                           (failed, "cannot_complete")):
        _old_run(emit, agent, run_id, reason, two_days_ago)
    # Two recent successes: inside the label window neither is decided, until one is
    # labelled wrong. The unlabelled one is closed and staged before the label is sent.
    with emit.run(agent=agent) as unlabelled:
        unlabelled.llm_call(prompt="recent", response="ok")
    with emit.run(agent=agent) as labelled:
        labelled.llm_call(prompt="recent too", response="fine")
    assert emit.flush(30)
    wait_for(lambda: reader.query(
        "SELECT count() FROM runs FINAL WHERE run_id IN {r:Array(String)} AND status = 'closed' "
        "AND run_id IN (SELECT run_id FROM capture_staging)",
        {"r": [unlabelled.run_id, labelled.run_id]}).scalar() == 2,
        60, what="recent runs closed and staged")

    assert wait_decided(reader, sampled) == [1, "sampled_success", "success", 2, 11]
    assert wait_decided(reader, not_sampled) == [0, "success_not_sampled", "success", 2, 11]
    assert wait_decided(reader, failed) == [1, "failure:gave_up", "gave_up", 2, 11]
    assert decision(reader, labelled.run_id) is None  # within the label window

    labelled.label("wrong")
    assert emit.flush(30)
    assert wait_decided(reader, labelled.run_id) == [1, "failure:wrong", "wrong", 2, 14]
    assert decision(reader, unlabelled.run_id) is None
    kept = reader.query("SELECT run_id, count() FROM capture_parts FINAL "
                        "WHERE run_id IN {r:Array(String)} GROUP BY run_id ORDER BY run_id",
                        {"r": [sampled, not_sampled, failed, labelled.run_id]}).rows
    assert sorted(map(tuple, kept)) == sorted([(sampled, 2), (failed, 2),
                                               (labelled.run_id, 2)])
    assert [value for _, _, value in reassemble(reader, sampled)] == ["hello", "world!"]


SECRETS = ("ann.lee@example.com", "sk-ant-api03-AbCdEfGhIjKlMnOpQrStUv",
           "eyJhbGciOiJIUzI1NiJ9.payload.sig", "4111 1111 1111 1111",
           "AKIAIOSFODNN7EXAMPLE", "s3cr3t-value-123")


def test_redaction_removes_secrets_before_storage(emit, reader, agent):
    prompt = [SYSTEM, {"role": "user", "content": (
        f"I am {SECRETS[0]}; my key is {SECRETS[1]} and my card {SECRETS[3]}. "
        "Order 4111111111111112 is not a card.")}]
    response = f"Calling with Authorization: Bearer {SECRETS[2]}"
    args = {"api_key": SECRETS[5], "aws": SECRETS[4], "to": SECRETS[0]}
    with emit.run(agent=agent) as run:
        run.llm_call(prompt=prompt, response=response, note=f"ping {SECRETS[0]}")
        run.tool_call("send_mail", args=args, output="sent to [someone]")
        run.end("crash", error_type="MailError")
    assert emit.flush(30)
    wait_decided(reader, run.run_id, parts=4)
    parts = kept_parts(reader, run.run_id)
    assert [(p["part"], p["redactions"]) for p in parts] == [
        ("prompt", 3), ("response", 1), ("args", 3), ("output", 0)]
    values = [value for _, _, value in reassemble(reader, run.run_id)]
    assert values[0][1]["content"] == (
        "I am [REDACTED:email]; my key is [REDACTED:api_key] and my card "
        "[REDACTED:card_number]. Order 4111111111111112 is not a card.")
    assert values[1] == "Calling with Authorization: Bearer [REDACTED:bearer_token]"
    assert values[2] == {"api_key": "[REDACTED:api_key]", "aws": "[REDACTED:api_key]",
                         "to": "[REDACTED:email]"}
    hashes = [h for part in parts for h in part["hashes"]]
    stored = [blob.body for table in ("capture_blobs", "capture_staging_blobs")
              for blob in blobs_of(reader, hashes, table).values()]
    assert len(stored) == 2 * len(set(hashes))
    assert [secret for secret in SECRETS if any(secret in body for body in stored)] == []
    extras = reader.query("SELECT extras['note'] FROM events FINAL WHERE run_id = {r:String} "
                          "AND event_type = 'llm.call'", {"r": run.run_id}).scalar()
    assert extras == '"ping [REDACTED:email]"'


def test_capture_off_sends_nothing(broker, pipeline, reader, agent, tmp_path):
    with Emitter(broker.bootstrap, spool_dir=tmp_path / "spool", capture="off") as emitter:
        with emitter.run(agent=agent) as run:
            event = run.llm_call(prompt=[SYSTEM, {"role": "user", "content": "hi"}],
                                 response="hello")
            run.tool_call("t", args={"a": 1}, output="x")
            run.end("crash")
        assert emitter.flush(30)
    assert (emitter.stats.captures, emitter.stats.capture_bytes) == (0, 0)
    assert event.prompt_hash is not None and event.response_bytes == 5  # hashes still kept
    keys = [record.key for record in read_topic(broker.bootstrap, CAPTURES)]
    assert run.run_id.encode() not in keys


def _message(run_id: str, **changes: Any) -> dict[str, Any]:
    message = build_capture_message(
        event_id=str(uuid.uuid4()), run_id=run_id, agent="bad", ts="2026-11-30T10:00:00Z",
        event_type="llm.call", step=0, tool=None, values={"prompt": "p", "response": "r"})
    body = orjson.loads(message.model_dump_json())
    body.update(changes)
    return body


def test_invalid_capture_messages_are_dead_lettered_with_reasons(broker, pipeline, reader,
                                                                 agent):
    good = _message(f"{agent}-hash")
    digest = good["parts"]["prompt"]["hashes"][0]
    tampered = {**good, "blobs": {**good["blobs"], digest: {"encoding": "text", "body": "P"}}}
    missing = _message(f"{agent}-missing")
    missing["blobs"].pop(missing["parts"]["response"]["hashes"][0])
    too_big = _message(f"{agent}-bytes")
    too_big["parts"]["prompt"]["bytes"] = 2**64
    cases = {
        f"{agent}-version": (_message(f"{agent}-version", capture_version=2),
                             "capture: unsupported capture_version 2 (this build reads 1)"),
        f"{agent}-hash": (tampered,
                          f"capture: blob {digest[:16]}… does not match its content hash"),
        f"{agent}-missing": (missing, "capture: part response references missing blob "
                             f"{blob_hash('text', 'r')[:16]}…"),
        f"{agent}-uuid": (_message(f"{agent}-uuid", event_id="e-1"),
                          "capture: event_id is not a UUID: 'e-1'"),
        f"{agent}-type": (_message(f"{agent}-type", event_type="step"),
                          "capture: capture schema violation: event_type: Input should be "
                          "'llm.call' or 'tool.call'"),
        # ClickHouse stored a step past UInt32 as 0; 2**64 bytes made the sink retry the
        # shared batch forever (orjson writes 64 bits at most): every table stalled
        f"{agent}-step": (_message(f"{agent}-step", step=2**32),
                          "capture: capture schema violation: step: Input should be less "
                          "than or equal to 4294967295"),
        f"{agent}-bytes": (too_big, "capture: capture schema violation: parts.prompt.bytes: "
                           "Input should be less than or equal to 9223372036854775807"),
    }
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
    for run_id, (body, _) in cases.items():
        producer.send(CAPTURES, key=run_id.encode(), value=exact_json(body))
    marker = f"<not json {agent}>".encode()
    producer.send(CAPTURES, key=b"x", value=marker)
    producer.flush(30)
    producer.close()
    wanted = [*cases, ""]
    rows = wait_for(lambda: len(found := reader.query(
        "SELECT run_id, reason FROM dead_letters FINAL WHERE run_id IN {r:Array(String)} "
        "OR payload = {m:String} ORDER BY run_id",
        {"r": list(cases), "m": marker.decode()}).rows) == len(wanted) and found,
        60, what="capture dead letters")
    assert {run_id: reason for run_id, reason in rows if run_id} == {
        run_id: reason for run_id, (_, reason) in cases.items()}
    assert [reason for run_id, reason in rows if not run_id] == [
        "capture: malformed JSON: unexpected character, expected a JSON value: line 1 "
        "column 1 (char 0)"]
    staged = reader.query("SELECT count() FROM capture_staging WHERE run_id IN "
                          "{r:Array(String)}", {"r": list(cases)}).scalar()
    assert staged == 0
