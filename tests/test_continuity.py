"""The stall check's quiet time is the processor's idle time (processors/continuity.py):
a batch that took longer than ``quiet_s`` to fold and store must not make the
partitions it did not deliver look stalled, and a partition that really stopped
delivering must still be read again once the processor has waited that long for it."""

from __future__ import annotations

from loopwatch.processors.continuity import PartitionContinuity

QUIET_S = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_long_batch_is_not_quiet_time() -> None:
    clock = Clock()
    seen = PartitionContinuity(clock=clock)
    seen.busy()
    assert seen.admit([(0, 10), (1, 20)]) == ([(0, 10), (1, 20)], {})
    clock.now += 3.0
    seen.busy()  # the next batch is taken while the first one's writes are in flight
    assert seen.admit([(0, 11)]) == ([(0, 11)], {})
    clock.now += 9.0
    seen.idle()  # both stored 12 s after the first was taken
    assert seen.busy_seconds() == 12.0
    clock.now += 1.0
    # partition 1 has 21..24 waiting, unseen for 13 s of which 1 s idle: not stalled
    assert seen.stalled({0: 12, 1: 25}, QUIET_S) == {}
    clock.now += 3.9
    assert seen.stalled({0: 12, 1: 25}, QUIET_S) == {}
    clock.now += 0.1
    assert seen.stalled({0: 12, 1: 25}, QUIET_S) == {1: 21}
    assert seen.stalls == 1


def test_idle_stretches_between_batches_add_up_for_a_partition_that_stopped() -> None:
    """Partition 1 stops delivering while partition 0 keeps the processor busy half of
    the time: it is read again once its idle stretches add up to ``quiet_s``."""
    clock = Clock()
    seen = PartitionContinuity(clock=clock)
    seen.busy()
    seen.admit([(0, 0), (1, 0)])
    clock.now += 1.0
    seen.idle()
    named = []
    offset = 1
    for _ in range(10):  # each cycle: 1 s idle, then a 1 s batch of partition 0 alone
        clock.now += 1.0
        named.append(seen.stalled({0: offset + 1, 1: 5}, QUIET_S))
        seen.busy()
        seen.admit([(0, offset)])
        offset += 1
        clock.now += 1.0
        seen.idle()
    assert named == [{}, {}, {}, {}, {1: 1}, {}, {}, {}, {}, {1: 1}]


def test_a_partition_given_up_is_forgotten_with_its_busy_mark() -> None:
    clock = Clock()
    seen = PartitionContinuity(clock=clock)
    seen.admit([(2, 7)])
    seen.forget([2])
    clock.now += 60.0
    assert seen.stalled({2: 9}, QUIET_S) == {}
