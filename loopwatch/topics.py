"""Create loopwatch's topics if they are missing (embedded broker or a real cluster)."""

from __future__ import annotations

import contextlib
import time

from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from loopwatch.config import Settings


def ensure_topics(bootstrap: str, settings: Settings, timeout_s: float = 30.0) -> None:
    wanted = {settings.events_topic: settings.partitions, settings.deadletter_topic: 1}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","),
                                     client_id="loopwatch-admin")
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
