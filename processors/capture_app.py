"""The faust binding of :class:`loopwatch.processors.capture.CaptureStage`: the captures topic.

One more agent on the processors' faust app (same consumer group, same sink, same
dead-letter topic). Delivery guarantee as for events: a batch's rows are written
through the sink (which blocks and retries until the store accepts them) and only then
are its messages acked, and faust later commits their offsets; a crash or a stop
before that redelivers the batch and the keyed rows are rewritten unchanged.
Bodies travel on their own topic so that the run pipeline's hot path never carries
them, and a slow capture write never holds up run assembly beyond the shared sink.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from loopwatch.processors.capture import CaptureStage
from loopwatch.processors.deadletter import payload_limit
from loopwatch.processors.pipeline import RawMessage
from loopwatch.store.sink import RetriesStopped

if TYPE_CHECKING:
    from loopwatch.processors.app import Processor

log = logging.getLogger(__name__)

#: Capture messages carry bodies (tens of KB each): smaller batches than events keep a
#: batch's memory and insert size bounded.
MAX_BATCH = 200


def register_captures(processor: Processor) -> CaptureStage:
    """Add the capture agent to ``processor``'s app; returns its stage (for counters)."""
    settings = processor.settings
    topic = processor.app.topic(
        settings.captures_topic, key_type=bytes, value_type=bytes,
        key_serializer="raw", value_serializer="raw", partitions=settings.partitions,
    )
    stage = CaptureStage(payload_limit(settings))

    async def stage_captures(stream: Any) -> None:
        """faust acks a taken batch when the loop body ends, also by an exception or a
        cancellation: each message carries one more reference, dropped only once the
        batch is written, so a write cut short by a stop leaves its offsets uncommitted."""
        async for events in stream.take_events(min(MAX_BATCH, settings.batch_max_events),
                                               within=settings.batch_max_wait_s):
            for event in events:
                event.message.incref()
            messages = [RawMessage(e.message.topic, e.message.partition, e.message.offset,
                                   e.message.value) for e in events]
            try:
                await processor._write(stage.process(messages, datetime.now(UTC)))
            except RetriesStopped as exc:
                log.warning("stopping with captures not stored (%s); they are read again "
                            "after a restart", exc)
                return
            for event in events:
                await stream.ack(event)

    processor.app.agent(topic, name="stage-captures")(stage_captures)
    return stage
