"""The web view's charts in headless Chromium with the data shapes that used to draw
wrong (issue 26, item 6): one bucket, gaps, no data, and the drill-down header of a run
that did not loop.

Each shape is its own agent's scripted events, folded by the real pipeline into the
shared in-process chdb store; the page is opened filtered to that agent. What is drawn
is read from uPlot itself (its data, the ticks it laid out, whether a series' points
were drawn), captured by wrapping the vendored ``uPlot`` before the page loads, never
from pixels.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from loopwatch.core.money import usd
from loopwatch.dashboards.web.server import serve_in_thread
from loopwatch.ingest.events import EventBase, LlmCall, RunEnd, RunStart, ToolCall
from loopwatch.ingest.wire import encode_envelope
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.store.reader import DirectReader
from loopwatch.store.sink import ClickHouseSink
from tests.browser import chromium
from tests.conftest import ServiceLikeReader

#: Wraps the global ``uPlot`` the vendored script defines so every chart the page makes
#: is kept in ``window.__plots`` (the page itself exposes nothing for tests).
CAPTURE_PLOTS = """
(() => {
  let real;
  window.__plots = [];
  Object.defineProperty(window, "uPlot", {
    configurable: true,
    get() { return real; },
    set(original) {
      const wrapped = function (opts, data, target) {
        const plot = new original(opts, data, target);
        window.__plots.push(plot);
        return plot;
      };
      Object.assign(wrapped, original);
      wrapped.prototype = original.prototype;
      real = wrapped;
    },
  });
})();
"""

#: What one panel's newest chart drew: its x values, series values, which series drew
#: points, the x scale, and the x axis's tick labels.
CHART_STATE = """
const panel = document.querySelector(`[data-panel="${arguments[0]}"]`);
const plots = window.__plots.filter((p) => panel.contains(p.root));
if (!plots.length) return {state: panel.dataset.state,
                           text: panel.querySelector('.panel-body').textContent,
                           canvas: panel.querySelector('canvas') !== null};
const u = plots[plots.length - 1];
return {state: panel.dataset.state, x: Array.from(u.data[0]),
        ys: u.data.slice(1).map((ys) => Array.from(ys)),
        points: u.series.slice(1).map((s) => s.points._paths != null),
        xmin: u.scales.x.min, xmax: u.scales.x.max, ticks: u.axes[0]._values};
"""


def minute(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


def _run(agent: str, run_id: str, calls: list[tuple[datetime, str]]) -> list[EventBase]:
    """One closed, successful run with an LLM call (or a timed-out tool call whose true
    duration is known) at each given time."""
    common = {"run_id": run_id, "agent": agent, "model": "gpt-4o"}
    first = min(at for at, _ in calls) - timedelta(seconds=5)
    events: list[EventBase] = [RunStart(ts=first, **common)]
    for at, kind in calls:
        if kind == "llm":
            events.append(LlmCall(ts=at, input_tokens=1000, output_tokens=100,
                                  cache_read_input_tokens=700, **common))
        else:
            events.append(ToolCall(ts=at, tool="slow_search", args_hash=uuid.uuid4().hex,
                                   latency_ms=500, timeout_ms=500, timed_out=True,
                                   late_completion_ms=550, **common))
    last = max(at for at, _ in calls) + timedelta(seconds=5)
    events.append(RunEnd(ts=last, terminal_reason="model_done", **common))
    return events


@pytest.fixture(scope="module")
def shapes(local_store) -> dict[str, Any]:
    """Agent per data shape, with its scripted runs stored; ``run`` is the one-bucket
    agent's run id, ``now`` the minute the shapes end by. Taken here, not at import:
    the charts show the last hour of the wall clock, and a module imported when the
    session was collected may run half an hour later."""
    settings, client = local_store
    now = minute(datetime.now(UTC))
    tag = uuid.uuid4().hex[:8]
    one, gaps, none = f"one-{tag}", f"gaps-{tag}", f"none-{tag}"
    at = now - timedelta(minutes=5) + timedelta(seconds=10)
    run_id = f"run-one-{tag}"
    events = _run(one, run_id, [(at, "llm"), (at + timedelta(seconds=5), "llm"),
                                (at + timedelta(seconds=10), "tool")])
    events += _run(gaps, f"run-gaps-{tag}", [
        (now - timedelta(minutes=30) + timedelta(seconds=20), "llm"),
        (now - timedelta(minutes=10) + timedelta(seconds=20), "llm"),
        (now - timedelta(minutes=9) + timedelta(seconds=20), "llm")])
    events.sort(key=lambda event: event.ts)
    clock = datetime.now(UTC).timestamp()
    pipeline = Pipeline(settings, MemoryRunStore(), clock=lambda: clock)
    sink = ClickHouseSink(client)
    sink.write_batch(pipeline.process([RawMessage("charts", 0, 0, encode_envelope(events))]).rows)
    return {"one": one, "gaps": gaps, "none": none, "run": run_id, "now": now}


@pytest.fixture(scope="module")
def server(local_store) -> Iterator[str]:
    url, stop = serve_in_thread(ServiceLikeReader(DirectReader(local_store[1])))
    yield url
    stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                               {"source": CAPTURE_PLOTS})
        yield driver


def _open(browser: Any, url: str, panels: list[str]) -> dict[str, dict[str, Any]]:
    """Open ``url`` and wait until each panel is drawn (ready, empty or failed)."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get("about:blank")
    browser.get(url)
    done = "return arguments[0].every((id) => { const el = document.querySelector(" \
           "`[data-panel=\"${id}\"]`); return el && el.dataset.state !== 'loading'; })"
    WebDriverWait(browser, 90, poll_frequency=0.3).until(
        lambda driver: driver.execute_script(done, panels))
    # the charts fit their legends on the next frame: let it pass
    browser.execute_script("return new Promise((r) => requestAnimationFrame(() => r()))")
    return {panel: browser.execute_script(CHART_STATE, panel) for panel in panels}


