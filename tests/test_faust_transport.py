"""The processors' faust consumer waits ``fetch_max_wait_ms`` for a fetch, not faust's
fixed 1500 ms, and keeps the rest of faust's consumer configuration.

No broker: aiokafka builds a consumer without connecting, on a running event loop. What
the wait is for (an OTLP burst's rows stored 1.25 s after its last request with faust's
wait on the embedded broker, 0.72 s with 100 ms) is a latency: it is measured by
``python -m loopwatch.bench.otlp_burst``, not asserted here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from loopwatch.core.config import Settings
from loopwatch.processors.app import Processor, faust_settings
from tests.conftest import DiscardSink


def _worker_consumer(processor: Processor) -> Any:
    async def built() -> Any:
        app = processor.app
        return app.consumer._thread._create_worker_consumer(app.transport)

    return asyncio.run(built())


def test_the_processors_consumer_waits_the_settings_fetch_wait(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, fetch_max_wait_ms=37, max_message_bytes=3_000_000)
    consumer = _worker_consumer(Processor(settings, "127.0.0.1:1", DiscardSink()))
    assert consumer._fetch_max_wait_ms == 37
    # faust's own configuration of its consumer is kept: the group, the fetch size the
    # processors ask for (twice the largest message), manual commits
    assert consumer._group_id == settings.consumer_group
    assert consumer._max_partition_fetch_bytes == 6_000_000 == faust_settings(
        settings, "127.0.0.1:1")["consumer_max_fetch_size"]
    assert consumer._enable_auto_commit is False
    assert Settings(data_dir=tmp_path).fetch_max_wait_ms == 100


@pytest.mark.parametrize("value", [0, -5, 60_001, "soon"])
def test_a_fetch_wait_that_cannot_work_is_refused(tmp_path: Path, value: object) -> None:
    with pytest.raises(ValidationError, match="fetch_max_wait_ms"):
        Settings(data_dir=tmp_path, fetch_max_wait_ms=value)
