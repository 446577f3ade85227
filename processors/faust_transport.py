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

from typing import Any

from faust.transport.drivers import aiokafka as faust_aiokafka


class _ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    """faust's consumer thread, whose worker consumer waits its transport's
    ``fetch_max_wait_ms``."""

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # read once, when the consumer starts its fetcher; aiokafka has no setter
        consumer._fetch_max_wait_ms = transport.fetch_max_wait_ms
        return consumer


class _Consumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> Any:
        return _ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class PromptTransport(faust_aiokafka.Transport):
    """faust's aiokafka transport (set as ``app.transport`` before anything uses it)
    whose consumer waits at most ``fetch_max_wait_ms`` for a fetch.

    >>> import asyncio, faust
    >>> app = faust.App("doctest", broker="kafka://127.0.0.1:1", store="memory://")
    >>> app.transport = PromptTransport(app.conf.broker_consumer, app, fetch_max_wait_ms=100)
    >>> async def fetch_wait() -> int:  # aiokafka builds a consumer on a running loop
    ...     thread = app.consumer._thread
    ...     return thread._create_worker_consumer(app.transport)._fetch_max_wait_ms
    >>> asyncio.run(fetch_wait())
    100
    """

    Consumer = _Consumer

    def __init__(self, url: Any, app: Any, fetch_max_wait_ms: int, **kwargs: Any) -> None:
        super().__init__(url, app, **kwargs)
        self.fetch_max_wait_ms = fetch_max_wait_ms