def test_a_single_bucket_draws_its_point_on_a_clock_axis(browser, server, shapes):
    charts = _open(browser, f"{server}#/realtime?range=now-1h&agent={shapes['one']}",
                   ["cache_hit_rate", "near_miss_ratio"])
    bucket = (shapes["now"] - timedelta(minutes=5)).timestamp()
    cache = charts["cache_hit_rate"]
    assert (cache["state"], cache["x"], cache["ys"], cache["points"]) == (
        "ready", [bucket], [[0.7]], [True])
    near = charts["near_miss_ratio"]
    assert (near["state"], near["x"], near["ys"], near["points"]) == (
        "ready", [bucket], [[1.0]], [True])
    for chart in (cache, near):
        assert chart["xmax"] - chart["xmin"] == pytest.approx(3600, abs=120)  # the range
        assert chart["xmin"] < bucket < chart["xmax"]
        assert chart["ticks"] and all(len(t) == 5 and t[2] == ":" for t in chart["ticks"]), \
            chart["ticks"]


def test_empty_minutes_are_gaps_not_lines(browser, server, shapes):
    chart = _open(browser, f"{server}#/realtime?range=now-1h&agent={shapes['gaps']}",
                  ["cost_per_minute"])["cost_per_minute"]
    start = (shapes["now"] - timedelta(minutes=30)).timestamp()
    assert chart["x"] == [start + 60 * k for k in range(22)]
    cost = chart["ys"][0]
    assert [i for i, value in enumerate(cost) if value is not None] == [0, 20, 21]
    assert cost[0] == cost[20] == cost[21] > 0
    assert chart["points"][0] is True  # the first minute stands alone: drawn as a point


def test_no_data_draws_no_chart_and_says_so(browser, server, shapes):
    panels = ["cache_hit_rate", "near_miss_ratio", "cost_per_minute", "tool_error_rate"]
    charts = _open(browser, f"{server}#/realtime?range=now-1h&agent={shapes['none']}", panels)
    assert charts == {panel: {"state": "empty", "text": "No data in this range.",
                              "canvas": False} for panel in panels}


def test_the_run_header_of_a_run_that_did_not_loop(browser, server, shapes, local_store):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get("about:blank")
    browser.get(f"{server}#/run/{shapes['run']}")
    header = "const el = document.getElementById('run-title'); " \
             "return el && el.querySelector('.pill') ? " \
             "[...el.childNodes].map((c) => c.textContent) : null"
    parts = WebDriverWait(browser, 90, poll_frequency=0.3).until(
        lambda driver: driver.execute_script(header))
    assert parts == [shapes["run"], "success", f"{shapes['one']} · no task type", "▶ replay"]
    WebDriverWait(browser, 90, poll_frequency=0.3).until(lambda driver: driver.execute_script(
        "return ['replay', 'economics'].every((id) => "
        "document.getElementById(id).dataset.state !== 'loading')"))
    words = browser.execute_script("return document.getElementById('main').innerText").split()
    assert "null" not in words and "undefined" not in words
    cost = local_store[1].query("SELECT cost_usd FROM runs FINAL WHERE run_id = {r:String}",
                                parameters={"r": shapes["run"]}).result_rows[0][0]
    shown = browser.execute_script(
        "return [...document.querySelectorAll('#run-kv div')].map((d) => "
        "[d.querySelector('dt').textContent, d.querySelector('dd').textContent])")
    assert ["cost", usd(cost)] in shown  # the web view's money is the CLI's (item 7)
