"""The event contract: validation at the edge, evolution rules, the JSON Schema file."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
import pytest
from pydantic import ValidationError

from loopwatch.ingest.events import LlmCall, ToolCall, llm_usage_from_exclusive, parse_event
from loopwatch.ingest.jsonschema import checked_in, render
from loopwatch.ingest.wire import decode_message, encode_envelope, encode_event


def test_checked_in_json_schema_matches_the_models():
    assert checked_in() == render(), "run `loopwatch schema ingest/schema/events.schema.json`"


def test_unknown_fields_are_kept_in_extras_and_survive_the_wire():
    event = parse_event({"event_type": "step", "run_id": "r", "agent": "a", "step": 2,
                         "gpu": "h100", "tags": {"team": "search"}})
    assert event.extras == {"gpu": "h100", "tags": {"team": "search"}}
    decoded = decode_message(encode_event(event), 10_000).events[0]
    assert decoded.extras == event.extras
    assert decoded == event


def test_newer_minor_version_is_accepted_unknown_major_is_not():
    assert parse_event({"event_type": "step", "run_id": "r", "agent": "a", "step": 0,
                        "schema_version": "1.9"}).schema_version == "1.9"
    future = {"event_type": "step", "run_id": "r", "agent": "a", "step": 0,
              "schema_version": "2.0"}
    with pytest.raises(ValidationError, match="unsupported schema_version major 2"):
        parse_event(future)
    letter = decode_message(orjson.dumps(future), 10_000).dead[0]
    assert (letter.reason, letter.run_id) == (
        "unsupported schema_version major 2 (this build reads 1.x)", "r")


def test_timestamps_accept_epoch_millis_and_become_utc():
    event = parse_event({"event_type": "run.start", "run_id": "r", "agent": "a",
                         "ts": 1_764_000_000_000})
    assert event.ts == datetime(2025, 11, 24, 16, 0, tzinfo=UTC)


def test_otel_token_semantics_and_conversion_from_exclusive_counts():
    call = LlmCall(run_id="r", agent="a", input_tokens=6400, cache_read_input_tokens=6000)
    assert call.uncached_input_tokens == 400
    converted = LlmCall(run_id="r", agent="a", **llm_usage_from_exclusive(400, 6000, 100))
    assert (converted.input_tokens, converted.uncached_input_tokens) == (6500, 400)
    assert converted.token_convention == "exclusive"


def test_invalid_fields_raise_with_the_field_named():
    with pytest.raises(ValidationError, match="input_tokens"):
        LlmCall(run_id="r", agent="a", input_tokens=-5)
    with pytest.raises(ValidationError, match="tool"):
        ToolCall(run_id="r", agent="a", tool="")


def test_numbers_must_be_finite():
    """``1e999`` is valid JSON that parses as infinity; it is refused (an infinite
    latency would poison every aggregate, and JSON cannot even write it back)."""
    with pytest.raises(ValidationError, match="finite number"):
        LlmCall(run_id="r", agent="a", latency_ms=float("inf"))
    value = b'{"event_type": "llm.call", "run_id": "r", "agent": "a", "latency_ms": 1e999}'
    decoded = decode_message(value, 10_000)
    assert decoded.events == []
    assert [letter.reason for letter in decoded.dead] == [
        "malformed JSON: number is infinity when parsed as double: line 1 column 71 (char 70)"]


def test_envelope_round_trip_keeps_order():
    events = [ToolCall(run_id="r", agent="a", tool=f"t{i}") for i in range(5)]
    decoded = decode_message(encode_envelope(events), 100_000)
    assert decoded.events == events and decoded.dead == []


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"{not json", "malformed JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"event_type": "step", "run_id": "r", "agent": "a"}', "schema violation: step"),
        (b'{"event_type": "teleport", "run_id": "r", "agent": "a"}', "schema violation"),
        (b'{"envelope_version": 9, "events": []}', "unsupported envelope_version 9"),
        (b"x" * 2000, "oversized message: 2000 bytes > 1000"),
        (None, "empty message"),
    ],
)
def test_bad_input_becomes_a_dead_letter_with_its_reason(value, reason):
    decoded = decode_message(value, 1000)
    assert decoded.events == []
    assert len(decoded.dead) == 1
    assert decoded.dead[0].reason.startswith(reason)


def test_one_bad_event_in_an_envelope_does_not_cost_its_neighbours():
    good = orjson.loads(encode_event(ToolCall(run_id="r", agent="a", tool="t")))
    body = orjson.dumps({"envelope_version": 1,
                         "events": [good, {"event_type": "step", "run_id": "r2", "agent": "a",
                                           "step": -1}, good]})
    decoded = decode_message(body, 100_000)
    assert len(decoded.events) == 2
    assert [letter.run_id for letter in decoded.dead] == ["r2"]
    assert "step: Input should be greater than or equal to 0" in decoded.dead[0].reason
