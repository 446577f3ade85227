"""Security: bearer tokens on the web view, loopback by default, secrets kept out of logs
and error messages, user SQL read-only. (The OTLP receiver's token is tested in
tests/test_otlp.py::test_bearer_token_auth; ``loopwatch query`` refusing DROP in
tests/test_cli.py.)"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from collections.abc import Iterator
from email.message import Message  # headers by any case: uvicorn sends lower case
from pathlib import Path

import pytest

from loopwatch.core.config import Settings
from loopwatch.core.embedded.broker import free_port
from loopwatch.core.masking import mask_secrets, safe_url, secret_values
from loopwatch.dashboards.web.server import COOKIE, make_server, serve_in_thread
from loopwatch.detectors.notify import DeliveryError, WebhookNotifier
from loopwatch.detectors.outbox import Outbox
from loopwatch.ingest.otlp.settings import OtlpSettings
from loopwatch.store.clickhouse import connect
from loopwatch.store.reader import DirectReader, QueryError

TOKEN = "web-t0ken-5ecret"
NOTIFICATIONS = [{"status": "firing", "alert": {"rule": "r", "severity": "warning"}}]
SECRET = "s3cr3t-b1t"


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return None


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Message, bytes]:
    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


@pytest.fixture(scope="module")
def guarded(local_store) -> Iterator[str]:
    url, stop = serve_in_thread(DirectReader(local_store[1]), token=TOKEN)
    yield url.rstrip("/")
    stop()


def test_web_view_without_the_token_answers_401_for_api_pages_and_static_files(guarded):
    for path in ("/api/panels", "/api/health", "/", "/index.html", "/runs/r1"):
        status, headers, body = get(guarded + path)
        assert status == 401, path
        assert headers["WWW-Authenticate"] == 'Bearer realm="loopwatch"'
        assert TOKEN.encode() not in body
    assert get(guarded + "/api/panels")[2] == b'{"error":"missing or wrong bearer token"}'
    assert b"?token=" in get(guarded + "/")[2]  # the page says how to get in
    assert get(guarded + "/api/panels", {"Authorization": "Bearer nope"})[0] == 401
    assert get(guarded + "/api/panels", {"Cookie": f"{COOKIE}=nope"})[0] == 401
    assert get(guarded + "/?token=nope")[0] == 401


def test_web_view_with_the_token_as_bearer_cookie_or_once_in_the_address(guarded):
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert get(guarded + "/api/health", bearer)[:3:2] == (200, b'{"ok":true,"store":"ok"}')
    assert get(guarded + "/", bearer)[0] == 200
    status, headers, _ = get(guarded + f"/?token={TOKEN}&x=1")
    assert (status, headers["Location"]) == (302, "/?x=1")
    cookie = headers["Set-Cookie"]
    assert cookie == f"{COOKIE}={TOKEN}; HttpOnly; SameSite=Strict; Path=/"
    assert get(guarded + "/api/panels", {"Cookie": cookie.split(";")[0]})[0] == 200


def test_web_view_reads_its_token_from_the_settings(local_store, monkeypatch):
    """``loopwatch serve`` and the demo start the page without a token argument: the
    ``web_token`` setting (here LOOPWATCH_WEB_TOKEN) applies."""
    monkeypatch.setenv("LOOPWATCH_WEB_TOKEN", TOKEN)
    url, stop = serve_in_thread(DirectReader(local_store[1]))
    try:
        assert get(url + "api/health")[0] == 401
        assert get(url + "api/health", {"Authorization": f"Bearer {TOKEN}"})[0] == 200
    finally:
        stop()


def test_web_view_otlp_receiver_and_store_service_bind_loopback_by_default(local_store):
    server = make_server(DirectReader(local_store[1]), port=0, token="")
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.server_close()
    assert OtlpSettings().host == "127.0.0.1"


# -- secrets ----------------------------------------------------------------------------

def test_a_notifier_failure_never_shows_the_webhook_secret(tmp_path: Path, caplog):
    """The Slack-style webhook URL (secret path, user:password, token query) and the HMAC
    key never reach the error, the outbox's log line or its saved last_error."""
    url = (f"http://user:{SECRET}@127.0.0.1:{free_port()}/services/T0/B0/{SECRET}"
           f"?token={SECRET}")
    notifier = WebhookNotifier(url, secret=SECRET, format="generic", name="slack")
    with pytest.raises(DeliveryError) as refused:
        notifier.deliver(NOTIFICATIONS)
    assert SECRET not in str(refused.value)
    assert refused.value.__cause__ is None and refused.value.__context__ is not None
    assert str(refused.value).startswith("http://127.0.0.1:")
    outbox = Outbox(tmp_path / "outbox.jsonl", {"slack": notifier})
    outbox.put(NOTIFICATIONS)
    with caplog.at_level(logging.WARNING):
        assert outbox.flush() == 0
    assert "notifier slack" in caplog.text and SECRET not in caplog.text
    assert SECRET not in (tmp_path / "outbox.jsonl").read_text()


