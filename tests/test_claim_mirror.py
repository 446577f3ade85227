"""The msgspec decode of events carrying the OTLP receiver's extras
(:func:`loopwatch.ingest.structs.mirror_claims`) takes only what it reads exactly as
pydantic does: the extras, their values and their order (which ``events.payload`` and
``events.extras`` keep), and leaves anything else to pydantic."""

from __future__ import annotations

import orjson
import pytest

from loopwatch.ingest.structs import mirror_claims
from loopwatch.ingest.wire import ENVELOPE_VERSION, decode_message
from loopwatch.processors.rows import validated_events_json

CALL = (b'{"event_type":"llm.call","event_id":"0190d5a4-0000-7000-8000-000000000001",'
        b'"run_id":"r","agent":"a","ts":"2026-01-02T03:04:05Z","input_tokens":9')


def envelope(*events: bytes) -> bytes:
    return b'{"envelope_version":1,"events":[' + b",".join(events) + b"]}"


ACCEPTED = {
    "receiver order": CALL + b',"conversation_id":"c","otel_agent_rank":3,'
                      b'"otel_agent_named_at":0,"otel_convention":"gen_ai",'
                      b'"otel_operation":"chat"}',
    "another order": CALL + b',"otel_operation":"chat","otel_agent_rank":0,'
                     b'"agent_id":"id-\xc3\xa9","otel_agent_named_at":12,"conversation_id":"q\\"x"}',
    "extras among fields": b'{"event_type":"tool.call","otel_agent_rank":1,"run_id":"r",'
                           b'"tool_call_id":"call_1","agent":"a","tool":"t",'
                           b'"event_id":"0190d5a4-0000-7000-8000-000000000002",'
                           b'"ts":"2026-01-02T03:04:05Z"}',
    "no extras at all": CALL + b',"cost_usd":null}',
    "a rank past 64 bits": CALL + b',"otel_agent_rank":123456789012345678901234567890}',
    "a key inside a string": CALL + b',"model":"x\\",\\"otel_agent_rank\\":3",'
                             b'"otel_convention":"gen_ai"}',
}

REFUSED = {
    "a null extra": CALL + b',"otel_agent_rank":3,"conversation_id":null}',
    "an extra first": b'{"otel_agent_rank":3,' + CALL[1:] + b"}",
    "a repeated extra": CALL + b',"otel_agent_rank":3,"otel_agent_rank":2}',
    "spaces": CALL + b', "otel_agent_rank": 3}',
    "a rank as a string": CALL + b',"otel_agent_rank":"3"}',
    "a rank as a bool": CALL + b',"otel_agent_rank":true}',
    "an unknown extra": CALL + b',"otel_agent_rank":3,"surprise":1}',
    "an extra holding an object": CALL + b',"conversation_id":{"a":1}}',
    "a field out of bounds": CALL.replace(b'"input_tokens":9', b'"input_tokens":-1')
                             + b',"otel_agent_rank":3}',
}


def pydantic_reading(value: bytes) -> tuple[list[dict[str, object]], list[dict[str, str]]]:
    """Each event's fields and extras as the pydantic decode reads them."""
    decoded = decode_message(value, 10_000, structs=False)
    events_json, extras = validated_events_json(decoded.events)
    fields = [{key: item for key, item in event.items() if item is not None}
              for event in orjson.loads(events_json)]
    return fields, extras


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_what_the_structs_take_reads_as_pydantic_reads_it(name: str):
    for value in (ACCEPTED[name], envelope(ACCEPTED[name], ACCEPTED["receiver order"])):
        claimed = mirror_claims(value, ENVELOPE_VERSION)
        assert claimed is not None
        fields, extras = pydantic_reading(value)
        assert [list(extra.items()) for extra in claimed.extras] == [
            list(extra.items()) for extra in extras]
        assert [list(event.__pydantic_extra__) for event in claimed.events] == [
            list(extra) for extra in extras]
        assert orjson.loads(claimed.as_json) == fields


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_anything_else_is_left_to_pydantic(name: str):
    value = REFUSED[name]
    assert mirror_claims(value, ENVELOPE_VERSION) is None
    assert mirror_claims(envelope(ACCEPTED["receiver order"], value), ENVELOPE_VERSION) is None
    structs = decode_message(value, 10_000, structs=True)
    models = decode_message(value, 10_000, structs=False)
    assert structs.events_json is None
    assert structs.events == models.events
    assert [d.reason for d in structs.dead] == [d.reason for d in models.dead]
