"""The web view's Advice page in headless Chromium: each finding with its chart (the
cost(T) curve with today's T and the optimum marked) or its kappa confusion matrix,
drawn from what ``/api/advice`` returns (``loopwatch advise --json``).

The scenario traffic of one agent is folded by the real pipeline core into the shared
in-process chdb store; what is drawn is read from uPlot itself (the wrapper of
tests/test_webview_charts.py), never from pixels.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from loopwatch.dashboards.web.server import serve_in_thread
from loopwatch.scenarios.scorecard import Simulation
from loopwatch.store.reader import DirectReader
from tests.advisor_traffic import behaviour_of, scenario_events
from tests.browser import chromium
from tests.conftest import ServiceLikeReader
from tests.test_webview_charts import CAPTURE_PLOTS

CARD_STATE = """
const cards = Array.from(document.querySelectorAll('.advice-card'));
return cards.map((card) => {
  const plots = window.__plots.filter((p) => card.contains(p.root));
  const u = plots.length ? plots[plots.length - 1] : null;
  return {kind: card.dataset.kind, agent: card.dataset.agent, subject: card.dataset.subject,
          text: card.querySelector('.recommendation').textContent,
          x: u ? Array.from(u.data[0]) : null,
          ys: u ? u.data.slice(1).map((ys) => Array.from(ys)) : null,
          cells: Array.from(card.querySelectorAll('table.confusion td'))
            .map((td) => td.textContent)};
});
"""


@pytest.fixture(scope="module")
def advised(local_store) -> str:
    """An agent whose tools time out too early and whose judge passes everything."""
    settings, client = local_store
    agent = f"advice-{uuid.uuid4().hex[:8]}"
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=3)
    events = [*scenario_events(agent, behaviour_of("timeout_too_low"), start, hours=1),
              *scenario_events(agent, replace(behaviour_of("judge_always_pass"),
                                              tool_timeout_ms=330.0),
                               start + timedelta(hours=1), hours=1, seed=9)]
    Simulation(client, settings, seed=1).feed(events, start + timedelta(hours=2, minutes=10))
    return agent


@pytest.fixture(scope="module")
def server(local_store) -> Iterator[str]:
    url, stop = serve_in_thread(ServiceLikeReader(DirectReader(local_store[1])))
    yield url
    stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with chromium(tmp_path_factory.mktemp("chromium-advice")) as driver:
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                               {"source": CAPTURE_PLOTS})
        yield driver


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_advice_page_draws_each_finding_with_its_chart(browser, server, advised):
    from selenium.webdriver.support.ui import WebDriverWait

    status, api = _get(f"{server}api/advice?agent={advised}")
    assert status == 200
    findings = {(f["kind"], f["subject"]): f for f in api["findings"]}
    assert set(findings) == {("timeout", "search"), ("timeout", "fetch"),
                             ("timeout", "lookup"), ("judge_agreement", "judge")}
    browser.get("about:blank")
    browser.get(f"{server}#/advice?range=now-1h&agent={advised}")
    WebDriverWait(browser, 120, poll_frequency=0.3).until(lambda d: d.execute_script(
        "const b = document.getElementById('advice'); return b && b.dataset.state === 'ready'"))
    cards = {(c["kind"], c["subject"]): c for c in browser.execute_script(CARD_STATE)}
    assert set(cards) == set(findings)
    for tool in ("search", "fetch", "lookup"):
        card, finding = cards[("timeout", tool)], findings[("timeout", tool)]
        evidence = finding["evidence"]
        assert card["agent"] == advised and card["text"] == finding["recommendation"]
        curve = evidence["cost_curve"]
        assert card["x"] == [point[0] for point in curve]
        cost, today, best = card["ys"]
        assert cost == [point[1] for point in curve]
        assert [x for x, y in zip(card["x"], today, strict=True) if y is not None] == [
            evidence["timeout_ms"]]
        assert [x for x, y in zip(card["x"], best, strict=True) if y is not None] == [
            evidence["recommended_timeout_ms"]]
        assert min(cost) == best[card["x"].index(evidence["recommended_timeout_ms"])]
    judge = findings[("judge_agreement", "judge")]["evidence"]["confusion"]
    assert cards[("judge_agreement", "judge")]["cells"] == [
        str(judge["judge_pass"]["human_pass"]), str(judge["judge_pass"]["human_fail"]),
        str(judge["judge_fail"]["human_pass"]), str(judge["judge_fail"]["human_fail"])]


def test_the_advice_endpoint_refuses_an_over_long_agent(server):
    status, body = _get(f"{server}api/advice?agent={'a' * 300}")
    assert status == 400 and "at most 256" in body["error"]
