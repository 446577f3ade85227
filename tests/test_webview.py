"""The built-in web view: its JSON API on the seeded in-process store, its HTTP server,
and the page itself in headless Chromium.

The browser is Debian's ``/usr/bin/chromium`` driven by ``/usr/bin/chromedriver``
through Selenium (nothing is downloaded at test time). The browser test asserts that
every panel of each tier loads without error, that each chart drew a canvas with data
points, that the firing alerts carry their playbooks, that the run drill-down shows the
loop, and that the console stayed free of errors; it saves screenshots under the
test's temporary directory.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from email.message import Message  # headers by any case: uvicorn sends lower case
from pathlib import Path
from typing import Any

import orjson
import pytest

from loopwatch.dashboards.panels import OUTCOME_COLORS, panels_of
from loopwatch.dashboards.sample import ensure_seeded
from loopwatch.dashboards.web.api import BadRequest, NotFound, WebApi
from loopwatch.dashboards.web.server import make_server, serve_in_thread
from loopwatch.store.reader import DirectReader
from tests.browser import chromium
from tests.conftest import ServiceLikeReader, wait_for


@pytest.fixture(scope="module")
def seeded(local_store):
    settings, client = local_store
    return DirectReader(client), ensure_seeded(client, settings)


@pytest.fixture(scope="module")
def api(seeded):
    return WebApi(seeded[0])


@pytest.fixture(scope="module")
def server(seeded):
    url, stop = serve_in_thread(seeded[0])
    yield url
    stop()


# --- the JSON the page draws from -------------------------------------------------------


def test_time_series_come_back_pivoted_like_the_plugin_does(api):
    body = api.panel("outcome_mix", {})
    assert body["viz"] == "bars" and body["x"] == sorted(body["x"]) and body["interval_s"] == 60
    names = {series["name"] for series in body["series"]}
    assert names <= set(OUTCOME_COLORS) and "success" in names
    for series in body["series"]:
        assert len(series["values"]) == len(body["x"])
        assert series["color"] == OUTCOME_COLORS[series["name"]]
    split = api.panel("llm_errors_by_provider", {})
    assert {s["name"] for s in split["series"]} >= {
        "error rate (excl. 429) · anthropic", "429 rate · openai"}


def test_parameters_are_checked_and_values_stay_data(api):
    with pytest.raises(BadRequest):
        api.panel("outcome_mix", {"from": ["yesterday"]})
    with pytest.raises(BadRequest):
        api.panel("outcome_mix", {"from": ["2000"], "to": ["1000"]})
    with pytest.raises(BadRequest):
        api.panel("run_timeline", {})
    with pytest.raises(NotFound):
        api.panel("no_such_panel", {})
    assert api.panel("problem_runs", {"agent": ["x' OR 1=1 --"]})["rows"] == []
    only = api.panel("problem_runs", {"agent": ["support-bot"]})["rows"]
    assert only and {row[1] for row in only} == {"support-bot"}


def test_alerts_come_with_their_playbooks(api, seeded):
    # the sample's loop run (a session over 20 minutes seeds a second sample beside it)
    loops = [alert for alert in api.alerts({})["alerts"] if alert["rule"] == "loop_detected"
             and alert["run_id"] == seeded[1]]
    assert len(loops) == 1
    loop = loops[0]
    assert loop["severity"] == "critical"
    assert loop["playbook_detail"]["title"] and loop["playbook_detail"]["steps"]


def test_run_drilldown_shows_the_loop(api, seeded):
    body = api.run(seeded[1], {})
    summary = body["panels"]["run_summary"]
    assert dict(zip(summary["columns"], summary["rows"][0], strict=True))["outcome"] == "looped"
    repeated = body["panels"]["run_repeated_args"]
    assert repeated["rows"][0][2] == 3
    timeline = body["panels"]["run_timeline"]
    assert {row[1] for row in timeline["rows"]} >= {"run.start", "llm.call", "tool.call", "run.end"}
    with pytest.raises(NotFound):
        api.run("no-such-run", {})


def get(url: str) -> tuple[int, Message, bytes]:
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(url, timeout=30) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def test_http_endpoints(server, seeded):
    status, headers, body = get(f"{server}api/panels")
    assert status == 200 and "default-src 'self'" in headers["Content-Security-Policy"]
    catalog = json.loads(body)
    assert [tier["id"] for tier in catalog["tiers"]] == ["realtime", "trends", "drilldown"]
    status, _, body = get(f"{server}api/panel/cost_per_minute")
    assert status == 200 and json.loads(body)["series"]
    assert get(f"{server}api/panel/nope")[0] == 404
    status, _, body = get(f"{server}api/health")
    assert (status, json.loads(body)) == (200, {"ok": True, "store": "ok"})
    assert get(f"{server}api/panel/outcome_mix?from=abc")[0] == 400
    assert get(f"{server}static/../server.py")[0] == 404
    assert get(f"{server}static/%2e%2e/server.py")[0] == 404
    status, headers, _ = get(f"{server}runs/{seeded[1]}")
    assert status == 302 and headers["Location"] == f"/#/run/{seeded[1]}"
    status, headers, body = get(f"{server}static/vendor/uplot/uPlot.iife.min.js")
    assert status == 200 and body.startswith(b"/*! https://github.com/leeoniya/uPlot (v1.6.32)")


def raw_get(server: str, path: str, host: str | None = None) -> tuple[int, Message, bytes]:
    """GET ``path`` exactly as written (no client-side normalising), with this ``Host``."""
    port = int(server.rstrip("/").rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", f"127.0.0.1:{port}" if host is None else host)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


FOREIGN_HOSTS = ["attacker.example:{port}", "attacker.example", "127.0.0.1.attacker.example",
                 "localhost.attacker.example:{port}", "[::2]:{port}", "127.0.0.2", "",
                 "localhost:{port}:{port}", "0.0.0.0:{port}"]
OWN_HOSTS = ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST", "[::1]:{port}", "127.0.0.1"]


def test_a_foreign_host_is_refused_in_one_line_so_dns_rebinding_reads_nothing(
        server, captured_loop):
    """A page on attacker.example that rebinds its name to 127.0.0.1 sends its own name
    in Host: refused with 421 and one line naming the setting, before any data is read;
    the server's own names are served."""
    loop_run, _ = captured_loop
    port = server.rstrip("/").rsplit(":", 1)[1]
    for host in FOREIGN_HOSTS:
        status, headers, body = raw_get(server, f"/api/replay/{loop_run}",
                                        host.format(port=port))
        assert (status, headers["Content-Type"]) == (421, "text/plain; charset=utf-8"), host
        assert body.endswith(b"; allow it with LOOPWATCH_HTTP_ALLOWED_HOSTS\n"), body
        assert body.count(b"\n") == 1 and b"search again" not in body
        assert "default-src 'self'" in headers["Content-Security-Policy"]
        assert raw_get(server, "/", host.format(port=port))[0] == 421
    for host in OWN_HOSTS:
        status, _, body = raw_get(server, f"/api/replay/{loop_run}", host.format(port=port))
        assert status == 200 and b"search again" in body, host
    assert raw_get(server, "/", "attacker.example")[2] == (
        b"Host 'attacker.example' is not a name of this loopwatch server; "
        b"allow it with LOOPWATCH_HTTP_ALLOWED_HOSTS\n")


