"""Holes in an events partition: a message the consumer skipped, found and read again.

Kafka offsets of the events topic are contiguous (it is not compacted and no producer
writes transactions), so a partition that delivers offset 13 after 11 skipped 12. The
SIGKILL-of-``up`` test saw exactly that about once in six runs: after the restarted
worker's group rebalanced, one envelope (partition 2, offset 12) was never delivered,
while 13..20 were. faust-streaming marks a message read even when the rebalance cut
short its hand-over to the stream (``Consumer._drain_messages`` sets the read offset
after ``wait_first(callback(message), suspend_flow.wait())`` whichever finished), and
the fetcher's position had already moved past it.

:class:`PartitionContinuity` watches each partition's offsets as the agent takes them.
At a hole it keeps back the rest of that partition's messages in the batch and asks for
the partition to be read again from the first missing offset; messages kept back are
never acknowledged, so the group's committed offset cannot pass the hole, and their
copies read again are folded and acknowledged in offset order. A hole that is still
there after ``max_attempts`` re-reads (offsets the broker no longer has, e.g. deleted by
retention) is accepted and counted, so the partition cannot wedge.

A hole at a partition's end has no later message to show it: the SIGKILL test also saw
the last envelope of a partition never handed over, the group's lag stuck at 1.
:meth:`PartitionContinuity.stalled` names the partitions whose end is past the next
expected offset while none of their messages came for a while (the processor calls it
when idle) and :class:`loopwatch.processors.app.Processor` reads them again from there.
"A while" is counted from the first check that saw the partition's messages waiting,
and in the processor's idle time only (:meth:`~PartitionContinuity.busy`,
:meth:`~PartitionContinuity.idle`). Counted from the partition's last message, and
in wall time, it named partitions whose next messages were merely on their way: the
first message after a quiet spell of 5 s (the bench's alert phase: 4 of its 5 sample
runs were read again, 21 duplicates each), and every partition with messages waiting
after a batch that took more than 5 s to fold and store, during which the processor
takes none. The copies were counted duplicates, never stored twice.

>>> seen = PartitionContinuity()
>>> seen.admit([(0, 10), (1, 4), (0, 11)])
([(0, 10), (1, 4), (0, 11)], {})
>>> seen.admit([(1, 5), (0, 13), (0, 14), (1, 6)])
([(1, 5), (1, 6)], {0: 12})
>>> seen.admit([(0, 14)])  # a message fetched before the seek: kept back again
([], {0: 12})
>>> seen.admit([(0, 12), (0, 13), (0, 14)])
([(0, 12), (0, 13), (0, 14)], {})
>>> seen.admit([(0, 7)])  # read again from further back (a rebalance): not a hole
([(0, 7)], {})
>>> (seen.holes_found, seen.holes_accepted)
(1, 0)
>>> now = [100.0]
>>> tail = PartitionContinuity(clock=lambda: now[0])
>>> tail.admit([(3, 25), (3, 26)])
([(3, 25), (3, 26)], {})
>>> tail.stalled({3: 28}, quiet_s=5.0)  # 27 exists, but it has only just been missed
{}
>>> now[0] += 5.0
>>> tail.stalled({3: 28}, quiet_s=5.0)
{3: 27}
>>> tail.stalled({3: 28}, quiet_s=5.0)  # read again: wait as long before the next try
{}
>>> tail.stalled({3: 27}, quiet_s=0.0)  # at its end: nothing missing
{}
>>> tail.admit([(3, 27)])
([(3, 27)], {})
>>> now[0] += 60.0  # a quiet minute, then 28..29 are written
>>> tail.stalled({3: 30}, quiet_s=5.0)  # on their way: waiting from now on
{}
>>> tail.busy(); now[0] += 8.0; tail.idle()  # a batch took 8 s: no message was taken
>>> now[0] += 4.0
>>> tail.stalled({3: 30}, quiet_s=5.0)  # 4 s idle, not 12 s quiet
{}
>>> now[0] += 1.0
>>> tail.stalled({3: 30}, quiet_s=5.0)
{3: 28}
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

log = logging.getLogger(__name__)

#: re-reads of one hole before it is accepted; messages fetched before a seek may still
#: arrive after it (each costs one attempt), so this is generous
MAX_ATTEMPTS = 100

Position = tuple[int, int]
"""(partition, offset) of a message."""


class PartitionContinuity:
    """The next offset expected on each partition, and the holes being read again."""

    def __init__(self, max_attempts: int = MAX_ATTEMPTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_attempts = max_attempts
        self._clock = clock
        self._next: dict[int, int] = {}
        #: since when (the clock, and the processor's :meth:`busy_seconds`) each partition
        #: has been seen with messages past its next expected offset
        self._waiting: dict[int, tuple[float, float]] = {}
        #: seconds the processor had a batch in hand, in total, and since when it has one
        self._busy_s = 0.0
        self._busy_from: float | None = None
        self._attempts: dict[Position, int] = {}
        #: holes seen (each counted once), and holes given up on after ``max_attempts``
        self.holes_found = 0
        self.holes_accepted = 0
        #: times a partition's end was read again after it stalled
        self.stalls = 0

    def counts(self) -> dict[str, int]:
        """What was read again, for the processor's status: holes found (each once),
        holes given up on, and partitions read again at their end after a stall."""
        return {"holes": self.holes_found, "holes_accepted": self.holes_accepted,
                "stalls": self.stalls}

    def busy(self) -> None:
        """The processor took a batch: it takes no more messages until it is stored."""
        if self._busy_from is None:
            self._busy_from = self._clock()

    def idle(self) -> None:
        """Every batch the processor took is stored: it is waiting for messages again."""
        if self._busy_from is not None:
            self._busy_s += self._clock() - self._busy_from
            self._busy_from = None

    def busy_seconds(self) -> float:
        """Seconds the processor has had a batch in hand, in total, up to now."""
        ongoing = 0.0 if self._busy_from is None else self._clock() - self._busy_from
        return self._busy_s + ongoing

    def admit(self, positions: Iterable[Position]) -> tuple[list[Position], dict[int, int]]:
        """The positions to process now, in order, and ``{partition: offset}`` to read
        again from. A partition with a hole has none of its later positions admitted."""
        admitted: list[Position] = []
        reread: dict[int, int] = {}
        for partition, offset in positions:
            if partition in reread:
                continue
            expected = self._next.get(partition)
            if expected is not None and offset > expected:
                hole = (partition, expected)
                attempts = self._attempts.get(hole, 0)
                if attempts < self.max_attempts:
                    if attempts == 0:
                        self.holes_found += 1
                        log.warning("events partition %d delivered offset %d after %d: "
                                    "reading it again from %d", partition, offset,
                                    expected - 1, expected)
                    self._attempts[hole] = attempts + 1
                    reread[partition] = expected
                    continue
                self.holes_accepted += 1
                log.error("events partition %d: offsets %d..%d still missing after %d "
                          "re-reads; going on without them", partition, expected,
                          offset - 1, attempts)
            self._next[partition] = offset + 1
            self._waiting.pop(partition, None)
            if self._attempts:
                self._attempts = {hole: n for hole, n in self._attempts.items()
                                  if hole[0] != partition or hole[1] > offset}
            admitted.append((partition, offset))
        return admitted, reread

    def stalled(self, ends: Mapping[int, int], quiet_s: float) -> dict[int, int]:
        """``{partition: next expected offset}`` for each partition whose end offset
        (``ends``: the next offset the broker will write) has been past the next
        expected one, with none of those messages coming, for ``quiet_s`` of the
        processor's idle time, counted from the first call that saw them waiting (a
        message just written is still on its way: counting from the partition's last
        message instead named every message that came after a quiet spell); each is
        counted as read again from there, and not named again for another ``quiet_s``."""
        now = self._clock()
        busy = self.busy_seconds()
        stalled: dict[int, int] = {}
        for partition, expected in self._next.items():
            if ends.get(partition, 0) <= expected:
                self._waiting.pop(partition, None)
                continue
            since, busy_then = self._waiting.setdefault(partition, (now, busy))
            if (now - since) - (busy - busy_then) >= quiet_s:
                stalled[partition] = expected
        for partition, expected in stalled.items():
            self._waiting[partition] = (now, busy)
            self.stalls += 1
            log.warning("events partition %d has messages from %d to %d but none came for "
                        "%.0f s: reading it again from %d", partition, expected,
                        ends[partition] - 1, quiet_s, expected)
        return stalled

    def forget(self, partitions: Iterable[int]) -> None:
        """Partitions this worker no longer reads: whoever reads them next starts from the
        group's committed offset, which may be past what was seen here."""
        for partition in partitions:
            self._next.pop(partition, None)
            self._waiting.pop(partition, None)
            self._attempts = {hole: n for hole, n in self._attempts.items()
                              if hole[0] != partition}
