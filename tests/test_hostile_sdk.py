"""Hostile input at the SDK (``loopwatch.ingest.sdk``) and, end to end, garbage produced raw to the
events topic: through the session broker and the shared pipeline into ClickHouse.

Inputs the processors' core is tested with in-process (test_hostile_pipeline.py:
nesting 255-1024 deep, ts beyond any date, counts beyond 64 bits) are not repeated here.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from kafka import KafkaProducer
from pydantic import ValidationError

from loopwatch.ingest.events import Step
from loopwatch.ingest.sdk import Emitter
from tests.conftest import scalar, stored_events, wait_for, wait_stored
from tests.test_hostile_pipeline import ODD_STRINGS, json_values, nested

EXAMPLES = 150
RAW_GARBAGE_MESSAGES = 300
TRIED: dict[str, int] = {}
FIELDS = ["step", "input_tokens", "output_tokens", "cost_usd", "latency_ms", "tool",
          "terminal_reason", "verdict", "ts", "event_id", "run_id", "agent", "http_status",
          "cache_ttl", "schema_version", "extra_field", "args", "attempt", "model"]


@pytest.fixture(scope="module", autouse=True)
def summary() -> Iterator[None]:
    yield
    print("\nhostile input at the SDK and the raw topic: "
          + ", ".join(f"{name} {count}" for name, count in TRIED.items()))


def good_run(emitter: Emitter, agent: str) -> str:
    with emitter.run(agent=agent, model="claude-sonnet-4", task_type="qa") as run:
        run.step()
        run.llm_call(input_tokens=1000, output_tokens=100)
        run.tool_call("search", args={"q": "x"}, latency_ms=5)
        run.end("model_done")
    return run.run_id


def assert_good_run(reader: Any, agent: str) -> None:
    wait_for(lambda: scalar(reader, "SELECT count() FROM runs FINAL WHERE agent = {a:String} "
                                    "AND status = 'closed'", a=agent) == 1, 90,
             what="the good run closed")
    row = reader.query("SELECT outcome, steps, llm_calls, tool_calls, input_tokens, "
                       "output_tokens, round(cost_usd, 6) FROM runs FINAL "
                       "WHERE agent = {a:String}", {"a": agent}).rows
    assert row == [["success", 1, 1, 1, 1000, 100, 0.0045]]
    assert stored_events(reader, agent) == 5


#: kafka-python, in the emitter's sender thread, draws from the global ``random`` (broker
#: choice, reconnect jitter) while hypothesis draws an example on this thread; hypothesis
#: reads that as a strategy using ``random``. No strategy here does.
@pytest.mark.filterwarnings(
    "ignore:Do not use the `random` module inside strategies"
    ":hypothesis.errors.HypothesisDeprecationWarning")
def test_bad_calls_raise_at_the_call_site_and_never_stop_the_sender(
        emitter: Emitter, reader, agent: str):
    """Property: any call of the run helpers with wrong types, huge or deeply nested
    values, odd unicode or unknown fields either raises a clear error right there
    (ValidationError, TypeError or ValueError) or queues an event; the background sender
    stays alive, everything queued is acknowledged, and a good run emitted afterwards is
    stored exactly."""
    outcomes = {"raised": 0, "queued": 0}
    garbage_agent = f"{agent}-garbage"

    @hypothesis_settings(max_examples=EXAMPLES, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow,
                                                HealthCheck.data_too_large])
    @given(method=st.sampled_from(["step", "llm_call", "tool_call", "label", "end"]),
           fields=st.dictionaries(st.sampled_from(FIELDS), json_values
                                  | st.sampled_from([*ODD_STRINGS, nested(300),
                                                     float("nan"), float("inf"), -1])
                                  | st.just(50_000).map(lambda size: "x" * size),
                                  max_size=4))
    @example(method="step", fields={"step": float("inf")})  # was OverflowError from int()
    @example(method="step", fields={"step": 1e300})
    def call(method: str, fields: dict[str, Any]) -> None:
        with emitter.run(agent=garbage_agent) as run:
            try:
                if method == "tool_call":
                    run.tool_call(str(fields.pop("tool", "t")), **fields)
                elif method in ("label", "end"):
                    first = fields.pop("verdict" if method == "label" else "terminal_reason",
                                       "wrong" if method == "label" else "model_done")
                    getattr(run, method)(first, **fields)
                else:
                    getattr(run, method)(**fields)
            except (ValidationError, TypeError, ValueError) as exc:
                assert str(exc)
                outcomes["raised"] += 1
            else:
                outcomes["queued"] += 1

    call()
    assert emitter._thread.is_alive()
    assert emitter.flush(60)
    good_run(emitter, agent)
    assert emitter.flush(60)
    assert_good_run(reader, agent)
    TRIED["SDK calls"] = outcomes["raised"] + outcomes["queued"]
    TRIED["SDK calls refused at the call site"] = outcomes["raised"]


@pytest.mark.parametrize("line", [b"not json", b"[1, 2]", b'{"run_id": 5}'])
def test_a_bad_raw_line_is_refused_and_the_sender_survives(broker, tmp_path: Path, line):
    emitter = Emitter(broker.bootstrap, spool_dir=tmp_path / "spool")
    try:
        with pytest.raises((ValueError, TypeError)):
            emitter.emit_raw([line])
        assert emitter.flush(10)
        assert emitter._thread.is_alive()
    finally:
        emitter.close(timeout_s=1)


def test_an_event_over_the_request_size_is_refused_at_the_call_site(broker, tmp_path: Path):
    with (Emitter(broker.bootstrap, spool_dir=tmp_path / "spool") as emitter,
          pytest.raises(ValueError), emitter.run(agent="huge") as run):
        run.llm_call(provider="x" * 2_000_000)


# -- end to end: garbage produced raw to the events topic --------------------------------

def _garbage(rng: random.Random, marker: str) -> bytes:
    """One message that yields exactly one dead letter, carrying ``marker``."""
    kind = rng.randrange(8)
    event: dict[str, Any] = {"event_type": "step", "run_id": f"{marker}-run", "agent": marker,
                             "step": 1}
    if kind == 0:
        return marker.encode() + bytes(rng.randrange(256) for _ in range(rng.randrange(50)))
    if kind == 1:
        return json.dumps([marker, rng.random()]).encode()
    if kind == 2:
        return json.dumps({**event, "step": rng.choice(["x", -1, None, [], ODD_STRINGS[4]])}
                          ).encode()
    if kind == 3:
        return json.dumps({**event, "schema_version": "2.0"}).encode()
    if kind == 4:
        return json.dumps({"envelope_version": 7, "events": [event]}).encode()
    if kind == 5:
        return json.dumps({**event, "pad": "x" * 210_000}).encode()  # over the 200 kB cap
    if kind == 6:
        return json.dumps({**event, "event_type": rng.choice(ODD_STRINGS)}).encode()
    return json.dumps(event)[:-1].encode()  # truncated


def test_raw_garbage_on_the_topic_is_dead_lettered_with_reasons_and_a_good_run_is_exact(
        broker, pipeline, reader, emitter: Emitter, agent: str):
    """End to end: 300 garbage messages produced raw (kafka-python, no SDK) to the events
    topic, each yielding one dead letter, with a good run emitted in the middle. Every
    garbage message is a ``dead_letters`` row with a non-empty reason (counted exactly),
    and the good run is stored exactly."""
    marker = f"hostile-{uuid.uuid4().hex[:12]}"
    rng = random.Random(11)
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all",
                             max_request_size=1_048_576)
    try:
        for index in range(RAW_GARBAGE_MESSAGES):
            producer.send("loopwatch.events", value=_garbage(rng, marker),
                          partition=index % 4)
            if index == RAW_GARBAGE_MESSAGES // 2:
                good_run(emitter, agent)
        producer.flush(60)
    finally:
        producer.close(10)
    assert emitter.flush(60)
    wait_stored(reader, agent, 5)
    sql = ("SELECT count(), countIf(reason = '') FROM dead_letters FINAL "
           "WHERE position(payload, {m:String}) > 0")
    wait_for(lambda: reader.query(sql, {"m": marker}).rows[0][0] >= RAW_GARBAGE_MESSAGES,
             120, what="every garbage message dead-lettered")
    assert reader.query(sql, {"m": marker}).rows == [[RAW_GARBAGE_MESSAGES, 0]]
    reasons = reader.query(
        "SELECT splitByChar(':', reason)[1] AS kind, count() FROM dead_letters FINAL "
        "WHERE position(payload, {m:String}) > 0 GROUP BY kind ORDER BY kind",
        {"m": marker}).rows
    assert_good_run(reader, agent)
    TRIED["raw garbage messages"] = RAW_GARBAGE_MESSAGES
    TRIED.update({f"dead letters '{kind[:30]}'": n for kind, n in reasons})


# -- hostile files: what a starting emitter finds in spool folders ------------------------

def test_hostile_spool_folders_are_sent_on_as_dead_letters_or_refused_never_followed(
        broker, pipeline, reader, agent: str, tmp_path: Path):
    """A starting emitter adopts the spool folders of exited emitters under its data dir.
    What it finds there is input like any other: garbage lines are sent on and come back
    as dead letters with their reasons; a capture record naming a topic of its choosing
    is dropped and counted (a record must not pick its topic); a segment that is a
    symlink (to a file holding a secret) is never read, so the secret goes nowhere; a
    folder that is a symlink is not adopted. The good events around them are stored."""
    root = tmp_path / "data" / "spool"
    root.mkdir(parents=True)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b'{"run_id":"leak","secret":"' + agent.encode() + b'-SECRET"}\n')
    marker = f"{agent}-garbage"
    good = Step(run_id=f"{agent}-run", agent=agent, step=0).model_dump_json().encode()
    orphan = root / "exited"
    orphan.mkdir()
    (orphan / "seg-000000000000.log").write_bytes(b"\n".join([
        good,
        marker.encode() + b"\xff\xfe not json",
        b'{"event_type": "step", "run_id": "' + marker.encode() + b'", "step": "x"}',
        b"@attacker.topic " + marker.encode(),
        b"@",
    ]) + b"\n")
    (orphan / "seg-000000000001.log").symlink_to(secret)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "seg-000000000000.log").write_bytes(secret.read_bytes())
    (root / "linked").symlink_to(elsewhere, target_is_directory=True)
    with Emitter(broker.bootstrap, data_dir=tmp_path / "data",
                 max_message_bytes=100_000) as emitter:
        wait_for(lambda: emitter.stats.resent >= 3 and emitter.spool.unconfirmed() == 0,
                 60, what="the adopted records to be resent")
        assert emitter.spool.dropped == 2  # the two capture records naming a topic
        emitter.emit(Step(run_id=f"{agent}-run", agent=agent, step=1))
    # what was adopted is gone; the planted link is left as it was, never followed
    assert [path.name for path in orphan.iterdir()] == ["seg-000000000001.log"]
    assert (orphan / "seg-000000000001.log").is_symlink() and (root / "linked").is_symlink()
    assert (elsewhere / "seg-000000000000.log").read_bytes() == secret.read_bytes()
    wait_stored(reader, agent, 2)
    sql = ("SELECT count() FROM dead_letters FINAL WHERE position(payload, {m:String}) > 0")
    wait_for(lambda: scalar(reader, sql, m=marker) >= 2, 90, what="the garbage dead-lettered")
    assert scalar(reader, sql, m=marker) == 2
    assert scalar(reader, sql, m=f"{agent}-SECRET") == 0
    assert scalar(reader, "SELECT count() FROM events FINAL WHERE run_id = 'leak' "
                          "AND position(payload, {m:String}) > 0", m=agent) == 0
    assert stored_events(reader, agent) == 2