def test_allowed_hosts_come_from_the_settings(seeded, monkeypatch):
    monkeypatch.setenv("LOOPWATCH_HTTP_ALLOWED_HOSTS", "loopwatch.internal, Ops.Example")
    url, stop = serve_in_thread(seeded[0])
    try:
        assert [raw_get(url, "/api/health", host)[0] for host in (
            "loopwatch.internal:80", "ops.example", "attacker.example", "127.0.0.1")] == [
            200, 200, 421, 200]
    finally:
        stop()
    monkeypatch.setenv("LOOPWATCH_HTTP_ALLOWED_HOSTS", "*")
    url, stop = serve_in_thread(seeded[0])
    try:
        assert raw_get(url, "/api/health", "attacker.example")[0] == 200
    finally:
        stop()


def test_idle_connections_cannot_fill_the_web_view(seeded, monkeypatch):
    """Four connections that never send a byte fill a 4-connection web view: the next
    visitor closes the longest-waiting one and is served (deadline far away, so it is
    the cap at work, not the deadline)."""
    monkeypatch.setenv("LOOPWATCH_WEB_MAX_CONNECTIONS", "4")
    monkeypatch.setenv("LOOPWATCH_HTTP_HEADER_TIMEOUT_S", "600")
    server = make_server(seeded[0], port=0)
    server.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    idle = [socket.create_connection(("127.0.0.1", server.server_address[1]))
            for _ in range(4)]
    try:
        wait_for(lambda: server.connection_states()["awaiting_headers"] == 4, 60,
                 what="4 idle connections held")
        assert raw_get(url, "/api/health")[:3:2] == (200, b'{"ok":true,"store":"ok"}')
        assert server.stats.evicted == 1
        assert idle[0].recv(1) == b""  # the oldest was closed; the others are held
        wait_for(lambda: server.connection_states() == {"awaiting_headers": 3}, 60,
                 what="the 3 other idle connections, and no more, still open")
    finally:
        for sock in idle:
            sock.close()
        server.stop()


