"""``loopwatch status``: is ``up`` running on this data dir, and how is it doing.

Everything comes from what a running ``up`` already publishes: its store service's
announcement (``service.json``: store, broker bootstrap, OTLP URL), the broker's
(``broker.json``, when ``up`` started the embedded one), the service's health (the
processors' counters), and the store (the sampled consumer lag, dead letters, alerts).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from loopwatch.core.config import Settings
from loopwatch.ingest.announce import read_announcement
from loopwatch.store.reader import ServiceReader, running_service


class NotRunning(RuntimeError):
    """No ``up`` runs on the data dir: a runtime error (exit 1)."""


#: the newest sampled consumer lag (``up`` samples it every 15 s)
LAG_SQL = """
SELECT value, toString(ts) FROM pipeline_gauges
WHERE name = 'consumer_lag' ORDER BY ts DESC LIMIT 1
"""
DEAD_LETTERS_SQL = "SELECT count(), countIf(replayed_at IS NULL) FROM dead_letters FINAL"
FIRING_SQL = """
SELECT rule, severity, summary FROM alerts FINAL WHERE state = 'firing' ORDER BY rule
"""


def gather(settings: Settings) -> dict[str, Any]:
    """The status as a dict (what ``--json`` prints); :class:`NotRunning` if no up."""
    announced = running_service(settings)
    if announced is None:
        raise NotRunning(f"no `loopwatch up` runs on {settings.data_dir}; start one with "
                         f"`loopwatch up --data-dir {settings.data_dir}`")
    service = ServiceReader(announced["url"])
    health = service.health()
    broker = read_announcement(settings.data_dir)
    lag = service.query(LAG_SQL).rows
    total, pending = service.query(DEAD_LETTERS_SQL).rows[0]
    firing = service.query(FIRING_SQL).records()
    return {
        "data_dir": str(settings.data_dir),
        "pid": announced.get("pid"),
        "store": announced.get("store"),
        "service": announced["url"],
        "kafka_bootstrap": announced.get("kafka_bootstrap"),
        "events_topic": announced.get("events_topic"),
        "embedded_broker": bool(announced.get("embedded_broker")),
        "broker": asdict(broker) if broker is not None else None,
        "otlp_url": announced.get("otlp_url"),
        "caught_up": bool(health.get("caught_up")),
        "consumer_lag": {"messages": int(lag[0][0]), "sampled_at": lag[0][1]} if lag else None,
        "counters": health.get("counters", {}),
        "store_retries": health.get("sink_failures"),
        "broker_retries": health.get("kafka_write_retries"),
        "rereads": health.get("rereads", {}),
        "dead_letters": {"total": int(total), "not_replayed": int(pending)},
        "alerts_firing": firing,
    }


def lines(status: dict[str, Any]) -> list[str]:
    """The status for a person, one fact a line."""
    counters = status["counters"]
    broker = status["broker"]
    lag = status["consumer_lag"]
    behind = ("caught up" if status["caught_up"] else "catching up") + (
        f", consumer lag {lag['messages']} messages at {lag['sampled_at']}" if lag else "")
    out = [
        f"up: running, pid {status['pid']}, data dir {status['data_dir']}",
        f"store: {status['store']}  (service {status['service']})",
        f"broker: {status['kafka_bootstrap']}  topic {status['events_topic']}"
        + (f"  (embedded, pid {broker['pid']}, incarnation {broker['incarnation']})"
           if broker else "  (embedded)" if status["embedded_broker"] else ""),
        f"OTLP/HTTP: {status['otlp_url']}/v1/traces" if status["otlp_url"]
        else "OTLP/HTTP: not running (its port was taken: see the up log)",
        f"web view: not part of up: `loopwatch serve --data-dir {status['data_dir']}`",
        f"processors: {behind}; events {counters.get('events', 0)}, runs closed "
        f"{counters.get('runs_closed', 0)}, store retries {status['store_retries']}, "
        f"broker retries {status['broker_retries']}, partitions read again "
        f"{sum(status['rereads'].get(kind, 0) for kind in ('holes', 'stalls'))}",
        f"dead letters: {status['dead_letters']['total']} "
        f"({status['dead_letters']['not_replayed']} not replayed)",
        f"alerts firing: {len(status['alerts_firing'])}",
    ]
    out += [f"  {a['severity']}  {a['rule']}: {a['summary']}" for a in status["alerts_firing"]]
    return out
