"""Advisors: each against its seed vector (exact values), then through the real stack
(session broker + ``up`` + chdb) on its scenario, and never on clean traffic."""

from __future__ import annotations

import itertools
import json
import os
import random
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import astuple, replace
from datetime import UTC, datetime, timedelta

import pytest

from loopwatch.core.config import AdvisorSettings
from loopwatch.detectors.advisors.base import Scope, sort_findings
from loopwatch.detectors.advisors.cache import CallSums, modeled_cost, sums_of_run
from loopwatch.detectors.advisors.cli import findings_json
from loopwatch.detectors.advisors.judge import Confusion
from loopwatch.detectors.advisors.pipeline import agent_input_tokens, determinism
from loopwatch.detectors.advisors.quadratic import compacted_cost, digest_saving, projected_cost
from loopwatch.detectors.advisors.retry import Amplification
from loopwatch.detectors.advisors.run import advise
from loopwatch.detectors.advisors.timeout import HUNG, CostCurve, Rates, bin_ms, round_up
from loopwatch.ingest.events import Label
from loopwatch.processors.pricing import Price, PriceTable
from loopwatch.scenarios.traffic import Behaviour
from tests.advisor_traffic import behaviour_of, emit_all, scenario_events

SETTINGS = AdvisorSettings()


def _tmo_durations(trials: int = 20_000, seed: int = 7) -> list[tuple[float, int]]:
    """The seed post's sampler, as it wrote it (timeout-is-a-bet.txt)."""
    rng = random.Random(seed)
    found = []
    for _ in range(trials):
        r = rng.random()
        if r < 0.85:
            d = rng.uniform(1, 6)
        elif r < 0.95:
            d = rng.uniform(6, 30)
        else:
            d = rng.uniform(120, 300)
        found.append((d, 1))
    return found


def test_timeout_cost_curve_matches_the_tmo_vector():
    curve = CostCurve(_tmo_durations(), Rates(0.002, 0.10, 1.2))
    costs = [round(curve.cost(t), 4) for t in (5, 10, 15, 20, 30, 45, 60)]
    assert costs == [0.0457, 0.0247, 0.0235, 0.0222, 0.0184, 0.0199, 0.0214]
    assert round_up(curve.optimum()) == 30.0


def test_timeout_curve_counts_unknown_true_durations_as_hung():
    curve = CostCurve([(1.0, 3), (HUNG, 1)], Rates(0.002, 0.10, 1.2))
    assert curve.cost(2.0) == pytest.approx((3 * 0.002 + 0.002 * 2 + 0.12) / 4)
    assert curve.optimum() == 1.0


def _scope(agent: str, start: datetime, hours: float) -> Scope:
    return Scope(start, start + timedelta(hours=hours), agent)


def _expected_timeouts_ms(events, rates: Rates, until: datetime) -> dict[str, float]:
    """Per tool, the pure computation over the emitted events before ``until``, binned
    as the advisor's SQL bins them."""
    durations: dict[str, list[tuple[float, int]]] = {}
    for event in events:
        if event.event_type != "tool.call" or event.ts >= until:
            continue
        true_ms = event.late_completion_ms if event.timed_out else event.latency_ms
        value = HUNG if true_ms is None else bin_ms(true_ms) / 1000
        durations.setdefault(event.tool, []).append((value, 1))
    return {tool: round_up(CostCurve(values, rates).optimum()) * 1000
            for tool, values in durations.items()}


def test_timeout_recommender_on_its_scenario_through_the_stack(emitter, reader, agent):
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=3)
    events = scenario_events(agent, behaviour_of("timeout_too_low"), start, hours=1)
    emit_all(emitter, reader, agent, events)
    found = advise(reader, _scope(agent, start, 1), SETTINGS)
    timeouts = {f.subject: f for f in found if f.kind == "timeout"}
    expected = _expected_timeouts_ms(events, Rates(), start + timedelta(hours=1))
    assert set(timeouts) == set(expected) == {"search", "fetch", "lookup"}
    for tool, finding in timeouts.items():
        assert finding.agent == agent
        assert finding.evidence["timeout_ms"] == 330.0
        assert finding.evidence["recommended_timeout_ms"] == expected[tool]
        assert finding.recommendation.startswith(f"Raise {tool}'s timeout from 0.33 s to ")
        assert finding.saving_usd_per_day is not None and finding.saving_usd_per_day > 0
        assert f"'{agent}'" in finding.query and f"'{tool}'" in finding.query
        rows = reader.query(finding.query).records()
        assert rows[0]["calls"] == finding.evidence["calls"]
        assert rows[0]["timeouts"] == finding.evidence["timeouts"]


