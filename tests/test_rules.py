"""Each alert rule fires on a scripted incident and stays silent on clean traffic.

Incidents are written through the real engine-free pipeline into the in-process chdb
store, with scripted event times; the detector engine then evaluates at a chosen event
time. Every test uses its own agent names, so the shared store's other data is ignored.
"""

from __future__ import annotations

import re
import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from loopwatch.detectors.engine import DetectorEngine, Policy
from loopwatch.detectors.rules import Finding, load_rules, with_overrides
from loopwatch.ingest.events import EventBase, Label, LlmCall, RunEnd, RunStart, Step, ToolCall
from loopwatch.ingest.wire import encode_envelope
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.store.clickhouse import run_query
from loopwatch.store.sink import ClickHouseSink, RowBatch

NOW = datetime(2026, 11, 20, 11, 0, tzinfo=UTC)


class Fleet:
    """Writes scripted events into the in-process store."""

    def __init__(self, local_store: Any) -> None:
        self.settings, self.client = local_store
        self.events: list[EventBase] = []
        self.pipeline = Pipeline(self.settings, MemoryRunStore())  # run state across flushes
        self.offset = 0

    def run(self, agent: str, at: datetime, *, steps: int = 1, end: str | None = "model_done",
            loop: bool = False, traffic_slice: str = "prod", **llm: Any) -> str:
        run_id = uuid.uuid4().hex
        common = {"run_id": run_id, "agent": agent, "model": "claude-sonnet-4",
                  "traffic_slice": traffic_slice}
        self.events.append(RunStart(ts=at, **common))
        for number in range(steps):
            self.events.append(Step(ts=at + timedelta(seconds=number), step=number, **common))
        if llm:
            self.events.append(LlmCall(ts=at, **common, **llm))
        if loop:
            for _ in range(3):
                self.events.append(ToolCall(ts=at, tool="grep", args_hash="same", **common))
        if end:
            self.events.append(RunEnd(ts=at + timedelta(seconds=steps + 1), terminal_reason=end,
                                      **common))
        return run_id

    def add(self, event: EventBase) -> None:
        self.events.append(event)

    def flush(self) -> None:
        messages = []
        for start in range(0, len(self.events), 500):
            self.offset += 1
            messages.append(RawMessage("t", 0, self.offset,
                                       encode_envelope(self.events[start:start + 500])))
        ClickHouseSink(self.client).write_batch(self.pipeline.process(messages).rows)
        self.events = []


@pytest.fixture()
def fleet(local_store: Any) -> Fleet:
    return Fleet(local_store)


def engine(local_store: Any, policy: Policy | None = None, overrides: Any = ()) -> DetectorEngine:
    _, client = local_store

    def write(table: str, rows: list[dict[str, Any]]) -> None:
        ClickHouseSink(client).write_batch(RowBatch({table: rows}))

    rules = with_overrides(load_rules(), overrides)
    return DetectorEngine(lambda sql, p: run_query(client, sql, p, readonly=True), write,
                          rules=rules, policy=policy, playbook_steps=lambda name: [])


def finding(engine_: DetectorEngine, rule: str, agent: str) -> Finding | None:
    matches = [f for f in engine_.last_findings.get(rule, []) if f.labels.get("agent") == agent]
    assert len(matches) <= 1
    return matches[0] if matches else None


def agents() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"bad-{tag}", f"good-{tag}"


def test_stuck_run(fleet, local_store):
    bad, good = agents()
    fleet.run(bad, NOW - timedelta(minutes=2), steps=25, end=None)
    fleet.run(good, NOW - timedelta(minutes=2), steps=5, end=None)
    fleet.flush()
    detector = engine(local_store)
    fired = detector.evaluate(event_now=NOW)
    assert finding(detector, "stuck_run", bad).value == 25
    assert finding(detector, "stuck_run", good).state == "inactive"
    mine = [t for t in fired if t.alert.labels.get("agent") == bad]
    assert [(t.kind, t.alert.rule, t.alert.severity) for t in mine] == [
        ("fired", "stuck_run", "warning")]


def test_loop_rate_critical_and_warning(fleet, local_store):
    bad, good = agents()
    for index in range(20):
        fleet.run(bad, NOW - timedelta(minutes=5), loop=index < 2)
        fleet.run(good, NOW - timedelta(minutes=5))
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    assert finding(detector, "loop_rate_critical", bad).value == pytest.approx(0.1)
    assert finding(detector, "loop_rate_critical", bad).active
    assert finding(detector, "loop_rate_warning", bad).active
    assert not finding(detector, "loop_rate_critical", good).active


