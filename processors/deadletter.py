"""Dead letters that always fit: what the processors produce for input they refuse.

A dead letter is a ``dead_letters`` row and a record on the dead-letter topic. Both
keep the refused payload whole when it is at most :func:`payload_limit` bytes (so
``loopwatch dlq replay`` can send it back once the cause is fixed), and otherwise its
first ``payload_limit`` bytes, the whole payload's size and sha256: a 10 MB message
used to become a 10 MB dead-letter record the producer refused, resent every second
forever while no offset was committed again.

The limit is the smaller of ``max_message_bytes`` (every message the processors accept
by size stays replayable) and what the broker takes for one record
(``broker_max_message_bytes``) less room for the record's key, headers and batch
framing (:func:`loopwatch.processors.kafka_writes.record_limit`). A cut letter says so in its
reason (the table has no columns for size and hash) and in its headers, and replay
leaves it alone: its payload is no longer the message.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from loopwatch.core.config import Settings
from loopwatch.processors.kafka_writes import record_limit

#: a reason longer than this is cut (it travels in a header)
MAX_REASON_CHARS = 4000
#: what a cut letter's reason carries after the reason itself, and what replay looks for
CUT_MARK = "; payload cut:"
HEADER_REASON = "loopwatch-reason"
HEADER_SOURCE = "loopwatch-source"
HEADER_SIZE = "loopwatch-payload-bytes"
HEADER_SHA256 = "loopwatch-payload-sha256"
HEADER_KEPT = "loopwatch-payload-kept"


def payload_limit(settings: Settings) -> int:
    """How many bytes of a refused payload a dead letter keeps.

    >>> payload_limit(Settings(max_message_bytes=200_000))
    200000
    >>> payload_limit(Settings(max_message_bytes=5_000_000))
    1032204
    """
    return min(settings.max_message_bytes, record_limit(settings))


@dataclass(frozen=True, slots=True)
class DeadLetterRecord:
    """One dead letter: ``payload`` is the refused payload whole, or its first bytes
    (then shorter than ``size``); ``size`` and ``sha256`` are the whole payload's."""

    letter_id: str
    source: str
    reason: str
    run_id: str
    payload: bytes
    size: int = -1
    sha256: str = ""

    @property
    def cut(self) -> bool:
        return len(self.payload) < self.size

    def headers(self) -> list[tuple[str, bytes]]:
        return [(HEADER_REASON, self.reason.encode()), (HEADER_SOURCE, self.source.encode()),
                (HEADER_SIZE, str(self.size).encode()), (HEADER_SHA256, self.sha256.encode()),
                (HEADER_KEPT, str(len(self.payload)).encode())]

    def without_payload(self) -> DeadLetterRecord | None:
        """The letter with no payload (reason, size and hash still say what it was), for
        a broker that refuses it whole; None if it has none left to drop."""
        if not self.payload:
            return None
        return DeadLetterRecord(self.letter_id, self.source, self.reason, self.run_id, b"",
                                self.size, self.sha256)


def bounded(letter_id: str, source: str, reason: str, run_id: str, payload: bytes,
            limit: int) -> DeadLetterRecord:
    """The dead letter for ``payload``, cut to ``limit`` bytes if it is longer.

    >>> record = bounded("id", "t:0:5:0", "oversized message", "", b"abcdef", 4)
    >>> record.payload, record.size, record.cut, record.reason[:38]
    (b'abcd', 6, True, 'oversized message; payload cut: 6 byte')
    >>> bounded("id", "t:0:5:0", "bad", "", b"ab", 4).reason
    'bad'
    """
    size = len(payload)
    digest = hashlib.sha256(payload).hexdigest()
    reason = reason[:MAX_REASON_CHARS]
    if size > limit:
        reason = (f"{reason}{CUT_MARK} {size} bytes, sha256 {digest}, "
                  f"first {limit} bytes kept")
        payload = payload[:limit]
    return DeadLetterRecord(letter_id, source, reason, run_id[:256], payload, size, digest)