def test_no_timeout_finding_on_clean_traffic(emitter, reader, agent):
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=5)
    events = scenario_events(agent, Behaviour(), start, hours=1)
    emit_all(emitter, reader, agent, events)
    found = advise(reader, _scope(agent, start, 1), SETTINGS)
    assert [f for f in found if f.kind == "timeout"] == []


def test_findings_sort_by_saving_and_json_has_the_issue_shape():
    from loopwatch.detectors.advisors.base import Finding

    def make(kind, subject, saving):
        return Finding(kind=kind, agent="a", subject=subject, evidence={"n": 1},
                       recommendation="r", saving_usd_per_day=saving, query="SELECT 1",
                       recommended=5.0)

    findings = sort_findings([make("judge_agreement", "j", None), make("timeout", "t", 2.0),
                              make("cache", "c", 7.5)])
    payload = json.loads(findings_json(findings))
    assert list(payload) == ["findings"]
    assert [f["subject"] for f in payload["findings"]] == ["c", "t", "j"]
    assert set(payload["findings"][0]) == {"kind", "agent", "subject", "evidence",
                                           "recommendation", "saving_usd_per_day", "query"}
    assert payload["findings"][2]["saving_usd_per_day"] is None


# -- retry amplification -----------------------------------------------------------

def test_retry_amplification_matches_the_pm400_vector():
    prices = PriceTable.load()
    call_cost = prices.cost("claude-sonnet-4", 6000, 400, 0, 0).cost_usd
    layers = Amplification(tool=5, model=5, job=3)
    assert layers.attempts_per_item == 75
    assert layers.model_calls_per_item == 15
    assert round(call_cost, 6) == 0.024
    assert round(layers.item_cost(call_cost), 6) == 0.36
    assert round(layers.item_cost(call_cost) * 550, 6) == 198.0


def _expected_wasted(events, prices: PriceTable, until: datetime) -> float:
    """Permanent-error model spend after each operation's first, per work item, over
    the calls before ``until`` (the window's end)."""
    events = [e for e in events if e.ts < until]
    item_of = {e.run_id: (e.job_id or e.run_id) for e in events if e.event_type == "run.start"}
    calls: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if e.event_type == "llm.call" and e.http_status and 400 <= e.http_status < 500 \
                and e.http_status not in (408, 429):
            cost = prices.cost(e.model, e.input_tokens, e.output_tokens,
                               e.cache_read_input_tokens, e.cache_creation_input_tokens).cost_usd
            calls.setdefault((item_of[e.run_id], str(e.step)), []).append(cost)
    return sum(sum(c) * (len(c) - 1) / len(c) for c in calls.values() if len(c) > 1)


@pytest.mark.parametrize(("scenario", "job"), [("retry_storm_permanent_400", 1),
                                               ("retry_amplification_nested", 3)])
def test_retry_auditor_on_its_scenario_through_the_stack(emitter, reader, agent,
                                                         scenario, job):
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=7)
    events = scenario_events(agent, behaviour_of(scenario), start, hours=0.5)
    emit_all(emitter, reader, agent, events)
    found = [f for f in advise(reader, _scope(agent, start, 0.5), SETTINGS)
             if f.kind == "retry_amplification"]
    assert len(found) == 1
    finding = found[0]
    assert (finding.agent, finding.subject) == (agent, "permanent_errors")
    assert finding.evidence["layers"] == {"tool": 1, "model": 5, "job": job}
    assert finding.evidence["worst_case_attempts_per_item"] == 5 * job
    # the evidence is rounded to 6 decimals: equal to that, whatever the summing order
    assert finding.evidence["wasted_usd_in_window"] == pytest.approx(
        _expected_wasted(events, PriceTable.load(), start + timedelta(hours=0.5)), abs=1e-6)
    assert finding.saving_usd_per_day is not None and finding.saving_usd_per_day > 0
    assert f"= {5 * job} attempts per item" in finding.recommendation
    rows = reader.query(finding.query).records()
    assert rows[0]["layer"] == "model" and rows[0]["http_status"] == 400