def test_a_malformed_webhook_url_is_a_delivery_error_without_the_url():
    with pytest.raises(DeliveryError) as refused:
        WebhookNotifier(f"hooks.example.com/{SECRET}").deliver(NOTIFICATIONS)
    assert SECRET not in str(refused.value)


def test_the_clickhouse_password_is_masked_where_the_store_is_announced():
    url = f"https://loopwatch:{SECRET}@ch.example.com:8443/loopwatch"
    assert safe_url(url) == "https://ch.example.com:8443/…"
    settings = Settings(clickhouse_url=url, webhook_secret="hmac-" + SECRET,
                        pagerduty_routing_key="rk-" + SECRET, web_token=TOKEN)
    text = f"connect {url} failed; key rk-{SECRET}; token {TOKEN}; hmac hmac-{SECRET}"
    masked = mask_secrets(text, secret_values(settings))
    assert SECRET not in masked and TOKEN not in masked
    assert masked == "connect https://ch.example.com:8443/… failed; key ***; token ***; hmac ***"


def test_settings_repr_hides_secrets():
    settings = Settings(clickhouse_url=f"https://u:{SECRET}@ch:8443", webhook_secret=SECRET,
                        web_token=SECRET)
    assert SECRET not in repr(settings) and SECRET not in str(settings)


def test_a_rejected_clickhouse_url_does_not_echo_its_password():
    with pytest.raises(ValueError) as refused:
        Settings(clickhouse_url=f"clickhouse://u:{SECRET}@ch:9000")
    assert SECRET not in str(refused.value)


# -- user SQL is read-only ----------------------------------------------------------------

@pytest.mark.parametrize("sql", [
    "INSERT INTO runs (run_id, agent) VALUES ('x', 'intruder')",
    "ALTER TABLE runs DELETE WHERE 1",
    "ALTER TABLE events DROP PARTITION ID '202601'",
    "CREATE TABLE intruder (x UInt8) ENGINE = Memory",
    "SET readonly = 0",
])
def test_user_sql_cannot_change_data_through_the_service_or_a_direct_reader(
        sql, reader, local_store):
    """``loopwatch query`` and the web view read through these two readers; both run
    with ClickHouse ``readonly=1`` (test_cli.py covers DROP through the CLI)."""
    before = reader.query("SELECT count() FROM runs").scalar()
    # its own client: a refused write can leave `readonly` stuck on a chdb client, and
    # the session's shared one must keep writing for the tests that follow
    for user_reader in (reader, DirectReader(connect(local_store[0]))):
        with pytest.raises(QueryError) as refused:
            user_reader.query(sql)
        assert "readonly" in str(refused.value).lower() or "read only" in str(
            refused.value).lower() or "cannot" in str(refused.value).lower()
    assert reader.query("SELECT count() FROM runs").scalar() >= before
    assert reader.query("SELECT count() FROM runs WHERE agent = 'intruder'").scalar() == 0
