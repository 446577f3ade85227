"""Alerts reach people: through a real Alertmanager from the running pipeline, and through
loopwatch's own signed webhooks (dedup, grouping, re-notify, silences, retries)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from loopwatch.detectors.engine import DetectorEngine, Policy
from loopwatch.detectors.notify import WebhookNotifier, verify_signature
from loopwatch.detectors.outbox import Outbox
from loopwatch.ingest.events import RunEnd
from loopwatch.ingest.sdk import RunContext
from loopwatch.store.sink import ClickHouseSink, FaultInjectingSink, RowBatch
from tests.conftest import wait_for
from tests.receivers import Receiver
from tests.test_rules import NOW, Fleet, engine

SECRET = "s3cret-for-tests"


def alerts_for(receiver: Receiver, agent: str, status: str) -> list[dict[str, Any]]:
    found = []
    for request in receiver.requests:
        if request["path"] != "/alertmanager":
            continue
        for alert in request["json"]["alerts"]:
            if alert["labels"].get("agent") == agent and alert["status"] == status:
                found.append(alert)
    return found


def test_stuck_run_pages_through_a_real_alertmanager_and_resolves(
        pipeline, emitter, alert_receiver, agent):
    run = RunContext(emitter, uuid.uuid4().hex, {"agent": agent, "task_type": "qa"})
    run.start()
    for _ in range(22):
        run.step()
    emitter.flush()
    firing = wait_for(lambda: alerts_for(alert_receiver, agent, "firing"), 90,
                      what="the stuck_run alert to reach the Alertmanager webhook")
    alert = firing[0]
    assert alert["labels"]["alertname"] == "stuck_run"
    assert alert["labels"]["severity"] == "warning"
    assert alert["labels"]["run_id"] == run.run_id
    assert alert["annotations"]["playbook"] == "agent_stuck_in_loop"
    assert alert["annotations"]["summary"] == (
        f"run {run.run_id} of {agent} is still running after 22 steps")
    assert alert["generatorURL"] == f"http://loopwatch.local/runs/{run.run_id}"
    run.end("model_done")
    emitter.flush()
    wait_for(lambda: alerts_for(alert_receiver, agent, "resolved"), 120,
             what="the resolved notification")


def test_alerts_command_lists_the_history(pipeline, emitter, agent, reader):
    """The run declares a time cap (abandoned after 2 x 600 s, not the session's 6 s):
    under load the CLI child's start alone took longer than the 6 s, the sweep abandoned
    the quiet run, stuck_run resolved, and the listing showed it resolved. The listing's
    limit is wide for the same reason: firing alerts of the whole session come first."""
    run = RunContext(emitter, uuid.uuid4().hex, {"agent": agent, "time_cap_s": 600})
    run.start()
    for _ in range(21):
        run.step()
    emitter.flush()
    wait_for(lambda: reader.query("SELECT count() FROM alerts FINAL WHERE labels['agent'] = "
                                  "{a:String} AND state = 'firing'", {"a": agent}).scalar(),
             90, what="a firing alert in the history")
    try:
        listed = subprocess.run([sys.executable, "-m", "loopwatch.cli", "alerts", "--json",
                                 "--limit", "100000"],
                                env=pipeline.env, capture_output=True, text=True, timeout=120)
    finally:
        run.end("model_done")
        emitter.flush()
    assert listed.returncode == 0, listed.stderr
    mine = [a for a in orjson.loads(listed.stdout) if a["labels"].get("agent") == agent]
    assert [(a["rule"], a["state"], a["playbook"]) for a in mine] == [
        ("stuck_run", "firing", "agent_stuck_in_loop")]


@pytest.fixture()
def hook() -> Any:
    receiver = Receiver()
    yield receiver
    receiver.close()


def own_engine(local_store: Any, tmp_path: Path, receiver: Receiver, **policy: Any
               ) -> DetectorEngine:
    detector = engine(local_store, Policy(**policy))
    detector.outbox = Outbox(tmp_path / "outbox.jsonl",
                             {"webhook": WebhookNotifier(receiver.url + "/hook", SECRET)},
                             max_backoff_s=0.0)
    return detector


def stuck_runs(local_store: Any, count: int) -> str:
    fleet = Fleet(local_store)
    agent = f"notify-{uuid.uuid4().hex[:8]}"
    for _ in range(count):
        fleet.run(agent, NOW - timedelta(minutes=1), steps=25, end=None)
    fleet.flush()
    return agent


def mine(receiver: Receiver, agent: str) -> list[dict[str, Any]]:
    return [request for request in receiver.requests
            if any(a["alert"]["labels"].get("agent") == agent for a in request["json"]["alerts"])]


def test_webhook_is_signed_grouped_and_deduplicated(local_store, tmp_path, hook):
    agent = stuck_runs(local_store, 2)
    detector = own_engine(local_store, tmp_path, hook)
    detector.evaluate(event_now=NOW, wall_now=NOW)
    requests = mine(hook, agent)
    assert len(requests) == 1  # two alerts of one rule and severity: one grouped request
    request = requests[0]
    assert {(a["alert"]["rule"], a["alert"]["severity"]) for a in request["json"]["alerts"]} == {
        ("stuck_run", "warning")}  # other tests' stuck runs in the shared store may join it
    assert len([a for a in request["json"]["alerts"]
                if a["alert"]["labels"]["agent"] == agent]) == 2
    headers = {key.lower(): value for key, value in request["headers"].items()}
    assert verify_signature(SECRET, headers["x-loopwatch-timestamp"], request["body"],
                            headers["x-loopwatch-signature"])
    assert not verify_signature("wrong", headers["x-loopwatch-timestamp"], request["body"],
                                headers["x-loopwatch-signature"])
    detector.evaluate(event_now=NOW, wall_now=NOW + timedelta(minutes=1))
    assert len(mine(hook, agent)) == 1  # still firing: no second page within renotify


def test_still_firing_alerts_renotify_after_the_interval(local_store, tmp_path, hook):
    agent = stuck_runs(local_store, 1)
    detector = own_engine(local_store, tmp_path, hook, renotify=timedelta(hours=1))
    detector.evaluate(event_now=NOW, wall_now=NOW)
    detector.evaluate(event_now=NOW, wall_now=NOW + timedelta(minutes=59))
    assert len(mine(hook, agent)) == 1
    detector.evaluate(event_now=NOW, wall_now=NOW + timedelta(minutes=61))
    assert len(mine(hook, agent)) == 2


def test_silenced_alerts_are_recorded_but_not_sent(local_store, tmp_path, hook):
    agent = stuck_runs(local_store, 1)
    until = (NOW + timedelta(hours=1)).isoformat()
    detector = own_engine(local_store, tmp_path, hook,
                          silences=[{"match": {"agent": agent}, "until": until}])
    fired = detector.evaluate(event_now=NOW, wall_now=NOW)
    assert [t.kind for t in fired if t.alert.labels.get("agent") == agent] == ["fired"]
    assert mine(hook, agent) == []


def test_a_receiver_that_is_down_gets_the_alert_once_it_is_back(local_store, tmp_path, hook):
    agent = stuck_runs(local_store, 1)
    hook.down = True
    detector = own_engine(local_store, tmp_path, hook)
    detector.evaluate(event_now=NOW, wall_now=NOW)
    assert detector.outbox is not None and detector.outbox.pending >= 1
    assert detector.outbox.failures >= 1
    # the process restarts: a new outbox on the same file still holds the notification
    reopened = Outbox(tmp_path / "outbox.jsonl",
                      {"webhook": WebhookNotifier(hook.url + "/hook", SECRET)}, max_backoff_s=0)
    assert reopened.pending == detector.outbox.pending
    hook.down = False
    reopened.flush()
    assert reopened.pending == 0
    assert len(mine(hook, agent)) == 1


def test_resolved_alerts_are_sent_once(local_store, tmp_path, hook):
    fleet = Fleet(local_store)
    agent = f"notify-{uuid.uuid4().hex[:8]}"
    run_id = fleet.run(agent, NOW - timedelta(minutes=1), steps=25, end=None)
    fleet.flush()
    detector = own_engine(local_store, tmp_path, hook)
    detector.evaluate(event_now=NOW, wall_now=NOW)
    fleet.add(RunEnd(ts=NOW + timedelta(minutes=1), run_id=run_id, agent=agent,
                     terminal_reason="model_done"))
    fleet.flush()
    detector.evaluate(event_now=NOW + timedelta(minutes=2), wall_now=NOW + timedelta(minutes=2))
    detector.evaluate(event_now=NOW + timedelta(minutes=3), wall_now=NOW + timedelta(minutes=3))
    statuses = [a["status"] for r in mine(hook, agent) for a in r["json"]["alerts"]]
    assert statuses == ["firing", "resolved"]


def test_slack_and_pagerduty_payloads(hook):
    alert = {"fingerprint": "f1", "rule": "tool_error_rate", "severity": "critical",
             "labels": {"agent": "a", "tool": "search"}, "summary": "search failed",
             "playbook": "upstream_tool_outage", "value": 0.8, "link": "http://x/runs/r",
             "evidence": {}, "started_at": datetime.now(UTC).isoformat(), "resolved_at": None}
    WebhookNotifier(hook.url + "/slack", format="slack").deliver(
        [{"status": "firing", "alert": alert}])
    WebhookNotifier(hook.url + "/pd", format="pagerduty", routing_key="rk").deliver(
        [{"status": "resolved", "alert": alert}])
    slack, pagerduty = (r["json"] for r in hook.requests)
    assert slack["text"] == (":rotating_light: *[FIRING] tool_error_rate* (critical): search "
                             "failed  playbook: `upstream_tool_outage`  <http://x/runs/r|drill "
                             "down>")
    assert (pagerduty["event_action"], pagerduty["dedup_key"], pagerduty["routing_key"]) == (
        "resolve", "f1", "rk")
    assert pagerduty["payload"]["severity"] == "critical"


def test_a_receiver_answering_garbage_is_a_delivery_failure_to_retry(tmp_path):
    """A receiver (or a proxy in front of it) that answers something other than HTTP made
    ``http.client`` raise an error the outbox did not expect, which escaped the detector
    loop's outbox flush and ended the detectors' thread: no alert after it. It is a
    delivery failure like any other, kept for the next attempt."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        def answer_garbage() -> None:
            connection, _ = server.accept()
            with connection:
                connection.recv(65536)
                connection.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")

        threading.Thread(target=answer_garbage, daemon=True).start()
        url = f"http://127.0.0.1:{server.getsockname()[1]}/hook"
        outbox = Outbox(tmp_path / "outbox.jsonl", {"webhook": WebhookNotifier(url, SECRET)},
                        max_backoff_s=0)
        outbox.put([{"alert": {"labels": {"agent": "garbage"}}}])
        assert outbox.flush() == 0
    assert (outbox.pending, outbox.failures) == (1, 1)


def test_a_refused_history_write_does_not_swallow_the_page(local_store, tmp_path, hook):
    """The pass that fires an alert writes its history (``rule_evaluations``,
    ``alerts``) and then notifies. A refused write (a ClickHouse server restarting)
    raised out of the pass after the alert book had marked the alert firing, so the
    next pass saw nothing new and nobody was ever paged. Now the page goes out at once
    and the history is written by the first pass after the store is back. chdb cannot
    be stopped on its own, so the refusal is injected at the sink (FaultInjectingSink,
    as the processors' store-outage test does)."""
    agent = stuck_runs(local_store, 1)
    _, client = local_store
    marker = tmp_path / "store-down"
    detector = own_engine(local_store, tmp_path, hook)
    refusing = FaultInjectingSink(ClickHouseSink(client), marker)
    detector.write = lambda table, rows: refusing.write_batch(RowBatch({table: rows}))

    def history() -> list[tuple[str, str]]:
        return [tuple(row) for row in client.query(
            "SELECT rule, state FROM alerts FINAL WHERE labels['agent'] = {a:String}",
            parameters={"a": agent}).result_rows]

    marker.touch()
    detector.evaluate(event_now=NOW, wall_now=NOW)
    assert len(mine(hook, agent)) == 1
    assert history() == []
    marker.unlink()
    detector.evaluate(event_now=NOW, wall_now=NOW + timedelta(minutes=1))
    assert len(mine(hook, agent)) == 1
    assert history() == [("stuck_run", "firing")]


def test_one_agent_with_a_clock_years_ahead_does_not_blind_event_time_rules(local_store):
    """Event-clock rules evaluate at event time, the newest stored ``ts``. The pipeline
    stores a far-future timestamp as sent (and keeps it out of its own watermark); the
    detectors took it as 'now', so every event-time window looked at an empty future:
    no alert fired, and firing ones resolved. Like the pipeline, they now ignore times
    more than ``max_clock_skew_s`` ahead of the wall clock."""
    fleet = Fleet(local_store)
    agent = f"clock-{uuid.uuid4().hex[:8]}"
    fleet.run(agent, datetime(2100, 1, 1, tzinfo=UTC))
    recent = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=30)
    fleet.run(agent, recent, steps=1)
    fleet.flush()
    detector = engine(local_store)  # the default skew, 5 minutes, as the settings
    now = detector.event_now()
    assert now is not None
    assert recent <= now <= datetime.now(UTC) + timedelta(minutes=5)