def test_no_finding_of_any_advisor_on_clean_traffic(emitter, reader, agent):
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=9)
    events = scenario_events(agent, Behaviour(), start, hours=0.5)
    emit_all(emitter, reader, agent, events)
    found = advise(reader, _scope(agent, start, 0.5), SETTINGS)
    assert found == []


# -- cache doctor ------------------------------------------------------------------

def test_cache_doctor_matches_the_cache_vector():
    prices = PriceTable.load()
    calls = [(6000 + 400 * k, 0, 20.0) for k in range(15)]
    uncached = sum(prices.cost("claude-sonnet-4", tokens, 0, 0, 0).cost_usd
                   for tokens, _, _ in calls)
    sums = sums_of_run(calls, 300)
    assert sum(tokens for tokens, _, _ in calls) == 132_000
    assert round(uncached, 4) == 0.396
    assert round(modeled_cost(prices, "claude-sonnet-4", sums, "5m"), 4) == 0.1737
    # the parts: $0.0225 write + $0.0252 reads + $0.126 uncached
    assert (sums.stable_first, sums.stable_in_ttl) == (6000, 84_000)


def test_cache_doctor_prices_ttl_gaps_at_both_ttls():
    prices = PriceTable.load()
    calls = [(6000 + 400 * k, 0, 600.0 if k else 0.0) for k in range(15)]  # 10 min apart
    sums = sums_of_run(calls, 300)
    assert (sums.stable_first, sums.stable_gap_to_1h) == (6000, 84_000)
    five = modeled_cost(prices, "claude-sonnet-4", sums, "5m")
    hour = modeled_cost(prices, "claude-sonnet-4", sums, "1h")
    # 5 min: every call writes again (1.25x); 1 h: one write at 2x, 14 reads
    assert round(five, 6) == round((90_000 * 3.75 + 42_000 * 3) / 1e6, 6)
    assert round(hour, 6) == round((6000 * 6 + 84_000 * 0.3 + 42_000 * 3) / 1e6, 6)


def _expected_cache(events, prices: PriceTable, until: datetime) -> tuple[float, float]:
    """Observed and cached (5 min) spend of the successful model calls before ``until``."""
    runs: dict[str, list] = {}
    for e in events:
        if e.event_type == "llm.call" and e.ts < until and not e.is_error \
                and e.http_status != 429:
            runs.setdefault(e.run_id, []).append(e)
    observed, total = 0.0, CallSums(0, 0, 0, 0, 0, 0)
    for calls in runs.values():
        calls.sort(key=lambda e: e.ts)
        observed += sum(prices.cost(e.model, e.input_tokens, e.output_tokens,
                                    e.cache_read_input_tokens,
                                    e.cache_creation_input_tokens).cost_usd for e in calls)
        gaps = [0.0] + [(b.ts - a.ts).total_seconds() for a, b in itertools.pairwise(calls)]
        run = sums_of_run([(e.input_tokens, e.output_tokens, gap)
                           for e, gap in zip(calls, gaps, strict=True)], 300)
        total = CallSums(*(a + b for a, b in zip(astuple(total), astuple(run), strict=True)))
    return observed, modeled_cost(prices, "claude-sonnet-4", total, "5m")


def test_cache_doctor_on_its_scenario_through_the_stack(emitter, reader, agent):
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=11)
    events = scenario_events(agent, behaviour_of("silent_prompt_cache_miss"), start,
                             hours=0.5)
    emit_all(emitter, reader, agent, events)
    found = [f for f in advise(reader, _scope(agent, start, 0.5), SETTINGS)
             if f.kind == "cache"]
    assert len(found) == 1
    finding = found[0]
    assert (finding.agent, finding.subject) == (agent, "v1")
    observed, cached = _expected_cache(events, PriceTable.load(), start + timedelta(hours=0.5))
    assert finding.evidence["observed_usd"] == pytest.approx(observed, abs=1e-6)
    assert finding.evidence["cached_usd"]["5m"] == pytest.approx(cached, abs=1e-6)
    assert finding.evidence["breaking_part"] == "system"
    later = finding.evidence["later_calls"]
    assert finding.evidence["prefix_changed"] == {"system": later, "tools": 0, "history": 0}
    assert finding.evidence["later_calls_reading_nothing"] == later
    assert finding.recommendation.startswith(
        f"The system prompt changes between calls ({later} of {later} later calls)")
    assert reader.query(finding.query).records()[0]["reading_calls"] == 0