def test_cost_spike_fires_against_history_and_waits_without_it(fleet, local_store):
    bad, good = agents()
    fresh = f"fresh-{bad}"
    for hours in range(2, 48):
        for agent in (bad, good):
            fleet.run(agent, NOW - timedelta(hours=hours), input_tokens=1000)
    for _ in range(20):
        fleet.run(bad, NOW - timedelta(minutes=10), input_tokens=1000)
        fleet.run(fresh, NOW - timedelta(minutes=10), input_tokens=1000)
    fleet.run(good, NOW - timedelta(minutes=10), input_tokens=1000)
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    spike = finding(detector, "cost_spike", bad)
    assert spike.active and spike.value == pytest.approx(20 * 0.003)
    assert spike.baseline == pytest.approx(46 * 0.003 / 47, rel=0.05)
    assert not finding(detector, "cost_spike", good).active
    waiting = finding(detector, "cost_spike", fresh)
    assert waiting.state == "waiting_for_history"
    assert waiting.detail == "baseline needs 1d of history, has 0s"


def test_tool_error_rate_takes_severity_from_tool_criticality(fleet, local_store):
    bad, good = agents()
    for index in range(10):
        for agent, failing in ((bad, index < 8), (good, index < 1)):
            fleet.add(ToolCall(ts=NOW - timedelta(minutes=2), run_id=f"r-{agent}", agent=agent,
                               tool="search", args_hash=str(index),
                               error_type="http_5xx" if failing else None))
    fleet.flush()
    detector = engine(local_store, Policy(tool_criticality={"search": "warning"}))
    fired = detector.evaluate(event_now=NOW)
    assert finding(detector, "tool_error_rate", bad).value == pytest.approx(0.8)
    assert not finding(detector, "tool_error_rate", good).active
    alert = next(t.alert for t in fired if t.alert.rule == "tool_error_rate"
                 and t.alert.labels["agent"] == bad)
    assert alert.severity == "warning"


def test_rate_limits_are_counted_apart_from_errors(fleet, local_store):
    bad, _ = agents()
    for index in range(20):
        status = 429 if index < 5 else 200
        fleet.add(LlmCall(ts=NOW - timedelta(minutes=1), run_id="r", agent=bad,
                          provider="anthropic", http_status=status,
                          error_type="rate_limited" if status == 429 else None))
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    assert finding(detector, "rate_limit_storm", bad).value == pytest.approx(0.25)
    assert finding(detector, "rate_limit_storm", bad).active
    assert finding(detector, "llm_error_rate_critical", bad).value == 0
    assert not finding(detector, "llm_error_rate_warning", bad).active


def test_rate_limited_tool_calls_are_not_tool_errors(fleet, local_store):
    """D3: a 429 is the upstream asking for patience, not a failure; it must not feed the
    tool error rate (nor the run's tool_errors), while a timeout and a 5xx do."""
    bad, _ = agents()
    run_id = f"r-{bad}"
    calls = [{"http_status": 429, "error_type": "rate_limited"}] * 6 + [
        {"timed_out": True, "timeout_ms": 1000.0}, {"http_status": 503, "error_type": "http_5xx"},
        {"http_status": 429, "error_type": "rate_limited", "timed_out": True,
         "timeout_ms": 1000.0}, {}]
    for index, fields in enumerate(calls):
        fleet.add(ToolCall(ts=NOW - timedelta(minutes=2, seconds=-index), run_id=run_id,
                           agent=bad, tool="search", args_hash=str(index), **fields))
    fleet.flush()
    _, client = local_store
    assert run_query(client, "SELECT groupArray(is_error) FROM (SELECT is_error FROM tool_calls "
                             "FINAL WHERE run_id = {r:String} ORDER BY ts)", {"r": run_id}
                     ).scalar() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 0]
    assert run_query(client, "SELECT tool_calls, tool_errors FROM runs FINAL "
                             "WHERE run_id = {r:String}", {"r": run_id}).rows == [[10, 3]]
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    assert finding(detector, "tool_error_rate", bad).value == pytest.approx(0.3)
    assert not finding(detector, "tool_error_rate", bad).active


def test_a_tools_429s_raise_their_own_alert_not_its_error_rate(fleet, local_store):
    bad, good = agents()
    for index in range(20):
        for agent, limited in ((bad, index < 5), (good, index < 1)):
            fleet.add(ToolCall(ts=NOW - timedelta(minutes=1), run_id=f"r-{agent}", agent=agent,
                               tool="search", args_hash=str(index),
                               http_status=429 if limited else 200,
                               error_type="rate_limited" if limited else None))
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    storm = finding(detector, "tool_rate_limit_storm", bad)
    assert (storm.labels, storm.value, storm.active) == ({"agent": bad, "tool": "search"}, 0.25,
                                                         True)
    assert storm.summary() == "25.0% of 20 search calls were rate limited (429) in the last 5m"
    assert finding(detector, "tool_rate_limit_storm", good).value == 0.05
    assert not finding(detector, "tool_rate_limit_storm", good).active
    assert finding(detector, "tool_error_rate", bad).value == 0


