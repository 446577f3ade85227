"""Keep secrets out of logs and error messages.

Secrets reach loopwatch only through settings (environment, ``LOOPWATCH_CONFIG_FILE``):
the ClickHouse password inside ``LOOPWATCH_CLICKHOUSE_URL``, ``webhook_secret``, the
Slack webhook URL (its path is the credential), ``pagerduty_routing_key``, the web and
OTLP bearer tokens. Anything that puts a URL or a settings value into a log line or an
exception goes through :func:`safe_url` or :func:`mask_secrets` first.

>>> safe_url("https://user:pw@hooks.example.com:8443/services/T0/B0/XXXX?token=abc")
'https://hooks.example.com:8443/…'
>>> safe_url("http://127.0.0.1:9093")
'http://127.0.0.1:9093'
>>> mask_secrets("POST https://hooks.slack.com/services/T0/B0/s3cr3t failed: key s3cr3t",
...              ["s3cr3t"])
'POST https://hooks.slack.com/… failed: key ***'
>>> mask_secrets("refused (http://127.0.0.1:9)")
'refused (http://127.0.0.1:9)'
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

MASK = "***"
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")


def safe_url(url: str | None) -> str:
    """``scheme://host[:port]`` of ``url``: no user, password, path, query or fragment
    (a Slack webhook's path, a token in a query, basic auth are all credentials)."""
    if not url:
        return ""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return MASK
    if not parts.scheme or not host:
        return MASK
    shown = f"{parts.scheme}://{host}{port}"
    rest = parts.path not in ("", "/") or parts.query or parts.fragment
    return shown + "/…" if rest else shown


def _safe_match(match: re.Match[str]) -> str:
    """A URL found in text, cut; punctuation that closes the sentence around it, as in
    ``(http://host:9)``, stays outside it."""
    url = match[0]
    core = url.rstrip(").,;:]}")
    return safe_url(core) + url[len(core):]


def safe_address(address: str) -> str:
    """A Kafka ``host:port`` as given, without credentials: a ``user:password@`` part
    (which Kafka does not take, but a user may paste from a URL) becomes ``***@``, and a
    URL is cut by :func:`safe_url`.

    >>> safe_address("user:pw@broker:9092"), safe_address("kafka://u:p@b:9092/x")
    ('***@broker:9092', 'kafka://b:9092/…')
    >>> safe_address("broker:9092")
    'broker:9092'
    """
    if "://" in address:
        return safe_url(address)
    _user, at, host = address.rpartition("@")
    return f"{MASK}@{host}" if at else address


def secret_values(settings: Any) -> list[str]:
    """The secret strings a settings object carries (loopwatch or OTLP settings)."""
    values: list[str] = []
    for name in ("webhook_secret", "pagerduty_routing_key", "web_token", "token",
                 "slack_webhook_url", "webhook_url", "pagerduty_url", "alertmanager_url",
                 "clickhouse_url"):
        value = getattr(settings, name, None)
        if not value:
            continue
        value = str(value)
        values.append(value)
        if "://" in value:
            try:
                password = urlsplit(value).password
            except ValueError:
                password = None
            if password:
                values.append(password)
    return values


def mask_secrets(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every URL cut to :func:`safe_url` and every secret replaced by ***.
    Secrets shorter than 4 characters are not replaced (they would mask ordinary text)."""
    for secret in sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True):
        if "://" not in secret:
            text = text.replace(secret, MASK)
    text = _URL.sub(_safe_match, text)
    for secret in secrets:
        if len(secret) >= 4 and "://" in secret:
            text = text.replace(secret, MASK)
    return text