# -- quadratic context ---------------------------------------------------------------

def test_quadratic_projection_matches_the_quad_and_tlog_vectors():
    sonnet = PriceTable.load().models["claude-sonnet-4"]
    assert sonnet == Price(3.0, 15.0)
    # QUAD: 1,500-token system, 300 out, 600-token results: 900 more tokens per step
    assert [round(projected_cost(n, 1500, 900, 300, sonnet), 4) for n in (10, 20, 40, 80)] \
        == [0.2115, 0.6930, 2.4660, 9.2520]
    assert round(projected_cost(80, 1500, 300 + 40, 300, sonnet), 2) == 3.94
    # TLOG: a 50-token digest per 10 steps
    assert [round(compacted_cost(n, 1500, 300, 50, sonnet), 3) for n in (100, 500, 2000, 5000)] \
        == [0.968, 6.338, 47.850, 232.125]


def _expected_quadratic(events, prices: PriceTable, until: datetime, digest: float = 40):
    """Observed and digest-priced spend of the runs whose prefill grows >= 2 x (out +
    digest) per step, fitted as the advisor's SQL fits them."""
    runs: dict[str, list] = {}
    for e in events:
        if e.event_type == "llm.call" and e.ts < until and not e.is_error \
                and e.http_status != 429:
            runs.setdefault(e.run_id, []).append(e)
    observed = digests = 0.0
    flagged = 0
    for calls in runs.values():
        if len(calls) < SETTINGS.quad_min_steps:
            continue
        calls.sort(key=lambda e: (e.ts, str(e.event_id)))
        xs, ys = list(range(len(calls))), [e.input_tokens for e in calls]
        fit = statistics.linear_regression(xs, ys)
        out = statistics.fmean(e.output_tokens for e in calls)
        if fit.slope >= 2 * (out + digest) and statistics.correlation(xs, ys) >= 0.9:
            flagged += 1
            cost = sum(prices.cost(e.model, e.input_tokens, e.output_tokens,
                                   e.cache_read_input_tokens,
                                   e.cache_creation_input_tokens).cost_usd for e in calls)
            observed += cost
            digests += cost - digest_saving(len(calls), fit.slope, out + digest,
                                            prices.models["claude-sonnet-4"])
    return flagged, observed, digests


def test_quadratic_context_on_its_scenario_through_the_stack(emitter, reader, agent):
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=13)
    events = scenario_events(agent, behaviour_of("quadratic_context"), start, hours=0.5)
    emit_all(emitter, reader, agent, events)
    found = [f for f in advise(reader, _scope(agent, start, 0.5), SETTINGS)
             if f.kind == "quadratic_context"]
    assert len(found) == 1
    finding = found[0]
    runs, observed, digests = _expected_quadratic(events, PriceTable.load(),
                                                  start + timedelta(hours=0.5))
    assert runs > 0
    assert (finding.agent, finding.subject) == (agent, "prefill_growth")
    assert finding.evidence["runs"] == runs
    assert finding.evidence["observed_usd"] == pytest.approx(observed, abs=1e-6)
    assert finding.evidence["with_digests_usd"] == pytest.approx(digests, abs=1e-6)
    assert 850 <= finding.evidence["median_slope_tokens_per_step"] <= 950  # 900 scripted
    assert reader.query(finding.query).records()


# -- judge agreement -----------------------------------------------------------------

def test_judge_kappa_matches_the_judge_vector():
    eighty_four = Confusion(both_pass=72, both_fail=12, judge_pass_human_fail=8,
                            judge_fail_human_pass=8)
    assert (eighty_four.agreement, round(eighty_four.chance, 12), eighty_four.kappa) \
        == (0.84, 0.68, 0.5)
    always_pass = Confusion(both_pass=80, both_fail=0, judge_pass_human_fail=20,
                            judge_fail_human_pass=0)
    assert (always_pass.agreement, always_pass.kappa) == (0.8, 0.0)


