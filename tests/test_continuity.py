"""The stall check's quiet time (processors/continuity.py): counted from the first check
that saw a partition's messages waiting, in the processor's idle time only. A message
that arrives after a quiet spell, or waits while a long batch is folded and stored, is
on its way, not stalled; a partition that really stops delivering is still read again
once the processor has waited ``quiet_s`` for it."""

from __future__ import annotations

from loopwatch.processors.continuity import PartitionContinuity

QUIET_S = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_first_message_after_a_quiet_spell_is_on_its_way() -> None:
    """The bench's alert phase: a partition quiet for a minute gets one message; the
    checks of the next seconds see it waiting while faust hands it over."""
    clock = Clock()
    seen = PartitionContinuity(clock=clock)
    seen.admit([(3, 79)])
    clock.now += 60.0
    named = []
    for _ in range(3):  # written; one second per timer tick until it is taken
        named.append(seen.stalled({3: 81}, QUIET_S))
        clock.now += 1.0
    assert seen.admit([(3, 80)]) == ([(3, 80)], {})
    clock.now += 60.0
    named.append(seen.stalled({3: 81}, QUIET_S))  # nothing waits: nothing named
    assert named == [{}, {}, {}, {}]
    assert seen.stalls == 0


def test_a_long_batch_is_not_quiet_time() -> None:
    clock = Clock()
    seen = PartitionContinuity(clock=clock)
    seen.busy()
    assert seen.admit([(0, 10), (1, 20)]) == ([(0, 10), (1, 20)], {})
    assert seen.stalled({0: 11, 1: 25}, QUIET_S) == {}  # 21..24 seen waiting
    clock.now += 3.0
    seen.busy()  # the next batch is taken while the first one's writes are in flight
    assert seen.admit([(0, 11)]) == ([(0, 11)], {})
    clock.now += 9.0
    seen.idle()  # both stored 12 s after the first was taken
    assert seen.busy_seconds() == 12.0
    clock.now += 4.9
    assert seen.stalled({0: 12, 1: 25}, QUIET_S) == {}  # 16.9 s waiting, 4.9 s idle
    clock.now += 0.1
    assert seen.stalled({0: 12, 1: 25}, QUIET_S) == {1: 21}
    assert seen.stalls == 1


def test_idle_stretches_add_up_for_a_partition_that_stopped() -> None:
    """Partition 1 stops delivering while partition 0 keeps the processor busy half of
    the time: it is read again once its idle stretches add up to ``quiet_s``, and again
    after as long if it still delivers nothing."""
    clock = Clock()
    seen = PartitionContinuity(clock=clock)
    seen.busy()
    seen.admit([(0, 0), (1, 0)])
    clock.now += 1.0
    seen.idle()
    named = []
    offset = 1
    for _ in range(12):  # each cycle: 1 s idle, then a 1 s batch of partition 0 alone
        clock.now += 1.0
        named.append(seen.stalled({0: offset + 1, 1: 5}, QUIET_S))
        seen.busy()
        seen.admit([(0, offset)])
        offset += 1
        clock.now += 1.0
        seen.idle()
    assert named == [{}, {}, {}, {}, {}, {1: 1}, {}, {}, {}, {}, {1: 1}, {}]


def test_a_partition_given_up_is_forgotten_with_its_wait() -> None:
    clock = Clock()
    seen = PartitionContinuity(clock=clock)
    seen.admit([(2, 7)])
    assert seen.stalled({2: 9}, QUIET_S) == {}
    seen.forget([2])
    clock.now += 60.0
    assert seen.stalled({2: 9}, QUIET_S) == {}