STATIC_TRICKS = [
    "/static/%00index.html", "/%00", "/static/index.html%00.js", "/static/app.js%00",
    "/static/../server.py", "/static/%2e%2e/server.py", "/static/..%2fserver.py",
    "/static/%2e%2e%2fserver.py", "/static/%252e%252e/server.py", "/static/.%2e/api.py",
    "/../../../../etc/passwd", "/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
    "/static//etc/passwd", "/static/%2fetc%2fpasswd", "//etc/passwd", "/etc/passwd",
    "/static/vendor/../../api.py", "/static/vendor/uplot/../../../server.py",
    "/static/..\\server.py", "/static/%5c..%5cserver.py", "/static/%E2%80%A5/server.py",
    "/proc/self/environ", "/static/outside.txt", "/outside.txt", "/static/inside-dir/",
    "/static/vendor/", "/static/%ff", "/static/" + "a" * 5000,
]


def test_static_path_tricks_are_404_and_never_a_file_outside_static(seeded, server, tmp_path):
    """NUL bytes, dot segments raw or percent-encoded (once or twice), absolute paths,
    backslashes and a symlink out of the static directory: 404, never a 500 and never a
    byte of a file outside it."""
    for path in ("/static/%00index.html", "/static/%2e%2e/server.py", "/%2e%2e/server.py",
                 "/static/%2e%2e/api.py"):  # the real static/, next to the modules
        status, _, body = raw_get(server, path)
        assert status == 404 and b"import" not in body, path
    static = tmp_path / "static"
    static.mkdir()
    (static / "index.html").write_text("<!doctype html><p>inside")
    (static / "inside-dir").mkdir()
    (tmp_path / "outside.txt").write_text("OUTSIDE-SECRET")
    (static / "outside.txt").symlink_to(tmp_path / "outside.txt")
    for name in ("server.py", "api.py"):
        (tmp_path / name).write_text("OUTSIDE-SECRET")
    url, stop = serve_in_thread(seeded[0], static=static)
    try:
        answers = {path: raw_get(url, path) for path in STATIC_TRICKS}
        assert {path: status for path, (status, _, _) in answers.items()} == dict.fromkeys(
            STATIC_TRICKS, 404)
        for _status, _, body in answers.values():
            assert b"OUTSIDE-SECRET" not in body and b"root:" not in body
        assert raw_get(url, "/")[2] == b"<!doctype html><p>inside"
    finally:
        stop()


# --- the page in a real browser ------------------------------------------------------------


@pytest.fixture()
def browser(tmp_path):
    with chromium(tmp_path / "chromium-profile", console_log=True) as driver:
        yield driver


