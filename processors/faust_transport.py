"""faust's aiokafka transport with the consumer's fetch wait set by the settings.

faust builds its worker consumer with ``fetch_max_wait_ms=1500`` and no setting to
change it. A Kafka broker answers a fetch as soon as a byte arrives
(``fetch_min_bytes=1``), so the wait only bounds an idle poll; the embedded broker
(Tansu) answers when its wait is over, so there every message that arrives while the
consumer is caught up waited for the rest of a fetch: an OTLP burst's last rows were
stored 1.25-1.28 s after its last request with 1500 ms, 0.72-0.74 s with 100 ms
(``python -m loopwatch.bench.otlp_burst``, two interleaved pairs). A shorter wait costs
an idle consumer a fetch request per wait, to its own broker.
"""

from __future__ import annotations

from typing import Any, ClassVar

import faust
from faust.transport.drivers import aiokafka as faust_aiokafka


class _ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    """faust's consumer thread, whose worker consumer waits ``fetch_max_wait_ms``."""

    fetch_max_wait_ms: ClassVar[int]

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # read once, when the consumer starts its fetcher; aiokafka has no setter
        consumer._fetch_max_wait_ms = self.fetch_max_wait_ms
        return consumer


def prompt_transport(app: faust.App, fetch_max_wait_ms: int) -> Any:
    """A transport for ``app`` (set as ``app.transport`` before anything uses it) whose
    consumer waits at most ``fetch_max_wait_ms`` for a fetch.

    >>> import asyncio
    >>> app = faust.App("doctest", broker="kafka://127.0.0.1:1", store="memory://")
    >>> app.transport = prompt_transport(app, 100)
    >>> async def fetch_wait() -> int:  # aiokafka builds a consumer on a running loop
    ...     thread = app.consumer._thread
    ...     return thread._create_worker_consumer(app.transport)._fetch_max_wait_ms
    >>> asyncio.run(fetch_wait())
    100
    """
    thread = type("ConsumerThread", (_ConsumerThread,),
                  {"fetch_max_wait_ms": fetch_max_wait_ms})

    class Consumer(faust_aiokafka.Consumer):
        def _new_consumer_thread(self) -> Any:
            return thread(self, loop=self.loop, beacon=self.beacon)

    class Transport(faust_aiokafka.Transport):
        pass

    Transport.Consumer = Consumer
    return Transport(app.conf.broker_consumer, app)
