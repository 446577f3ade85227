"""Build the detector engine from settings: which notifiers, which policy, which rules."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
from loopwatch.detectors.engine import DetectorEngine, Policy
from loopwatch.detectors.notify import AlertmanagerNotifier, Notifier, WebhookNotifier
from loopwatch.detectors.outbox import Outbox
from loopwatch.detectors.rules import load_rules, with_overrides
from loopwatch.store.clickhouse import run_query
from loopwatch.store.sink import ClickHouseSink, RowBatch


def notifiers(settings: Settings) -> dict[str, Notifier]:
    """Alertmanager when configured; otherwise loopwatch's own notifiers, if any."""
    if settings.alertmanager_url:
        return {"alertmanager": AlertmanagerNotifier(
            settings.alertmanager_url,
            resolve_timeout=timedelta(seconds=settings.alertmanager_resend_s * 5))}
    found: dict[str, Notifier] = {}
    if settings.webhook_url:
        found["webhook"] = WebhookNotifier(settings.webhook_url, settings.webhook_secret)
    if settings.slack_webhook_url:
        found["slack"] = WebhookNotifier(settings.slack_webhook_url, format="slack", name="slack")
    if settings.pagerduty_url:
        found["pagerduty"] = WebhookNotifier(settings.pagerduty_url, format="pagerduty",
                                             name="pagerduty",
                                             routing_key=settings.pagerduty_routing_key)
    return found


def build_engine(settings: Settings, reader: Client, writer: Client) -> DetectorEngine:
    lock = threading.Lock()

    def query(sql: str, parameters: dict[str, Any]) -> Any:
        with lock:
            return run_query(reader, sql, parameters, readonly=True)

    def write(table: str, rows: list[dict[str, Any]]) -> None:
        ClickHouseSink(writer).write_batch(RowBatch({table: rows}))

    policy = Policy(
        via_alertmanager=bool(settings.alertmanager_url),
        resend=timedelta(seconds=settings.alertmanager_resend_s),
        renotify=timedelta(seconds=settings.renotify_s),
        silences=list(settings.silences),
        tool_criticality=dict(settings.tool_criticality),
        daily_budget_usd=dict(settings.daily_budget_usd),
        link_base_url=settings.link_base_url,
        max_clock_skew=timedelta(seconds=settings.max_clock_skew_s),
        excluded_slices=settings.alert_excluded_slices,
    )
    outbox = Outbox(settings.outbox_path, notifiers(settings))
    rules = with_overrides(load_rules(), settings.rule_overrides)
    return DetectorEngine(query, write, outbox, rules, policy)


def start_detectors(settings: Settings, reader: Client, writer: Client,
                    stop: threading.Event) -> DetectorEngine:
    """Run the engine on a daemon thread until ``stop`` is set."""
    from loopwatch.detectors.advisors.alerting import start_advisors

    engine = build_engine(settings, reader, writer)
    delay_s = settings.detect_start_delay_s
    threading.Thread(target=engine.run, args=(stop, settings.detect_interval_s, delay_s),
                     name="detectors", daemon=True).start()
    start_advisors(engine.query, engine.write, settings.advise,
                   timedelta(seconds=settings.max_clock_skew_s), stop, delay_s)
    return engine