def test_retry_storm_on_a_permanent_400(fleet, local_store):
    bad, good = agents()
    for _ in range(10):
        for attempt in range(1, 5):
            fleet.add(LlmCall(ts=NOW - timedelta(minutes=3), run_id="r", agent=bad,
                              attempt=attempt, http_status=400, error_type="invalid_request"))
        fleet.add(LlmCall(ts=NOW - timedelta(minutes=3), run_id="r", agent=good, attempt=1))
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    assert finding(detector, "retry_storm", bad).value == pytest.approx(3.0)
    assert finding(detector, "retry_storm", bad).active
    assert finding(detector, "retry_storm", good).value == 0


def test_hallucination_rate_from_late_labels(fleet, local_store):
    bad, good = agents()
    for index in range(10):
        for agent, wrong in ((bad, index < 3), (good, False)):
            fleet.add(Label(ts=NOW - timedelta(minutes=5), run_id=f"{agent}-{index}",
                            agent=agent, verdict="wrong" if wrong else "correct"))
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    assert finding(detector, "hallucination_rate", bad).active
    assert finding(detector, "hallucination_rate", bad).value == pytest.approx(0.3)
    assert not finding(detector, "hallucination_rate", good).active


def test_test_traffic_never_pages(fleet, local_store):
    """A load test that loops, a chaos drill whose tool fails and an eval whose answers
    are wrong are stored like production, but the rules leave their slices out (the
    label's own slice does not matter: its run's does); production traffic doing the
    same fires, and so does the test traffic once no slice is left out."""
    tested, prod = agents()
    for agent, slice_ in ((tested, "load_test"), (prod, "prod")):
        for index in range(20):
            run_id = fleet.run(agent, NOW - timedelta(minutes=5), loop=index < 4,
                               traffic_slice=slice_)
            fleet.add(Label(ts=NOW - timedelta(minutes=4), run_id=run_id, agent=agent,
                            verdict="wrong" if index < 5 else "correct"))
        for index in range(10):
            fleet.add(ToolCall(ts=NOW - timedelta(minutes=2), run_id=f"t-{agent}", agent=agent,
                               tool="search", args_hash=str(index), error_type="http_5xx",
                               traffic_slice="chaos" if agent == tested else "prod"))
    fleet.flush()
    rules = ("loop_rate_critical", "hallucination_rate", "tool_error_rate")
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    assert [finding(detector, rule, tested) for rule in rules] == [None, None, None]
    assert [(finding(detector, rule, prod).value, finding(detector, rule, prod).active)
            for rule in rules] == [(0.2, True), (0.25, True), (1.0, True)]
    unfiltered = engine(local_store, Policy(excluded_slices=()))
    unfiltered.evaluate(event_now=NOW)
    assert [finding(unfiltered, rule, tested).value for rule in rules] == [0.2, 0.25, 1.0]


def test_a_rule_that_reads_agent_traffic_must_leave_test_traffic_out():
    shipped = load_rules()
    assert sorted(name for name, rule in shipped.items() if rule.all_traffic) == [
        "consumer_lag", "dead_letter_rate", "processing_delay"]
    text = """[[rules]]
name = "mine"
description = "d"
severity = "warning"
playbook = "p"
labels = ["agent"]
threshold = 1
summary = "s"
sql = "SELECT agent, count() AS value FROM runs FINAL GROUP BY agent"
"""
    with pytest.raises(ValueError, match=re.escape(
            "rule mine: leave test traffic out with 'traffic_slice NOT IN "
            "{excluded_slices:Array(String)}', or set all_traffic = true")):
        load_rules(text)
    assert load_rules(text + "all_traffic = true\n")["mine"].all_traffic


def test_near_miss_high_means_the_timeout_is_too_low(fleet, local_store):
    bad, good = agents()
    for index, late in enumerate([1100, 1200, 1250, 1290, 4000]):
        fleet.add(ToolCall(ts=NOW - timedelta(minutes=5), run_id="r", agent=bad, tool="search",
                           args_hash=str(index), timed_out=True, timeout_ms=1000,
                           latency_ms=1000, late_completion_ms=late))
        fleet.add(ToolCall(ts=NOW - timedelta(minutes=5), run_id="r", agent=good, tool="search",
                           args_hash=str(index), timed_out=True, timeout_ms=1000,
                           latency_ms=1000, late_completion_ms=9000))
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    assert finding(detector, "near_miss_high", bad).value == pytest.approx(0.8)
    assert finding(detector, "near_miss_high", bad).active
    assert not finding(detector, "near_miss_high", good).active


