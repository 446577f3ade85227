"""The processors' own writes to Kafka (state changelog, dead letters): sent again while
the broker fails for a while, never sent again forever.

A send that fails for a reason that passes (a timeout, a leader moving, the broker
restarting) is sent again until the broker takes it: without that, a batch's messages
stay unacked and every later batch waits on them, so no offset is committed again; in
the sweep timer it crashes the faust app, and with it ``loopwatch up`` and the memory
of its embedded broker. Sending a record twice is harmless: the changelog keeps a
run's last value, and a dead letter's id is its key.

A record refused for good (too large for the producer or the broker, an invalid topic:
:data:`PERMANENT`) is never sent again as it was. The caller says how to reduce it
(a dead letter loses its payload, a changelog record becomes a deletion); what cannot
be reduced further is dropped, counted and logged as an error. A 10 MB dead letter
resent every second was how one oversized message stopped every commit for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from aiokafka.errors import (
    InvalidTopicError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
)

from loopwatch.core.config import Settings
from loopwatch.store.sink import RetriesStopped

log = logging.getLogger(__name__)

R = TypeVar("R")

#: errors no retry can cure: the same record gets the same answer
PERMANENT: tuple[type[Exception], ...] = (
    MessageSizeTooLargeError, RecordTooLargeError, RecordListTooLargeError, InvalidTopicError)
#: room left in a record for its key, headers and the record batch's framing
RECORD_HEADROOM_BYTES = 16_384


def record_limit(settings: Settings) -> int:
    """The most bytes of key and value one record the processors produce may hold.

    >>> record_limit(Settings())
    1032204
    """
    return settings.broker_max_message_bytes - RECORD_HEADROOM_BYTES


def permanent(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps: faust raises ``ProducerSendError`` from the
    client's error) is a refusal that sending again cannot change.

    >>> from faust.exceptions import ProducerSendError
    >>> try:
    ...     try:
    ...         raise MessageSizeTooLargeError("10 MB")
    ...     except MessageSizeTooLargeError as inner:
    ...         raise ProducerSendError("Error while sending") from inner
    ... except ProducerSendError as wrapped:
    ...     permanent(wrapped), permanent(TimeoutError())
    (True, False)
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, PERMANENT):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


@dataclass
class WriteCounters:
    #: sends that failed for a reason that passes, and were sent again
    retries: int = 0
    #: records refused for good and sent again reduced (see the callers' ``reduce``)
    reduced: int = 0
    #: records refused for good with nothing left to reduce: not on Kafka at all
    dropped: int = 0


class KafkaWrites:
    """Delivers records: transient failures are retried, permanent ones reduced."""

    def __init__(self, retry_s: float) -> None:
        self._retry_s = retry_s
        self._stopping = asyncio.Event()
        self.counters = WriteCounters()

    @property
    def retries(self) -> int:
        return self.counters.retries

    def stop_retrying(self) -> None:
        """As :meth:`loopwatch.store.sink.RetryingSink.stop_retrying`, for Kafka writes."""
        self._stopping.set()

    async def deliver(self, what: str, records: Sequence[R],
                      send: Callable[[Sequence[R]], Awaitable[Sequence[BaseException | None]]],
                      reduce: Callable[[R, BaseException], R | None]) -> None:
        """Send ``records`` until the broker has each of them or its reduction.

        ``send`` sends records and returns one outcome per record (None: delivered, or
        the error); ``reduce`` turns a record refused for good into a smaller one, or
        None when nothing smaller is worth sending (the record is then dropped). After
        :meth:`stop_retrying` a transient failure raises :class:`RetriesStopped`;
        cancellation still stops."""
        pending = list(records)
        while pending:
            try:
                outcomes: Sequence[BaseException | None] = await send(pending)
            except Exception as exc:  # the whole send failed: each record failed with it
                outcomes = [exc] * len(pending)
            again: list[R] = []
            transient: BaseException | None = None
            for record, outcome in zip(pending, outcomes, strict=True):
                if outcome is None:
                    continue
                if not permanent(outcome):
                    again.append(record)
                    transient = outcome
                    continue
                smaller = reduce(record, outcome)
                if smaller is None:
                    self.counters.dropped += 1
                    log.error("the broker refused %s for good (%r) and it cannot be made "
                              "smaller: dropped (%d dropped so far)", what, outcome,
                              self.counters.dropped)
                else:
                    self.counters.reduced += 1
                    again.append(smaller)
            pending = again
            if transient is not None:
                await self._wait_to_retry(what, transient)

    async def _wait_to_retry(self, what: str, exc: BaseException) -> None:
        self.counters.retries += 1
        log.warning("the broker did not take %s (%r); sending again in %.1f s",
                    what, exc, self._retry_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), self._retry_s)
        if self._stopping.is_set():
            raise RetriesStopped(f"{what} were not sent ({exc!r})") from exc