def settle(driver: Any, expected: int) -> list[dict[str, Any]]:
    """Wait until ``expected`` panels are on the page and none is still loading."""
    from selenium.webdriver.support.ui import WebDriverWait

    script = """return [...document.querySelectorAll('[data-panel]')].map(el => ({
        id: el.dataset.panel, viz: el.dataset.viz, state: el.dataset.state,
        points: Number(el.dataset.points || 0),
        canvas: el.querySelector('.uplot canvas') !== null,
        inked: (() => { const c = el.querySelector('.uplot canvas'); if (!c) return 0;
                        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
                        return n; })()}))"""
    WebDriverWait(driver, 60, poll_frequency=0.3).until(
        lambda d: (lambda panels: len(panels) == expected
                   and all(p["state"] != "loading" for p in panels))(d.execute_script(script)))
    return list(driver.execute_script(script))


def console_errors(driver: Any) -> list[dict[str, Any]]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def shoot(driver: Any, path: Path) -> None:
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1440, min(int(height) + 200, 5000))
    driver.save_screenshot(str(path))
    driver.set_window_size(1440, 900)
    assert path.stat().st_size > 20_000


def assert_drawn(panels: list[dict[str, Any]]) -> None:
    assert [p["id"] for p in panels if p["state"] == "error"] == []
    for panel in panels:
        assert panel["state"] == "ready", panel
        if panel["viz"] in ("timeseries", "bars", "barchart"):
            assert panel["canvas"] and panel["points"] > 0, panel
            assert panel["inked"] > 2000, panel  # lines and bars, not only axes


def test_page_renders_live_charts_alerts_and_the_drilldown(server, browser, seeded, tmp_path):
    browser.get(f"{server}#/realtime")
    panels = settle(browser, len(panels_of("realtime")))
    assert_drawn(panels)
    alerts = browser.execute_script(
        "return [...document.querySelectorAll('.alert')].map(a => a.dataset.rule)")
    assert "loop_detected" in alerts and "timeout_near_miss" in alerts
    assert browser.execute_script("return document.querySelectorAll('.ann-marker').length") > 0
    assert "firing" in browser.find_element("id", "status").text
    shoot(browser, tmp_path / "webview-realtime.png")

    card = browser.find_element("css selector", ".alert[data-rule='loop_detected']")
    card.find_element("xpath", ".//button[starts-with(., 'Playbook')]").click()
    assert "Playbook:" in card.find_element("css selector", ".playbook").text
    card.find_element("css selector", "a").click()
    drill = settle(browser, sum(1 for p in panels_of("drilldown")
                                if p.needs_run and p.id != "run_summary"))
    assert_drawn(drill)
    assert seeded[1] in browser.find_element("id", "run-title").text
    assert "looped" in browser.find_element("id", "run-kv").text
    hot = browser.execute_script(
        "return document.querySelectorAll('[data-panel=run_timeline] tr.hot').length")
    assert hot == 3
    shoot(browser, tmp_path / "webview-run.png")

    browser.get(f"{server}#/trends")
    assert_drawn(settle(browser, len(panels_of("trends"))))
    shoot(browser, tmp_path / "webview-trends.png")
    assert console_errors(browser) == []


def rounded(value: Any) -> Any:
    """Floats to 10 significant digits: parallel aggregation may sum in any order."""
    if isinstance(value, float):
        return float(f"{value:.10g}")
    if isinstance(value, list | tuple):
        return [rounded(item) for item in value]
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    return value


def test_results_through_the_store_service_read_the_same(seeded):
    direct, service = WebApi(seeded[0]), WebApi(ServiceLikeReader(seeded[0]))
    params = {"to": [str(int(time.time() * 1000))]}
    for panel in ("cost_per_minute", "problem_runs", "firing_alerts"):
        assert rounded(service.panel(panel, params)) == rounded(direct.panel(panel, params))
    assert rounded(service.run(seeded[1], params)) == rounded(direct.run(seeded[1], params))
    times = [row[-1] for row in direct.panel("problem_runs", params)["rows"]]
    assert times and all(value.endswith("Z") for value in times)


# --- replay and trace economics in the run drill-down ----------------------------------------