def test_silent_prompt_cache_miss(fleet, local_store):
    bad, good = agents()
    for minutes in range(20, 180, 5):
        for agent in (bad, good):
            fleet.add(LlmCall(ts=NOW - timedelta(minutes=minutes), run_id="r", agent=agent,
                              input_tokens=10_000, cache_read_input_tokens=9000))
    for index in range(10):
        fleet.add(LlmCall(ts=NOW - timedelta(minutes=index + 1), run_id="r", agent=bad,
                          input_tokens=10_000, cache_creation_input_tokens=9000))
        fleet.add(LlmCall(ts=NOW - timedelta(minutes=index + 1), run_id="r", agent=good,
                          input_tokens=10_000, cache_read_input_tokens=9000))
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    assert finding(detector, "cache_hit_collapse", bad).value == 0
    assert finding(detector, "cache_hit_collapse", bad).active
    assert not finding(detector, "cache_hit_collapse", good).active


def test_a_cache_never_read_on_any_call_of_a_run_fires_without_history(fleet, local_store):
    """A41 / CACHE: a volatile prefix makes every call a full cache write, never a read,
    or (a provider that caches silently, prompts captured) a new system prompt on every
    call. Seen per run, it needs no baseline: a new prompt version, or an agent whose
    cache never worked, is caught too. Runs with fewer than 3 answered calls, a run that
    writes once then reads, and an agent that does not cache with a stable system prompt
    do not count."""
    broken, healthy = agents()
    uncached, stamped = f"plain-{broken}", f"stamped-{broken}"

    def run(agent: str, calls: list[tuple[int, int]], prompts: list[str] | None = None,
            **fields: Any) -> None:
        run_id = uuid.uuid4().hex
        for index, (written, read) in enumerate(calls):
            fleet.add(LlmCall(ts=NOW - timedelta(minutes=5, seconds=-index), run_id=run_id,
                              agent=agent, prompt_version="v2", input_tokens=10_000,
                              cache_creation_input_tokens=written, cache_read_input_tokens=read,
                              system_prompt_hash=(prompts or [""] * len(calls))[index],
                              **fields))

    for index in range(8):
        run(broken, [(9000, 0)] * 3 if index < 6 else [(9000, 0), (0, 9000), (0, 9000)])
        run(healthy, [(9000, 0), (0, 9000), (0, 9000), (0, 9000)])
        run(uncached, [(0, 0)] * 4, ["same"] * 4)
        run(stamped, [(0, 0)] * 3, [f"{index}-{call}" for call in range(3)] if index < 5
            else ["a", "b", "a"])
    run(broken, [(9000, 0)] * 2)  # too short to tell
    run(broken, [(9000, 0), (0, 0), (9000, 0)], http_status=429, error_type="rate_limited")
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    fired = finding(detector, "cache_missed_every_call", broken)
    assert (fired.labels, fired.value, fired.samples, fired.active) == (
        {"agent": broken, "prompt_version": "v2"}, 0.75, 8, True)
    assert fired.summary() == (f"{broken} v2: 75% of 8 runs never read the prompt cache, "
                               "writing it or changing the system prompt on every call")
    assert finding(detector, "cache_missed_every_call", stamped).value == 5 / 8
    assert finding(detector, "cache_missed_every_call", stamped).active
    assert finding(detector, "cache_missed_every_call", healthy).value == 0
    assert finding(detector, "cache_missed_every_call", uncached).value == 0
    assert finding(detector, "cache_hit_collapse", broken) is None  # no history to compare


def test_active_sessions_surge_compares_the_same_rolling_hour_of_earlier_days(fleet,
                                                                              local_store):
    """At 11:00 the window is 10:00-11:00, so the baseline is 10:00-11:00 of the 7 days
    before (2 runs a day), not the clock hour 11:00-12:00 (10 runs a day)."""
    agent, _ = agents()
    for days in range(1, 8):
        day = NOW - timedelta(days=days)
        for index in range(2):
            fleet.run(agent, day - timedelta(minutes=30 + index))
        for index in range(10):
            fleet.run(agent, day + timedelta(minutes=30 + index))
    for index in range(21):
        fleet.run(agent, NOW - timedelta(minutes=30, seconds=index))
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    surge = finding(detector, "active_sessions_surge", agent)
    assert (surge.value, surge.baseline, surge.active) == (21, 2.0, True)
    assert surge.summary() == (f"{agent} started 21 runs in the last hour, 10.5x its usual "
                               "for this hour")


def test_steps_lost_compares_stored_steps_with_the_agents_own_count(fleet, local_store):
    """A57: the run.end says how many steps the agent sent; a run that stored fewer lost
    events on the way. A run.end without a count, or a redelivered one, changes nothing."""
    bad, good = agents()
    for agent in (bad, good):
        for index in range(21):
            run_id = f"{agent}-{index}"
            common = {"run_id": run_id, "agent": agent}
            at = NOW - timedelta(minutes=5)
            fleet.add(RunStart(ts=at, **common))
            for number in range(3):
                fleet.add(Step(ts=at + timedelta(seconds=number), step=number, **common))
            sent = 5 if agent == bad and index < 4 else 3
            end = RunEnd(ts=at + timedelta(seconds=9), terminal_reason="model_done",
                         total_steps=None if index == 20 else sent, **common)
            fleet.add(end)
            if index == 0:
                fleet.add(end)  # delivered twice
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    lost = finding(detector, "steps_lost", bad)
    assert (lost.value, lost.samples, lost.active) == (0.2, 20, True)
    assert lost.summary() == (f"20.0% of 20 closed runs of {bad} stored fewer steps than the "
                              "agent sent")
    assert (finding(detector, "steps_lost", good).value,
            finding(detector, "steps_lost", good).active) == (0, False)