def test_judge_agreement_on_its_scenario_through_the_stack(emitter, reader, agent):
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=15)
    events = scenario_events(agent, behaviour_of("judge_always_pass"), start, hours=1)
    until = start + timedelta(hours=1)
    # five successful runs only the judge labels, wrong: low-confidence silent failures
    labelled = {e.run_id for e in events if e.event_type == "label"}
    unlabelled = [e for e in events if e.event_type == "run.end" and e.ts < until
                  and e.terminal_reason == "model_done" and e.run_id not in labelled][:5]
    events += [Label(ts=e.ts + timedelta(seconds=30), run_id=e.run_id, agent=agent,
                     model=e.model, task_type=e.task_type, prompt_version=e.prompt_version,
                     deployment=e.deployment, verdict="wrong", label_source="judge")
               for e in unlabelled]
    emit_all(emitter, reader, agent, events)
    found = [f for f in advise(reader, _scope(agent, start, 1), SETTINGS)
             if f.kind == "judge_agreement"]
    assert len(found) == 1
    finding = found[0]
    verdicts: dict[str, dict[str, str]] = {}
    for e in events:
        if e.event_type == "label" and e.ts < until and e.label_source in ("judge", "human"):
            verdicts.setdefault(e.run_id, {})[e.label_source] = e.verdict
    pairs = [v for v in verdicts.values() if len(v) == 2]
    human_fail = sum(v["human"] == "wrong" for v in pairs)
    assert all(v["judge"] == "correct" for v in pairs)
    assert (finding.agent, finding.subject, finding.saving_usd_per_day) == (agent, "judge", None)
    assert finding.evidence["pairs"] == len(pairs)
    assert finding.evidence["kappa"] == 0.0
    assert finding.evidence["confusion"] == {
        "judge_pass": {"human_pass": len(pairs) - human_fail, "human_fail": human_fail},
        "judge_fail": {"human_pass": 0, "human_fail": 0}}
    assert finding.evidence["agreement"] == round((len(pairs) - human_fail) / len(pairs), 4)
    reported = [e.position_flipped for e in events if e.event_type == "label"
                and e.ts < until and e.label_source == "judge"
                and e.position_flipped is not None]
    assert reported and finding.evidence["position_flip_rate"] == round(
        sum(reported) / len(reported), 4)
    low = finding.evidence["low_confidence"]
    assert low["judge_wrong_runs"] == len(unlabelled) == 5
    assert low["silent_failure_ratio_without_judge_wrong"] < low["silent_failure_ratio"]


# -- pipeline candidate --------------------------------------------------------------

def test_pipeline_candidate_matches_the_noagent_vector():
    assert agent_input_tokens(10, 4000, 800) == 76_000
    assert agent_input_tokens(1, 4000, 800) == 4_000
    # 60 choices; the odd run's second and third steps leave the commonest path once
    # (its third step is the only choice in its own context, so it counts as followed)
    assert determinism([["a", "b", "c"]] * 19 + [["a", "c", "b"]])[0] == 59 / 60


def test_pipeline_candidate_on_its_scenario_through_the_stack(emitter, reader, agent):
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=17)
    events = scenario_events(agent, behaviour_of("agent_is_a_pipeline"), start, hours=0.5)
    emit_all(emitter, reader, agent, events)
    found = [f for f in advise(reader, _scope(agent, start, 0.5), SETTINGS)
             if f.kind == "pipeline_candidate"]
    assert len(found) == 1
    finding = found[0]
    until = start + timedelta(hours=0.5)
    runs = {e.run_id for e in events if e.event_type == "tool.call" and e.ts < until}
    assert (finding.agent, finding.subject) == (agent, "support")
    assert finding.evidence["runs"] == len(runs), _stored_paths(reader, agent, events, runs)
    assert finding.evidence["determinism"] == 1.0
    assert finding.evidence["commonest_path"] == ["search", "fetch", "lookup"]
    calls = [e for e in events if e.event_type == "llm.call" and e.ts < until]
    assert finding.evidence["agent_input_tokens"] == sum(e.input_tokens for e in calls)
    # the evidence query counts runs per whole path: runs cut short (by the window's end,
    # or a fate that stops early) keep determinism at 1.0 but have a path of their own
    paths = Counter(tuple(e.tool for e in sorted(
        (e for e in events if e.run_id == run and e.event_type == "tool.call"
         and e.ts < until),
        key=lambda e: e.ts)) for run in runs)
    evidence = reader.query(finding.query).records()
    assert [(list(r["path"]), r["runs"]) for r in evidence][:1] == [
        (list(paths.most_common(1)[0][0]), paths.most_common(1)[0][1])]
    assert sorted(r["runs"] for r in evidence) == sorted(paths.values())