@pytest.fixture(scope="module")
def captured_loop(seeded, local_store):
    """The seeded looping run with captured bodies (kept), inserted as docs/capture.md
    lays them out; returns the run id and what its steps must show."""
    from loopwatch.ingest.capture import build_capture_message
    from tests.captured import all_parts_rows, insert_rows

    reader, loop_run = seeded
    _, client = local_store
    calls = reader.query(
        "SELECT toString(event_id), event_type, JSONExtract(payload, 'step', 'Int64'), "
        "JSONExtractString(payload, 'tool'), agent FROM events FINAL "
        "WHERE run_id = {r:String} AND event_type IN ('llm.call', 'tool.call')",
        {"r": loop_run}).rows
    now = datetime.now(UTC)
    messages = []
    for event_id, event_type, step, tool, agent in calls:
        values = ({"prompt": [{"role": "system", "content": "You research markets."},
                              {"role": "user", "content": f"step {step}: search again"}],
                   "response": f"Searching once more (step {step})."}
                  if event_type == "llm.call" else
                  {"args": {"query": "same-query"}, "output": {"hits": [], "step": step}})
        messages.append(build_capture_message(
            event_id=event_id, run_id=loop_run, agent=agent, ts=now.isoformat(),
            event_type=event_type, step=step, tool=tool or None, values=values))
    parts, blobs = all_parts_rows(messages, now, "kept_at")
    insert_rows(client, "capture_parts", parts)
    insert_rows(client, "capture_blobs", blobs)
    insert_rows(client, "capture_decisions", [{
        "run_id": loop_run, "agent": calls[0][4], "outcome": "looped", "keep": 1,
        "reason": "failure:looped", "parts": len(parts),
        "bytes": sum(part["bytes"] for part in parts), "decided_at": now}])
    return loop_run, len(calls)


def test_replay_and_economics_endpoints(api, captured_loop, server):
    loop_run, steps = captured_loop
    body = api.replay(loop_run)
    assert body["run_id"] == loop_run and body["outcome"] == "looped"
    assert body["capture"]["status"] == "kept" and len(body["steps"]) == steps
    assert body["command"] == f"loopwatch replay {loop_run}"
    first_tool = next(step for step in body["steps"] if step["type"] == "tool")
    assert first_tool["args"] == {"query": "same-query"}
    assert first_tool["output"] == {"hits": [], "step": first_tool["step"]}
    with pytest.raises(NotFound):
        api.replay("no-such-run")
    status, _, raw = get(f"{server}api/replay/{loop_run}")
    assert status == 200 and json.loads(raw)["steps"] == json.loads(orjson.dumps(body))["steps"]
    assert get(f"{server}api/replay/no-such-run")[0] == 404
    status, _, raw = get(f"{server}api/economics?agent={body['agent']}")
    economics = json.loads(raw)
    assert status == 200 and economics["runs"] > 0 and economics["failure_modes"]
    assert get(f"{server}api/economics")[0] == 400


def test_the_drilldown_shows_the_replay_and_the_trace_economics(server, browser, captured_loop,
                                                                tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    loop_run, steps = captured_loop
    browser.get(f"{server}#/replay/{loop_run}")
    state = "return [document.getElementById('replay'), document.getElementById('economics')]" \
            ".map(el => el ? el.dataset.state : 'absent')"
    WebDriverWait(browser, 60, poll_frequency=0.3).until(
        lambda d: d.execute_script(state) == ["ready", "ready"])
    replay = browser.find_element("id", "replay")
    assert int(replay.get_attribute("data-steps")) == steps
    cards = replay.find_elements("css selector", ".replay-step")
    assert len(cards) == steps
    assert "capture kept" in replay.text and f"loopwatch replay {loop_run}" in replay.text
    first_llm = replay.find_element("css selector", ".replay-step[data-type=llm]")
    prompt = first_llm.find_element("css selector", "pre[data-part=prompt]").text
    assert prompt.startswith("system: You research markets.\nuser: step ")
    tool_card = replay.find_element("css selector", ".replay-step[data-type=tool]")
    assert '"query": "same-query"' in tool_card.text
    economics = browser.find_element("id", "economics")
    assert int(economics.get_attribute("data-modes")) > 0
    assert economics.find_elements("css selector", "tr[data-outcome=looped]")
    assert "reproduction tax" in economics.text
    shoot(browser, tmp_path / "webview-replay.png")
    assert console_errors(browser) == []