def test_run_cost_budget_watches_each_run_against_its_declared_ceiling(fleet, local_store):
    """A10: 70% of a run's max_cost_usd warns while it runs (or just closed); a run under
    it, one without a budget and one that closed long ago do not. claude-sonnet-4 input
    is $3 per million tokens."""
    agent, _ = agents()

    def run(name: str, budget: float | None, tokens: int, *, closed_minutes: int | None,
            ) -> None:
        common = {"run_id": f"{agent}-{name}", "agent": agent, "model": "claude-sonnet-4"}
        at = NOW - timedelta(minutes=30 if closed_minutes is None else closed_minutes + 1)
        fleet.add(RunStart(ts=at, max_cost_usd=budget, task_type="report", **common))
        fleet.add(LlmCall(ts=at + timedelta(seconds=1), input_tokens=tokens, **common))
        if closed_minutes is not None:
            fleet.add(RunEnd(ts=NOW - timedelta(minutes=closed_minutes),
                             terminal_reason="cap", cap="cost", **common))

    run("burning", 1.0, 250_000, closed_minutes=None)  # $0.75
    run("thrifty", 1.0, 100_000, closed_minutes=None)  # $0.30
    run("unbounded", None, 1_000_000, closed_minutes=None)
    run("just-closed", 0.5, 200_000, closed_minutes=5)  # $0.60
    run("long-closed", 0.5, 200_000, closed_minutes=60)
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    found = {f.labels["run_id"].removeprefix(f"{agent}-"): (round(f.value, 4), f.active)
             for f in detector.last_findings["run_cost_budget"] if f.labels["agent"] == agent}
    assert found == {"burning": (0.75, True), "thrifty": (0.3, False),
                     "just-closed": (1.2, True)}
    burning = finding_for_run(detector, f"{agent}-burning")
    assert burning.summary() == f"run {agent}-burning of {agent} has spent 75% of its cost budget"
    assert burning.labels["task_type"] == "report"


def finding_for_run(engine_: DetectorEngine, run_id: str) -> Finding:
    (match,) = [f for f in engine_.last_findings["run_cost_budget"]
                if f.labels["run_id"] == run_id]
    return match


def test_model_version_change_is_info(fleet, local_store):
    bad, good = agents()
    for agent in (bad, good):
        fleet.add(LlmCall(ts=NOW - timedelta(hours=3), run_id="r", agent=agent, model="gpt-4o",
                          response_model="gpt-4o-2026-08"))
    fleet.add(LlmCall(ts=NOW - timedelta(minutes=3), run_id="r", agent=bad, model="gpt-4o",
                      response_model="gpt-4o-2026-11"))
    fleet.add(LlmCall(ts=NOW - timedelta(minutes=3), run_id="r", agent=good, model="gpt-4o",
                      response_model="gpt-4o-2026-08"))
    fleet.flush()
    detector = engine(local_store)
    fired = detector.evaluate(event_now=NOW)
    changed = finding(detector, "model_version_changed", bad)
    assert changed.labels["response_model"] == "gpt-4o-2026-11"
    assert finding(detector, "model_version_changed", good) is None
    assert {t.alert.severity for t in fired if t.alert.rule == "model_version_changed"
            and t.alert.labels["agent"] == bad} == {"info"}


def test_silent_failure_jump_is_a_binomial_test(fleet, local_store):
    bad, good = agents()
    for hours in range(2, 30):
        for agent in (bad, good):
            fleet.run(agent, NOW - timedelta(hours=hours),
                      end="cannot_complete" if hours % 20 == 0 else "model_done")
    for index in range(30):
        fleet.run(bad, NOW - timedelta(minutes=30),
                  end="cannot_complete" if index < 12 else "model_done")
        fleet.run(good, NOW - timedelta(minutes=30),
                  end="cannot_complete" if index < 1 else "model_done")
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    jump = finding(detector, "silent_failure_jump", bad)
    assert jump.active and jump.value == pytest.approx(0.4)
    assert jump.extra["p_value"] < 1e-6
    assert not finding(detector, "silent_failure_jump", good).active