def _stored_paths(reader, agent, events, runs) -> str:
    """What the store holds of the runs the finding missed: the failure's evidence."""
    stored = {r["run_id"]: r for r in reader.query(
        "SELECT run_id, groupUniqArray(task_type) AS types, count() AS n, min(ts) AS lo, "
        "max(ts) AS hi FROM tool_calls FINAL WHERE agent = {a:String} GROUP BY run_id",
        {"a": agent}).records()}
    emitted = {run: [e for e in events if e.run_id == run and e.event_type == "tool.call"]
               for run in runs}
    odd = {run: (len(calls), min(e.ts for e in calls), stored.get(run))
           for run, calls in emitted.items()
           if run not in stored or stored[run]["n"] != len(calls)
           or stored[run]["types"] != ["support"]}
    return f"runs whose stored tool rows differ from the emitted ones: {odd}"


# -- info alerts ---------------------------------------------------------------------

def test_findings_raise_info_alerts_when_new_or_moved_never_paged(local_store):
    """Through the pipeline core into a real chdb database of its own: the first pass
    records the finding as a firing info alert, an unchanged one records nothing, a
    moved one resolves the old alert and fires a new one; the detector engine does not
    take these alerts over (so nothing re-sends them)."""
    from loopwatch.core.config import Settings
    from loopwatch.detectors.advisors.alerting import QueryReader, advisor_pass
    from loopwatch.detectors.engine import DetectorEngine
    from loopwatch.scenarios.scorecard import Simulation
    from loopwatch.scenarios.traffic import Injection
    from loopwatch.store.clickhouse import migrate, run_query

    shared, _ = local_store
    settings = Settings(data_dir=shared.data_dir, database="advice_alerts",
                        apply_retention=False)
    client = migrate(settings)
    simulation = Simulation(client, settings, seed=3)
    start = datetime(2026, 3, 2, tzinfo=UTC)
    low = Injection("support-bot", start, replace(Behaviour(), tool_timeout_ms=330.0))
    simulation.advance(start, start + timedelta(hours=1), timedelta(minutes=30), low,
                       observe=False)
    reader = QueryReader(lambda sql, p: run_query(client, sql, p, readonly=True))
    scope = Scope(start, start + timedelta(hours=1), "support-bot")
    first = advisor_pass(reader, simulation._write, SETTINGS, timedelta(0), scope=scope,
                         now=start + timedelta(hours=1))
    assert sorted((a.rule, a.labels["subject"], a.state, a.severity) for a in first) == [
        ("advisor_timeout", tool, "firing", "info") for tool in ("fetch", "lookup", "search")]
    assert {a.playbook for a in first} == {"timeout_miscalibration"}
    again = advisor_pass(reader, simulation._write, SETTINGS, timedelta(0), scope=scope,
                         now=start + timedelta(hours=1, minutes=5))
    assert again == []
    # the tail moves: the same tools, ten times slower
    slower = Injection("support-bot", start + timedelta(hours=1),
                       replace(Behaviour(), tool_timeout_ms=330.0, tool_median_ms=3000.0))
    simulation.advance(start + timedelta(hours=1), start + timedelta(hours=2),
                       timedelta(minutes=30), slower, observe=False)
    later = Scope(start + timedelta(hours=1), start + timedelta(hours=2), "support-bot")
    moved = advisor_pass(reader, simulation._write, SETTINGS, timedelta(0), scope=later,
                         now=start + timedelta(hours=2))
    assert sorted((a.labels["subject"], a.state) for a in moved) == [
        (tool, state) for tool in ("fetch", "lookup", "search")
        for state in ("firing", "resolved")]
    stored = run_query(client, "SELECT state, count() AS n FROM alerts FINAL "
                       "WHERE rule = 'advisor_timeout' GROUP BY state ORDER BY state").rows
    assert stored == [["firing", 3], ["resolved", 3]]
    engine = DetectorEngine(lambda sql, p: run_query(client, sql, p, readonly=True),
                            simulation._write, rules={})
    assert engine.book.open == {}