def test_a_pending_alert_restored_after_a_restart_still_fires(local_store):
    """A new detector process restores open alerts from the ``alerts`` table, whose
    times come back without a time zone, while a pass's 'now' has one: the first
    comparison (has the pending alert waited its for-duration?) raised, and every pass
    after a restart failed before any rule could fire or resolve. Restored times are
    UTC-aware now."""
    agent = stuck_runs(local_store, 1)
    overrides = [{"rule": "stuck_run", "match": {"agent": agent}, "for": "10m"}]
    first = engine(local_store, overrides=overrides)
    pending = [t for t in first.evaluate(event_now=NOW, wall_now=NOW)
               if t.alert.labels.get("agent") == agent]
    assert [t.kind for t in pending] == ["pending"]
    restarted = engine(local_store, overrides=overrides)
    assert pending[0].alert.fingerprint in restarted.book.open
    later = NOW + timedelta(minutes=11)
    fired = [t for t in restarted.evaluate(event_now=later, wall_now=later)
             if t.alert.labels.get("agent") == agent]
    assert [(t.kind, t.alert.started_at) for t in fired] == [("fired", NOW)]


def test_an_outbox_that_cannot_save_still_pages_and_the_history_is_written(
        local_store, tmp_path, hook):
    """The outbox saves each notification to disk before the first attempt. When it
    cannot (disk full; here its directory replaced by a file), the error left the pass
    before its history rows were queued, and they were lost. The notification is kept
    in memory and delivered, the failure is logged, and the history is written."""
    agent = stuck_runs(local_store, 1)
    detector = own_engine(local_store, tmp_path, hook)
    assert detector.outbox is not None
    spool = tmp_path / "outbox-dir"
    detector.outbox.path = spool / "outbox.jsonl"
    spool.write_text("not a directory")
    detector.evaluate(event_now=NOW, wall_now=NOW)
    assert len(mine(hook, agent)) == 1
    assert detector.outbox.pending == 0
    _, client = local_store
    assert client.query("SELECT rule, state FROM alerts FINAL WHERE labels['agent'] = "
                        "{a:String}", parameters={"a": agent}).result_rows == [
        ("stuck_run", "firing")]