def test_quality_drop_against_the_seven_day_average(fleet, local_store):
    bad, good = agents()
    for hours in range(2, 50, 2):
        for agent in (bad, good):
            fleet.add(Label(ts=NOW - timedelta(hours=hours), run_id="r", agent=agent,
                            verdict="correct", quality_score=0.9))
    for index in range(10):
        fleet.add(Label(ts=NOW - timedelta(minutes=index + 1), run_id="r", agent=bad,
                        verdict="correct", quality_score=0.6))
        fleet.add(Label(ts=NOW - timedelta(minutes=index + 1), run_id="r", agent=good,
                        verdict="correct", quality_score=0.88))
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    assert finding(detector, "quality_drop", bad).active
    assert not finding(detector, "quality_drop", good).active


def test_daily_budget_before_noon_only_where_a_budget_is_set(fleet, local_store):
    bad, good = agents()
    for _ in range(10):
        fleet.run(bad, NOW - timedelta(hours=1), input_tokens=100_000)  # $0.30 each
        fleet.run(good, NOW - timedelta(hours=1), input_tokens=100_000)
    fleet.flush()
    detector = engine(local_store, Policy(daily_budget_usd={bad: 4.0}))
    detector.evaluate(event_now=NOW)
    assert finding(detector, "daily_budget", bad).value == pytest.approx(0.75)
    assert finding(detector, "daily_budget", bad).active
    assert finding(detector, "daily_budget", good).detail == "no budget set"
    detector.evaluate(event_now=NOW + timedelta(hours=2))  # after noon the rule is quiet
    assert finding(detector, "daily_budget", bad) is None


def test_overrides_per_agent_and_for_duration_lifecycle(fleet, local_store):
    bad, _ = agents()
    fleet.run(bad, NOW - timedelta(minutes=2), steps=25, end=None)
    fleet.flush()
    override = [{"rule": "stuck_run", "match": {"agent": bad}, "threshold": 30}]
    higher = engine(local_store, overrides=override)
    assert not [t for t in higher.evaluate(event_now=NOW) if t.alert.labels.get("agent") == bad]
    assert finding(higher, "stuck_run", bad).state == "inactive"
    slow = [{"rule": "stuck_run", "match": {"agent": bad}, "for": "5m"}]
    detector = engine(local_store, overrides=slow)
    first = [t for t in detector.evaluate(event_now=NOW) if t.alert.labels.get("agent") == bad]
    assert [t.kind for t in first] == ["pending"]
    later = [t for t in detector.evaluate(event_now=NOW + timedelta(minutes=5))
             if t.alert.labels.get("agent") == bad]
    assert [t.kind for t in later] == ["fired"]
    fleet.add(RunEnd(ts=NOW + timedelta(minutes=6), run_id=first[0].alert.labels["run_id"],
                     agent=bad, terminal_reason="model_done"))
    fleet.flush()
    resolved = [t for t in detector.evaluate(event_now=NOW + timedelta(minutes=7))
                if t.alert.labels.get("agent") == bad]
    assert [(t.kind, t.alert.state) for t in resolved] == [("resolved", "resolved")]
    history = run_query(local_store[1], "SELECT state, fired_at IS NOT NULL, resolved_at IS NOT "
                        "NULL FROM alerts FINAL WHERE labels['agent'] = {a:String}",
                        {"a": bad}).rows
    assert history == [["resolved", 1, 1]]


def test_open_alerts_survive_an_engine_restart(fleet, local_store):
    bad, _ = agents()
    fleet.run(bad, NOW - timedelta(minutes=2), steps=30, end=None)
    fleet.flush()
    assert any(t.alert.labels.get("agent") == bad for t in
               engine(local_store).evaluate(event_now=NOW))
    restarted = engine(local_store)
    again = [t for t in restarted.evaluate(event_now=NOW) if t.alert.labels.get("agent") == bad]
    assert again == []  # still firing, not fired twice
    assert any(a.labels.get("agent") == bad and a.state == "firing"
               for a in restarted.book.open.values())


def test_cost_per_minute_anomaly_uses_the_online_detector(fleet, local_store):
    bad, good = agents()
    for minutes in range(3, 400):
        for agent in (bad, good):
            fleet.add(LlmCall(ts=NOW - timedelta(minutes=minutes), run_id="r", agent=agent,
                              input_tokens=1000 + 10 * (minutes % 7)))
    for minutes in (1, 2):  # the spike, inside the last full 5-minute bucket
        fleet.add(LlmCall(ts=NOW - timedelta(minutes=minutes), run_id="r", agent=bad,
                          input_tokens=60_000))
        fleet.add(LlmCall(ts=NOW - timedelta(minutes=minutes), run_id="r", agent=good,
                          input_tokens=1000))
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    spike = finding(detector, "cost_per_minute_anomaly", bad)
    assert spike.active and spike.extra["score"] >= 0.75
    assert spike.value == pytest.approx(2 * 60_000 * 3e-6 + 3 * 1000 * 3e-6, rel=0.05)
    assert not finding(detector, "cost_per_minute_anomaly", good).active


