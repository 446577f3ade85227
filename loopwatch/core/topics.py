"""Create loopwatch's topics if they are missing (embedded broker or a real cluster)."""

from __future__ import annotations

import contextlib
import time

from kafka import KafkaConsumer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from loopwatch.core.config import Settings


def ensure_topics(bootstrap: str, settings: Settings, timeout_s: float | None = None) -> None:
    wanted = {settings.events_topic: settings.partitions, settings.deadletter_topic: 1,
              settings.captures_topic: settings.partitions}
    deadline = time.monotonic() + (settings.broker_wait_s if timeout_s is None else timeout_s)
    while True:
        try:
            left_ms = int((deadline - time.monotonic()) * 1000)
            admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","),
                                     client_id="loopwatch-admin",
                                     bootstrap_timeout_ms=max(100, left_ms))
            break
        except KafkaError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    try:
        existing = set(admin.list_topics())
        missing = [NewTopic(name, partitions, 1) for name, partitions in wanted.items()
                   if name not in existing]
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):
                admin.create_topics(missing)
    finally:
        admin.close()


class LagProbe:
    """How far a consumer group's committed offsets trail the end of its topics."""

    def __init__(self, bootstrap: str, group: str, *topics: str) -> None:
        self._group = group
        self._topics = topics
        servers = bootstrap.split(",")
        self._admin = KafkaAdminClient(bootstrap_servers=servers, client_id="loopwatch-lag")
        self._consumer = KafkaConsumer(bootstrap_servers=servers, client_id="loopwatch-lag")

    def lag(self) -> int:
        """Messages not yet committed, summed over every topic."""
        self._consumer.topics()  # refreshes metadata; a new client knows no partitions yet
        topic_partitions: list[TopicPartition] = []
        for topic in self._topics:
            partitions = self._consumer.partitions_for_topic(topic) or set()
            if not partitions:
                raise RuntimeError(f"topic {topic} has no partitions (yet)")
            topic_partitions += [TopicPartition(topic, p) for p in partitions]
        ends = self._consumer.end_offsets(topic_partitions)
        committed = self._admin.list_group_offsets(
            {self._group: topic_partitions}).get(self._group, {})
        return sum(
            max(0, end - max(0, committed[tp].offset if tp in committed else 0))
            for tp, end in ends.items()
        )

    def close(self) -> None:
        self._consumer.close()
        self._admin.close()
