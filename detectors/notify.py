"""Where alerts go: Alertmanager's v2 API, or loopwatch's own webhook notifiers.

Each notifier turns a batch of notifications into one HTTP request and raises on any
non-2xx answer; retrying is the outbox's job (:mod:`loopwatch.detectors.outbox`), so a notifier
that is down loses nothing. Webhook bodies are signed: ``X-Loopwatch-Signature:
sha256=<hex>`` is HMAC-SHA256 over ``<X-Loopwatch-Timestamp>.<body>`` with the shared
secret (see :func:`verify_signature`).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol

import orjson

from loopwatch.core.masking import mask_secrets, safe_url

Format = Literal["generic", "slack", "pagerduty"]


class DeliveryError(RuntimeError):
    """The receiver did not accept the notification (it will be retried)."""


class Notifier(Protocol):
    name: str

    def deliver(self, notifications: list[dict[str, Any]]) -> None:
        """Send one batch; raise :class:`DeliveryError` unless the receiver accepted it."""


def _post(url: str, body: bytes, headers: dict[str, str], timeout_s: float = 10.0) -> None:
    shown = safe_url(url)  # a webhook URL's path or user info is often the credential
    try:
        request = urllib.request.Request(url, data=body, method="POST",
                                         headers={"Content-Type": "application/json",
                                                  **headers})
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            if not 200 <= response.status < 300:
                raise DeliveryError(f"{shown} answered {response.status}")
    except urllib.error.HTTPError as exc:
        answer = mask_secrets(repr(exc.read()[:200]), [url])
        raise DeliveryError(f"{shown} answered {exc.code}: {answer}") from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        raise DeliveryError(f"{shown} unreachable: {mask_secrets(str(exc), [url])}") from None


def sign(secret: str, timestamp: str, body: bytes) -> str:
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + digest.hexdigest()


def verify_signature(secret: str, timestamp: str, body: bytes, signature: str,
                     max_age_s: float = 300.0, now: float | None = None) -> bool:
    """What a receiver does: constant-time compare, and refuse stale timestamps.

    >>> body = b'{"alerts": []}'
    >>> verify_signature("s3cret", "1700000000", body, sign("s3cret", "1700000000", body),
    ...                  now=1700000010)
    True
    >>> verify_signature("other", "1700000000", body, sign("s3cret", "1700000000", body),
    ...                  now=1700000010)
    False
    """
    current = time.time() if now is None else now
    if abs(current - float(timestamp)) > max_age_s:
        return False
    return hmac.compare_digest(sign(secret, timestamp, body), signature)


@dataclass
class AlertmanagerNotifier:
    """Posts to Alertmanager's ``/api/v2/alerts``; its routing, grouping, inhibition and
    silences then apply. Firing alerts are re-posted (``resend``) so Alertmanager keeps
    them active; a resolved alert is posted with ``endsAt``."""

    url: str
    name: str = "alertmanager"
    resolve_timeout: timedelta = timedelta(minutes=5)

    def deliver(self, notifications: list[dict[str, Any]]) -> None:
        body = orjson.dumps([self._alert(n) for n in notifications])
        _post(self.url.rstrip("/") + "/api/v2/alerts", body, {})

    def _alert(self, notification: dict[str, Any]) -> dict[str, Any]:
        alert = notification["alert"]
        labels = {"alertname": alert["rule"], "severity": alert["severity"],
                  "fingerprint": alert["fingerprint"], **alert["labels"]}
        annotations = {"summary": alert["summary"], "playbook": alert["playbook"],
                       "value": f"{alert['value']:g}",
                       "evidence": orjson.dumps(alert.get("evidence", {}),
                                                default=str).decode()[:8000]}
        body: dict[str, Any] = {"labels": labels, "annotations": annotations,
                                "startsAt": alert["started_at"], "generatorURL": alert["link"]}
        if notification["status"] == "resolved":
            body["endsAt"] = alert["resolved_at"]
        else:
            ends = datetime.now(UTC) + self.resolve_timeout
            body["endsAt"] = ends.isoformat()
        return body


@dataclass
class WebhookNotifier:
    """loopwatch's own delivery: a generic signed webhook, or Slack / PagerDuty format."""

    url: str
    secret: str = ""
    format: Format = "generic"
    name: str = "webhook"
    routing_key: str = ""

    def deliver(self, notifications: list[dict[str, Any]]) -> None:
        if self.format == "pagerduty":
            for notification in notifications:  # the Events API takes one event per call
                self._send(self._pagerduty(notification))
            return
        payload = self._slack(notifications) if self.format == "slack" else {
            "version": 1, "alerts": notifications}
        self._send(payload)

    def _send(self, payload: dict[str, Any]) -> None:
        body = orjson.dumps(payload, default=str)
        headers = {}
        if self.secret:
            timestamp = str(int(time.time()))
            headers = {"X-Loopwatch-Timestamp": timestamp,
                       "X-Loopwatch-Signature": sign(self.secret, timestamp, body)}
        _post(self.url, body, headers)

    @staticmethod
    def _slack(notifications: list[dict[str, Any]]) -> dict[str, Any]:
        lines = []
        for notification in notifications:
            alert = notification["alert"]
            icon = {"critical": ":rotating_light:", "warning": ":warning:"}.get(
                alert["severity"], ":information_source:")
            status = "RESOLVED" if notification["status"] == "resolved" else "FIRING"
            lines.append(f"{icon} *[{status}] {alert['rule']}* ({alert['severity']}): "
                         f"{alert['summary']}  playbook: `{alert['playbook']}`"
                         + (f"  <{alert['link']}|drill down>" if alert["link"] else ""))
        return {"text": "\n".join(lines)}

    def _pagerduty(self, notification: dict[str, Any]) -> dict[str, Any]:
        alert = notification["alert"]
        severity = {"critical": "critical", "warning": "warning"}.get(alert["severity"], "info")
        return {
            "routing_key": self.routing_key,
            "event_action": "resolve" if notification["status"] == "resolved" else "trigger",
            "dedup_key": alert["fingerprint"],
            "payload": {"summary": alert["summary"][:1024], "source": "loopwatch",
                        "severity": severity, "component": alert["labels"].get("agent", ""),
                        "group": alert["rule"],
                        "custom_details": {"labels": alert["labels"],
                                           "playbook": alert["playbook"],
                                           "evidence": alert.get("evidence", {})}},
            "links": [{"href": alert["link"], "text": "run drill-down"}] if alert["link"] else [],
        }