def test_completion_length_shift_is_a_ks_test(fleet, local_store):
    import random

    bad, good = agents()
    rng = random.Random(3)
    for index in range(600):
        when = NOW - timedelta(minutes=600 - index)
        for agent in (bad, good):
            shifted = agent == bad and index >= 520
            tokens = int(rng.gammavariate(4, 150 if shifted else 60))
            fleet.add(LlmCall(ts=when, run_id="r", agent=agent, model="gpt-4o",
                              output_tokens=max(1, tokens)))
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    assert finding(detector, "completion_length_shift", bad).active
    assert not finding(detector, "completion_length_shift", good).active


def test_the_detectors_page_lists_every_rule():
    """docs/detectors.md (the rule table moved there from the README, issue #25)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "detectors.md").read_text()
    for name in load_rules():
        assert f"| `{name}` |" in page, name


def test_anomaly_detectors_learn_each_point_once_across_evaluations(fleet, local_store):
    agent, _ = agents()
    for minutes in range(1, 301):
        fleet.add(LlmCall(ts=NOW - timedelta(minutes=minutes), run_id="r", agent=agent,
                          input_tokens=1000))
    fleet.flush()
    detector = engine(local_store)
    detector.evaluate(event_now=NOW)
    assert finding(detector, "cost_per_minute_anomaly", agent).samples == 60  # 5-min buckets
    detector.evaluate(event_now=NOW)
    assert finding(detector, "cost_per_minute_anomaly", agent).samples == 60
    fleet.add(LlmCall(ts=NOW + timedelta(seconds=30), run_id="r", agent=agent,
                      input_tokens=1000))
    fleet.flush()
    detector.evaluate(event_now=NOW + timedelta(minutes=5, seconds=5))
    assert finding(detector, "cost_per_minute_anomaly", agent).samples == 61


# -- one query per pass (detectors/batch.py) ------------------------------------------

class Counted:
    """The engine's query function, counting what it sends."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.sent: list[str] = []

    def __call__(self, sql: str, parameters: dict[str, Any]) -> Any:
        from loopwatch.detectors.batch import IN_STEP_SQL

        if sql != IN_STEP_SQL:  # the check after a failure is not a rule's query
            self.sent.append(sql)
        return run_query(self.client, sql, parameters, readonly=True)


def mixed_traffic(fleet: Fleet) -> str:
    """Traffic that gives most rules rows: runs closed, looping and stuck, LLM calls with
    tokens, retries and errors, tool calls failing and rate limited."""
    agent, _ = agents()
    for index in range(30):
        at = NOW - timedelta(minutes=3, seconds=index)
        fleet.run(agent, at, steps=3, loop=index % 5 == 0, input_tokens=900 + index,
                  output_tokens=40 + index, cache_read_tokens=100 * (index % 3),
                  attempt=1 + index % 3, http_status=429 if index % 7 == 0 else 200)
        fleet.add(ToolCall(ts=at, run_id=f"t-{agent}", agent=agent, tool="search",
                           args_hash=str(index), latency_ms=100.0 + index,
                           error_type="http_5xx" if index % 4 == 0 else None))
    fleet.run(agent, NOW - timedelta(minutes=1), steps=25, end=None)
    fleet.flush()
    return agent


def test_a_detector_pass_is_one_query_for_every_rule(fleet, local_store):
    """Before, a pass sent one query per rule (30); now each rule SQL's columns are
    described once per process, then every pass is one UNION ALL of every rule."""
    from loopwatch.detectors.batch import DESCRIBED

    mixed_traffic(fleet)
    _, client = local_store
    counted = Counted(client)

    def new_engine() -> DetectorEngine:
        built = DetectorEngine(counted, lambda table, rows: None, rules=load_rules(),
                               playbook_steps=lambda name: [])
        counted.sent.clear()  # the engine's restore of open alerts
        return built

    DESCRIBED.clear()  # the cache is the process's: earlier tests' engines filled it
    detector = new_engine()
    detector.evaluate(event_now=NOW, wall_now=NOW)
    distinct = {rule.sql for rule in detector.rules.values()}
    assert sorted(sql for sql in counted.sent if sql.startswith("DESCRIBE")) == sorted(
        f"DESCRIBE TABLE ({sql})" for sql in distinct)
    counted.sent.clear()
    detector.evaluate(event_now=NOW, wall_now=NOW)
    assert len(counted.sent) == 1, counted.sent
    assert counted.sent[0].count("\nUNION ALL\n") == len(detector.rules) - 1
    assert set(detector.last_findings) == set(detector.rules)
    second = new_engine()  # another engine of the process describes nothing again
    second.evaluate(event_now=NOW, wall_now=NOW)
    assert len(counted.sent) == 1 and "\nUNION ALL\n" in counted.sent[0]
    assert set(second.last_findings) == set(second.rules)


