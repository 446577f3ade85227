"""What an OTLP burst stores does not depend on how the receiver builds its events nor
on how the processors decode them.

The bench's burst (``loopwatch.bench.otlp_burst``: GenAI traces, children before their
root, cut into export requests so traces straddle requests) is mapped by the receiver's
own code and packed into the messages its emitter sends (one envelope per partition per
request). Today's path: the events built as msgspec structs
(:func:`loopwatch.ingest.structs.claim_struct`) and encoded by
:func:`loopwatch.ingest.structs.encode_claim`, decoded by the processors with
:func:`loopwatch.ingest.structs.mirror_claims`. The path before: pydantic models,
pydantic's JSON, pydantic's decode. Folded and stored through the real views into a
real chdb store, in one batch or four, every column of every table must be equal.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, ClassVar

import msgspec

from loopwatch.bench.otlp_burst import EVENTS_PER_TRACE, build_burst
from loopwatch.bench.store_path import fingerprint
from loopwatch.core.config import Settings
from loopwatch.ingest.otlp.decode import decode_protobuf
from loopwatch.ingest.otlp.mapping import map_spans
from loopwatch.ingest.sdk import MAX_BATCH, partition_for
from loopwatch.ingest.structs import CLAIM_MIRRORS, encode_claim
from loopwatch.ingest.wire import decode_message, envelope_chunks, message_value
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.store.sink import ClickHouseSink
from tests.stores import fresh_store

TRACES = 120
#: small requests, so that many traces straddle two (their children in the first)
PER_REQUEST = 50


class PydanticPipeline(Pipeline):
    """The fold as it decoded the receiver's events before: pydantic models."""

    decode_structs: ClassVar[bool] = False


def burst_messages(settings: Settings, bodies: list[bytes], structs: bool
                   ) -> list[RawMessage]:
    """The burst as the processors read it: each request's events, as the receiver's
    emitter sends them (:meth:`loopwatch.ingest.sdk.Emitter.send_and_wait`), built as
    structs or as models."""
    offsets: dict[int, int] = defaultdict(int)
    messages = []
    for body in bodies:
        groups: dict[int, list[bytes]] = defaultdict(list)
        events = map_spans(decode_protobuf(body).spans, structs=structs).events
        assert all(isinstance(event, msgspec.Struct) == structs for event in events)
        for event in events:
            groups[partition_for(event.run_id, settings.partitions)].append(
                encode_claim(event) if structs
                else event.__pydantic_serializer__.to_json(event, exclude_none=True))
        for partition, lines in groups.items():
            for chunk in envelope_chunks(lines, MAX_BATCH, settings.max_message_bytes):
                messages.append(RawMessage(settings.events_topic, partition,
                                           offsets[partition], message_value(chunk)))
                offsets[partition] += 1
    return messages


def stored(local_store: Any, build: type[Pipeline], messages: list[RawMessage],
           batches: int) -> dict[str, list[Any]]:
    settings, client = fresh_store(local_store, "burst")
    try:
        pipeline = build(settings, MemoryRunStore())
        sink = ClickHouseSink(client)
        size = len(messages) // batches + 1
        for start in range(0, len(messages), size):
            sink.write_batch(pipeline.process(messages[start:start + size]).rows)
        assert pipeline.counters.dead_letters == 0
        found = fingerprint(client, skip=("ingested_at",))
        found["distinct"] = list(client.query(
            "SELECT (SELECT uniqExact(event_id) FROM events), (SELECT count() FROM runs "
            "FINAL WHERE closed_ts IS NOT NULL), (SELECT count() FROM llm_calls FINAL), "
            "(SELECT uniqExact(agent, agent_rank) FROM llm_calls FINAL)").result_rows[0])
        return found
    finally:
        client.command(f"DROP DATABASE {settings.database}")


def test_the_structs_store_every_column_as_pydantic_did(local_store):
    settings = local_store[0]
    bodies = build_burst(TRACES, seed=11, per_request=PER_REQUEST)
    messages = burst_messages(settings, bodies, structs=True)
    before = burst_messages(settings, bodies, structs=False)
    assert len(messages) == len(before)
    decoded = [decode_message(m.value, settings.max_message_bytes, structs=True)
               for m in messages]
    assert all(d.events_json is not None and d.events_extras is not None for d in decoded)
    assert {type(event) for d in decoded for event in d.events} <= set(CLAIM_MIRRORS)
    for batches in (1, 4):
        expected = stored(local_store, PydanticPipeline, before, batches)
        found = stored(local_store, Pipeline, messages, batches)
        assert found == expected
        # every event, every run closed, one agent (the root's) for every call
        assert found["distinct"] == [TRACES * EVENTS_PER_TRACE, TRACES, TRACES * 5, 2]