# -- where users see it --------------------------------------------------------------

def _advise_cli(pipeline, *arguments: str) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith("LOOPWATCH_")}
    environment["LOOPWATCH_DATA_DIR"] = str(pipeline.data_dir)
    return subprocess.run([sys.executable, "-m", "loopwatch.cli", "advise", *arguments],
                          env=environment, capture_output=True, text=True, timeout=300)


def test_loopwatch_advise_json_through_the_running_up(emitter, reader, agent, pipeline):
    """The command reads the running up's store over its service; findings come sorted
    by saving, in the issue's shape; a hostile --agent is a value, never SQL."""
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=2)
    broken = scenario_events(agent, replace(behaviour_of("silent_prompt_cache_miss"),
                                            tool_timeout_ms=330.0),
                             start + timedelta(hours=0.5), hours=0.5, seed=8)
    # its own prompt version: under v1 with the first half's healthy calls, the share of
    # later calls reading nothing sat at the cache doctor's 50 % line (found or not by luck)
    broken = [e.model_copy(update={"prompt_version": "v2"})
              if getattr(e, "prompt_version", None) else e for e in broken]
    events = [*scenario_events(agent, behaviour_of("timeout_too_low"), start, hours=0.5),
              *broken]
    emit_all(emitter, reader, agent, events)
    result = _advise_cli(pipeline, "--agent", agent, "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    findings = payload["findings"]
    assert {f["kind"] for f in findings} == {"timeout", "cache"}
    assert {f["agent"] for f in findings} == {agent}
    savings = [f["saving_usd_per_day"] for f in findings]
    assert savings == sorted(savings, reverse=True)
    for finding in findings:
        assert list(finding) == ["kind", "agent", "subject", "evidence", "recommendation",
                                 "saving_usd_per_day", "query"]
    table = _advise_cli(pipeline, "--agent", agent)
    assert table.returncode == 0 and "timeout" in table.stdout and "cache" in table.stdout
    hostile = _advise_cli(pipeline, "--agent", f"{agent}' OR 1=1 --", "--json")
    assert hostile.returncode == 0, hostile.stderr
    assert json.loads(hostile.stdout) == {"findings": []}


PLAYBOOK_ADVISORS = {"timeout_miscalibration": "timeout", "silent_prompt_cache_miss": "cache",
                     "retry_storm_permanent_error": "retry_amplification",
                     "cost_spike": "quadratic_context", "quality_degradation": "judge_agreement"}


def test_the_playbooks_that_cover_a_finding_name_its_advisor():
    from loopwatch.detectors.advisors.alerting import PLAYBOOKS
    from loopwatch.detectors.playbooks import load_playbooks

    books = load_playbooks()
    for kind, name in PLAYBOOKS.items():
        steps = " ".join(f"{s.title} {s.why} {s.action or ''}" for s in books[name].steps)
        assert "loopwatch advise" in steps and f"`{kind}`" in steps, (name, kind)
    assert set(PLAYBOOK_ADVISORS) == set(PLAYBOOKS.values())


@pytest.mark.parametrize(("event", "problem"), [
    ({"event_type": "llm.call", "tools_hash": "h" * 129}, "tools_hash"),
    ({"event_type": "llm.call", "history_hash": "h" * 129}, "history_hash"),
    ({"event_type": "run.start", "job_id": "j" * 257}, "job_id"),
    ({"event_type": "run.start", "job_attempt": 0}, "job_attempt"),
])
def test_the_contracts_new_fields_refuse_hostile_values(event, problem):
    """The advisors' contract fields are bounded like the rest: refused at the edge (a
    dead letter in the pipeline), never stored."""
    from pydantic import ValidationError

    from loopwatch.ingest.events import parse_event

    with pytest.raises(ValidationError, match=problem):
        parse_event({"run_id": "r", "agent": "a", **event})
    accepted = parse_event({"run_id": "r", "agent": "a", "event_type": "run.start",
                            "job_id": "x'); DROP TABLE runs; --", "job_attempt": 2})
    assert accepted.job_id == "x'); DROP TABLE runs; --"  # a value; the SQL binds it