def test_every_rule_finds_in_the_batch_what_it_finds_alone(fleet, local_store):
    """The batch hands each rule the rows that decide its findings, exactly: each rule's
    findings from its own query and from its branch of the batch are equal (every field,
    floats to the last digit, through their repr)."""
    from loopwatch.detectors.batch import RuleQueries
    from loopwatch.detectors.rules import evaluate

    mixed_traffic(fleet)
    _, client = local_store
    detector = engine(local_store)
    work = [(rule, detector._parameters(rule, NOW, NOW)) for rule in detector.rules.values()]
    together = RuleQueries(Counted(client), set(), columns={}).rows(work)
    compared = 0
    for rule, parameters in work:
        alone = run_query(client, rule.sql, parameters, readonly=True).records()
        batched = together[rule.name]
        assert not isinstance(batched, Exception), (rule.name, batched)
        # as sets: a rule without ORDER BY (run_cost_budget's join) answers in any order
        assert sorted(map(repr, evaluate(rule, batched, {}, {}))) == sorted(
            map(repr, evaluate(rule, alone, {}, {}))), rule.name
        compared += bool(alone)
    assert compared >= 15  # rules with rows to compare, not only empty answers


def test_a_rule_that_fails_in_the_batch_fails_alone_and_the_others_still_answer(
        fleet, local_store, caplog):
    agent = mixed_traffic(fleet)
    rules = load_rules(f"""
[[rules]]
name = "steady"
description = "answers every pass"
severity = "warning"
playbook = "agent_stuck_in_loop"
labels = ["agent"]
threshold = 0
summary = "x"
all_traffic = true
sql = '''SELECT agent, toFloat64(count()) AS value FROM runs FINAL WHERE agent = '{agent}'
         GROUP BY agent'''

[[rules]]
name = "breaks_later"
description = "fails once event time passes NOW"
severity = "warning"
playbook = "agent_stuck_in_loop"
labels = ["agent"]
threshold = 0
summary = "x"
all_traffic = true
sql = '''SELECT 'a' AS agent, 1 + throwIf({{now:DateTime64(3, 'UTC')}}
                                           > '{NOW:%Y-%m-%d %H:%M:%S}', 'broken') AS value'''
""")
    _, client = local_store
    counted = Counted(client)
    detector = DetectorEngine(counted, lambda table, rows: None, rules=rules,
                              playbook_steps=lambda name: [])
    detector.evaluate(event_now=NOW, wall_now=NOW)
    assert [f.value for f in detector.last_findings["breaks_later"]] == [1.0]
    later = NOW + timedelta(minutes=1)
    detector.last_findings.clear()
    counted.sent.clear()
    detector.evaluate(event_now=later, wall_now=later)
    assert [(f.labels, f.value) for f in detector.last_findings["steady"]] == [
        ({"agent": agent}, 32.0)]  # 30 closed, the stuck one, the tool calls' run
    assert "breaks_later" not in detector.last_findings
    assert "rule breaks_later failed" in caplog.text
    assert len(counted.sent) == 3  # the batch, then each rule alone
    counted.sent.clear()
    detector.evaluate(event_now=later, wall_now=later)
    assert len(counted.sent) == 2  # the broken rule alone until it answers, the rest batched
    assert [f.value for f in detector.last_findings["steady"]] == [32.0]


class _Waits(threading.Event):
    """A stop event that records each wait and answers "stopped" at once: the test
    learns what the loop waits for without waiting itself."""

    def __init__(self) -> None:
        super().__init__()
        self.waited: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waited.append(timeout)
        self.set()
        return True


@pytest.mark.parametrize("delay_s", [0.0, 3600.0])
def test_the_first_rule_and_advisor_pass_wait_for_the_start_delay(
        delay_s: float, local_store, monkeypatch: pytest.MonkeyPatch):
    """``detect_start_delay_s`` (the throughput bench's 3600): no pass before it; with
    0 (the default) both loops pass at once, as a restarted ``up`` must to page."""
    from loopwatch.core.config import AdvisorSettings
    from loopwatch.detectors.advisors import alerting

    passes: list[str] = []
    _, client = local_store
    detector = DetectorEngine(lambda sql, p: run_query(client, sql, p, readonly=True),
                              lambda table, rows: None, rules={},
                              playbook_steps=lambda name: [])
    monkeypatch.setattr(detector, "evaluate", lambda *args: passes.append("rules") or [])
    monkeypatch.setattr(alerting, "advisor_pass", lambda *args: passes.append("advisors"))
    stop, advisors_stop = _Waits(), _Waits()
    detector.run(stop, interval_s=15.0, delay_s=delay_s)
    alerting.run_advisors(None, lambda table, rows: None,  # type: ignore[arg-type]
                          AdvisorSettings(), timedelta(0), advisors_stop, delay_s)
    if delay_s:
        assert (passes, stop.waited, advisors_stop.waited) == ([], [3600.0], [3600.0])
    else:
        assert (passes, stop.waited, advisors_stop.waited) == (
            ["rules", "advisors"], [15.0], [300.0])
