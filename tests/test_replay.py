"""Replay against the real in-process chdb store: scripted runs written through the
engine-free pipeline with their capture rows as docs/capture.md lays them out.

Covers: bodies come back byte for byte in the exact ``--json`` shape (also through the
store service's JSON), a run not decided yet reads from staging, a discarded run says
why, ``diff`` finds the first divergence of each kind, and re-driving a deliberately
changed agent reports its first divergence (strict and lenient), also in record mode.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from loopwatch.cli import app
from loopwatch.ingest.capture import TRUNCATION_MARK
from loopwatch.processors.replay import (
    RecordSession,
    ReplayDivergence,
    ReplayExhausted,
    ReplaySession,
    RunNotFound,
    diff_recordings,
    load_recording,
)
from loopwatch.processors.replay.cli import render_body
from loopwatch.processors.replay.diff import diff_json
from loopwatch.store.reader import DirectReader
from tests.captured import Call, llm, tool, write_run
from tests.conftest import ServiceLikeReader

SYSTEM = "You are a careful weather agent. Use tools; never guess."
# Bodies chosen to catch any re-encoding: escapes, non-ASCII, a lone emoji, key order.
PLAN = {"tool": "weather", "args": {"city": "Tromsø", "units": "°C"}, "why": "asked"}
FORECAST = {"temp_c": -3.5, "sky": "snow ❄", "alerts": [], "zeta": 1, "alpha": None}


def weather_calls(city: str = "Tromsø", forecast: Any = FORECAST,
                  answer: str = "Cold: -3.5 °C and snow ❄.\n\"Wrap up\"\t\\o/") -> list[Call]:
    return [
        llm(0, [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is the weather in {city}?"}],
            {**PLAN, "args": {"city": city, "units": "°C"}}, input_tokens=1200,
            output_tokens=40, latency_ms=812.5),
        tool(1, "weather", {"city": city, "units": "°C"}, forecast, latency_ms=233.0),
        llm(2, f"Summarise for the user: {orjson.dumps(forecast).decode()}", answer,
            input_tokens=1500, output_tokens=60, latency_ms=640.0),
    ]


def weather_agent(llm_call: Any, tool_call: Any, city: str = "Tromsø") -> Any:
    """The agent the weather runs recorded: plan, call the tool, summarise."""
    plan = llm_call([{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": f"What is the weather in {city}?"}])
    found = tool_call(plan["tool"], plan["args"])
    return llm_call(f"Summarise for the user: {orjson.dumps(found).decode()}")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def store(local_store):
    settings, client = local_store
    return settings, client, DirectReader(client)


@pytest.fixture(scope="module")
def kept_run(store):
    """A failed run (crash), kept: its bodies live in capture_parts/capture_blobs."""
    settings, client, _ = store
    run_id, agent = new_id("replay-kept"), new_id("replay-agent")
    calls = weather_calls()
    write_run(client, settings, run_id, agent, calls, terminal_reason="crash")
    return run_id, agent, calls


# --- reading a recording back ---------------------------------------------------------------


def test_replay_returns_every_body_byte_for_byte_in_the_exact_shape(store, kept_run):
    settings, _, reader = store
    run_id, _, calls = kept_run
    expected = {"run_id": run_id, "outcome": "hard_error",
                "steps": [call.expected() for call in calls]}
    recording = load_recording(reader, run_id)
    assert recording.to_json(with_capture=False) == expected
    assert recording.capture.status == "kept" and recording.capture.reason == "failure:hard_error"
    assert recording.capture.parts == 6
    # through the store service's JSON the same values arrive
    assert load_recording(ServiceLikeReader(reader), run_id).to_json() == recording.to_json()
    assert [type(step["cost"]) for step in expected["steps"]] == [float] * 3

    result = CliRunner().invoke(app, ["replay", run_id, "--json",
                                      "--data-dir", str(settings.data_dir)])
    assert result.exit_code == 0, result.output
    capture = {"status": "kept", "reason": "failure:hard_error", "parts": 6,
               "bytes": recording.capture.bytes}
    printed = orjson.dumps({**expected, "capture": capture}).decode() + "\n"
    assert result.stdout == printed  # byte for byte, key order included
    assert "Tromsø" in result.stdout and "❄" in result.stdout


def test_replay_prints_the_trajectory_for_people(store, kept_run):
    settings, _, _ = store
    run_id, agent, _ = kept_run
    result = CliRunner().invoke(app, ["replay", run_id, "--data-dir", str(settings.data_dir)])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert run_id in text and agent in text and "hard_error" in text
    assert "capture: kept (failure:hard_error" in text
    assert "tool weather" in text and "1,200 in / 40 out" in text and "$0.0042" in text
    assert "system: You are a careful weather agent" in text


def test_long_bodies_are_abbreviated_unless_full(store):
    settings, client, reader = store
    run_id = new_id("replay-long")
    history = [{"role": "system", "content": SYSTEM}] + [
        {"role": "user" if i % 2 else "assistant", "content": f"turn {i}"} for i in range(1, 9)]
    long_answer = "x" * 2000 + "THE-END"
    write_run(client, settings, run_id, new_id("replay-agent"),
              [llm(0, history, long_answer)], terminal_reason="crash")
    (step,) = load_recording(reader, run_id).steps
    assert render_body(step.response, full=False) == (
        "x" * 200 + " … [+1607 chars] … " + "x" * 193 + "THE-END")
    assert render_body(step.response, full=True) == long_answer
    short = render_body(step.prompt, full=False).splitlines()
    assert short == [f"system: {SYSTEM}", "… 4 more messages (--full shows them) …",
                     "user: turn 5", "assistant: turn 6", "user: turn 7", "assistant: turn 8"]
    assert len(render_body(step.prompt, full=True).splitlines()) == 9
    for flags in ([], ["--full"]):
        result = CliRunner().invoke(app, ["replay", run_id, *flags,
                                          "--data-dir", str(settings.data_dir)])
        assert result.exit_code == 0 and ("more messages" in result.stdout) == (not flags)


def test_a_run_not_decided_yet_reads_its_bodies_from_staging(store):
    settings, client, reader = store
    closed, open_run = new_id("replay-pending"), new_id("replay-open")
    agent = new_id("replay-agent")
    calls = weather_calls(city="Oslo")
    write_run(client, settings, closed, agent, calls, capture="pending")
    write_run(client, settings, open_run, agent, calls[:2], terminal_reason=None,
              capture="pending")
    recording = load_recording(reader, closed)
    assert recording.outcome == "success" and recording.capture.status == "pending"
    assert recording.capture.reason == "not decided yet (successes wait for the label window)"
    assert recording.to_json(with_capture=False)["steps"] == [c.expected() for c in calls]
    running = load_recording(reader, open_run)
    assert running.outcome == "running" and running.status == "running"
    assert running.capture.reason == "run still open: not decided yet"
    assert [step.output for step in running.steps] == [None, FORECAST]


def test_a_discarded_run_has_no_bodies_and_says_why(store):
    settings, client, reader = store
    run_id = new_id("replay-discarded")
    write_run(client, settings, run_id, new_id("replay-agent"), weather_calls(),
              capture="discarded")
    recording = load_recording(reader, run_id)
    assert recording.capture.status == "discarded"
    assert recording.capture.reason == "not kept: success_not_sampled"
    assert [(s.type, s.tool, s.prompt, s.response, s.args, s.output)
            for s in recording.steps] == [("llm", None, None, None, None, None),
                                          ("tool", "weather", None, None, None, None),
                                          ("llm", None, None, None, None, None)]
    assert [s.tokens["input"] for s in recording.steps] == [1200, 0, 1500]
    with pytest.raises(ValueError, match="no captured bodies"):
        ReplaySession(recording)
    result = CliRunner().invoke(app, ["replay", run_id, "--data-dir", str(settings.data_dir)])
    assert "capture: discarded (not kept: success_not_sampled" in result.stdout


def test_a_truncated_part_is_flagged_and_still_matches_on_re_drive(store):
    settings, client, reader = store
    run_id = new_id("replay-truncated")
    query = {"q": "select " + "c" * 2000}
    big = {"rows": ["r" * 100] * 30}
    write_run(client, settings, run_id, new_id("replay-agent"),
              [tool(0, "sql", query, big)], terminal_reason="crash", max_part_bytes=1024)
    (step,) = load_recording(reader, run_id).steps
    assert step.truncated == ("args", "output") and step.output.endswith(TRUNCATION_MARK)
    assert len(step.output.encode()) == 1024 + len(TRUNCATION_MARK.encode())
    session = ReplaySession.load(reader, run_id)
    assert session.tool("sql", query) == step.output  # the full arguments match the cut ones
    assert session.finish() == []
    other = ReplaySession.load(reader, run_id)
    with pytest.raises(ReplayDivergence, match="tool input differs"):
        other.tool("sql", {"q": "select *"})


def test_an_unknown_run_is_a_clear_error_with_exit_code_2(store, kept_run):
    settings, _, reader = store
    with pytest.raises(RunNotFound, match="no run 'no-such-run'"):
        load_recording(reader, "no-such-run")
    for args in (["replay", "no-such-run"], ["diff", kept_run[0], "no-such-run"]):
        result = CliRunner().invoke(app, [*args, "--data-dir", str(settings.data_dir)])
        assert result.exit_code == 2 and "no run 'no-such-run' in the store" in result.output


# --- diff -----------------------------------------------------------------------------------

OTHER_FORECAST = {**FORECAST, "temp_c": 4.0}
VARIANTS: dict[str, tuple[list[Call], list[tuple[int, str, Any, Any]]]] = {
    "same": (weather_calls(), []),
    "tool_name": ([*weather_calls()[:1], tool(1, "forecast", {"city": "Tromsø", "units": "°C"},
                                                FORECAST, latency_ms=233.0),
                   weather_calls()[2]],
                  [(1, "tool_name", "weather", "forecast")]),
    "tool_input": ([*weather_calls()[:1], tool(1, "weather", {"city": "Oslo", "units": "°C"},
                                                 FORECAST), weather_calls()[2]],
                   [(1, "tool_input", {"city": "Tromsø", "units": "°C"},
                     {"city": "Oslo", "units": "°C"})]),
    # the world moved: the same call returns something else, and the next prompt follows
    "tool_output": (weather_calls(forecast=OTHER_FORECAST),
                    [(1, "tool_output", FORECAST, OTHER_FORECAST),
                     (2, "prompt", weather_calls()[2].prompt,
                      weather_calls(forecast=OTHER_FORECAST)[2].prompt)]),
    "response": (weather_calls(answer="Mild."),
                 [(2, "response", weather_calls()[2].response, "Mild.")]),
    "prompt": ([llm(0, "What is the weather?", weather_calls()[0].response),
                *weather_calls()[1:]],
               [(0, "prompt", weather_calls()[0].prompt, "What is the weather?")]),
    "missing_step": (weather_calls()[:2],
                     [(2, "missing_step", {"type": "llm", "tool": None, "step": 2}, None)]),
    "extra_step": ([*weather_calls(), tool(3, "notify", {"to": "ops"}, "sent")],
                   [(3, "extra_step", None, {"type": "tool", "tool": "notify", "step": 3})]),
}


@pytest.fixture(scope="module")
def variant_runs(store):
    """The reference run A and one run B per divergence kind, all kept (failed)."""
    settings, client, _ = store
    agent = new_id("replay-diff")
    reference = new_id("diff-a")
    write_run(client, settings, reference, agent, weather_calls(), terminal_reason="crash")
    runs = {}
    for name, (calls, _) in VARIANTS.items():
        runs[name] = new_id(f"diff-{name}")
        write_run(client, settings, runs[name], agent, calls, terminal_reason="crash")
    return reference, runs


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_diff_finds_the_first_divergence_of_each_kind(store, variant_runs, kind):
    _, _, reader = store
    reference, runs = variant_runs
    a, b = load_recording(reader, reference), load_recording(reader, runs[kind])
    found = [(d.index, d.kind, d.a, d.b) for d in diff_recordings(a, b)]
    assert found == VARIANTS[kind][1]


def test_diff_command_prints_the_first_divergence_and_lists_all(store, variant_runs):
    settings, _, reader = store
    reference, runs = variant_runs
    args = ["diff", reference, runs["tool_output"], "--data-dir", str(settings.data_dir)]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    body = orjson.loads(result.stdout)
    assert body == diff_json(load_recording(reader, reference),
                             load_recording(reader, runs["tool_output"]))
    assert body["first"] == {"index": 1, "kind": "tool_output", "step_a": 1, "step_b": 1,
                             "a": FORECAST, "b": OTHER_FORECAST}
    assert [d["kind"] for d in body["divergences"]] == ["tool_output", "prompt"]
    assert body["compared"] == "bodies" and body["steps_a"] == body["steps_b"] == 3
    text = CliRunner().invoke(app, args).stdout
    assert "first divergence: step #1: tool output differs" in text and "then 1 more" in text
    same = CliRunner().invoke(app, ["diff", reference, runs["same"],
                                    "--data-dir", str(settings.data_dir)])
    assert "no divergence" in same.stdout


# --- re-driving agent code ------------------------------------------------------------------


def test_re_driving_the_unchanged_agent_returns_the_recorded_answers(store, kept_run):
    _, _, reader = store
    run_id, _, calls = kept_run
    with ReplaySession.load(reader, run_id) as session:
        assert weather_agent(session.llm, session.tool) == calls[2].response
    assert session.divergences == [] and session.remaining == 0


def test_re_driving_a_changed_agent_reports_the_first_divergence_strictly(store, kept_run):
    _, _, reader = store
    run_id, _, _ = kept_run
    session = ReplaySession.load(reader, run_id)
    with pytest.raises(ReplayDivergence) as raised:
        weather_agent(session.llm, session.tool, city="Bergen")  # the changed agent
    divergence = raised.value.divergence
    assert (divergence.index, divergence.kind) == (0, "prompt")
    assert divergence.a[1] == {"role": "user", "content": "What is the weather in Tromsø?"}
    assert divergence.b[1] == {"role": "user", "content": "What is the weather in Bergen?"}
    assert str(raised.value).startswith("step #0: prompt differs: expected [")


def test_re_driving_leniently_lists_every_divergence(store, kept_run):
    _, _, reader = store
    run_id, _, calls = kept_run

    def changed(llm_call: Any, tool_call: Any) -> Any:
        plan = llm_call(calls[0].prompt)
        tool_call("forecast", plan["args"])  # renamed tool
        tool_call("notify", {"to": "ops"})  # where the recording has its summary
        return llm_call("anything else?")  # a call the recording does not have

    session = ReplaySession.load(reader, run_id, strict=False)
    with pytest.raises(ReplayExhausted) as raised:
        changed(session.llm, session.tool)
    assert str(raised.value) == ("step #3: the recording has no more steps; the agent made "
                                 "an extra llm call")
    assert [(d.index, d.kind, d.a, d.b) for d in session.divergences] == [
        (1, "tool_name", "weather", "forecast"),
        (2, "tool_name", None, "notify"),
        (3, "extra_step", None, "llm call")]

    fewer = ReplaySession.load(reader, run_id, strict=False)
    plan = fewer.llm(calls[0].prompt)
    assert plan == calls[0].response
    assert [(d.index, d.kind) for d in fewer.finish()] == [(1, "missing_step"),
                                                           (2, "missing_step")]
    strict = ReplaySession.load(reader, run_id)
    strict.llm(calls[0].prompt)
    with pytest.raises(ReplayDivergence, match=r"step #1: the agent stopped; the recording "
                                               r"still has tool call to weather"):
        strict.finish()


def test_record_mode_diffs_a_live_session_against_the_stored_run(store, kept_run):
    _, _, reader = store
    run_id, _, calls = kept_run
    stored = load_recording(reader, run_id)

    def live_llm(prompt: Any) -> Any:  # a deterministic stand-in for the model
        return calls[0].response if isinstance(prompt, list) else "It is mild."

    def live_tool(name: str, args: Any) -> Any:  # the world moved: warmer now
        return OTHER_FORECAST

    recorder = RecordSession(llm=live_llm, tool=live_tool)
    assert weather_agent(recorder.llm, recorder.tool) == "It is mild."
    assert [(d.index, d.kind) for d in recorder.diff(stored)] == [(1, "tool_output"),
                                                                  (2, "response")]
    # the live session replays itself exactly
    again = ReplaySession(recorder.recording)
    assert weather_agent(again.llm, again.tool) == "It is mild." and again.finish() == []


# --- end to end: SDK -> broker -> loopwatch up -> decided -> loopwatch replay ----------------


def test_a_run_sent_through_the_sdk_replays_exactly_as_sent(broker, pipeline, reader, agent,
                                                           tmp_path):
    """The capture half and the replay half together: a failing run emitted with its
    bodies comes back from ``loopwatch replay --json`` (through the running ``up``)
    equal to what the agent sent, once the decider has kept it."""
    from loopwatch.ingest.sdk import Emitter
    from tests.captured import MODEL
    from tests.conftest import wait_for

    calls = weather_calls()
    with Emitter(broker.bootstrap, spool_dir=tmp_path / "spool") as emitter:
        with emitter.run(agent=agent, model=MODEL, task_type="replay-e2e") as run:
            run.step()
            for call in calls:
                if call.type == "llm":
                    run.llm_call(prompt=call.prompt, response=call.response, step=call.step,
                                 provider="anthropic", input_tokens=call.input_tokens,
                                 output_tokens=call.output_tokens, latency_ms=call.latency_ms)
                else:
                    assert call.tool is not None
                    run.tool_call(call.tool, args=call.args, output=call.output,
                                  step=call.step, latency_ms=call.latency_ms)
            run.end("crash", error_type="WeatherDown")
        assert emitter.flush()
    run_id = run.run_id
    wait_for(lambda: reader.query(
        "SELECT keep FROM capture_decisions FINAL WHERE run_id = {r:String}",
        {"r": run_id}).scalar() == 1, 120, what=f"run {run_id} captured and kept")
    wait_for(lambda: reader.query(
        "SELECT count() FROM capture_parts FINAL WHERE run_id = {r:String}",
        {"r": run_id}).scalar() == 6, 60, what="its six parts kept")
    result = CliRunner().invoke(app, ["replay", run_id, "--json",
                                      "--data-dir", str(pipeline.data_dir)])
    assert result.exit_code == 0, result.output
    body = orjson.loads(result.stdout)
    assert body.pop("capture")["status"] == "kept"
    assert body == {"run_id": run_id, "outcome": "hard_error",
                    "steps": [call.expected() for call in calls]}
    # and the stored run re-drives the agent that produced it
    with ReplaySession.load(reader, run_id) as session:
        assert weather_agent(session.llm, session.tool) == calls[2].response


# --- alerts link to the replay of the runs they name -----------------------------------------


def test_alert_evidence_links_to_the_replay_of_every_run_it_names(store, kept_run):
    from datetime import UTC, datetime

    from loopwatch.detectors.alerts import REPLAY_EVIDENCE, Alert
    from loopwatch.detectors.engine import DetectorEngine, Policy

    settings, client, reader = store
    run_id, agent, calls = kept_run
    other = new_id("replay-other")
    write_run(client, settings, other, agent, calls[:1], terminal_reason="crash")
    engine = DetectorEngine(
        reader.query, lambda table, rows: None,
        policy=Policy(link_base_url="http://lw.example:8765/"),
        playbook_steps=lambda name: [(
            "Failed runs of the agent",
            "SELECT outcome, run_id FROM runs FINAL WHERE agent = {agent:String} "
            "ORDER BY run_id = {run_id:String} DESC, run_id")])
    now = datetime.now(UTC)
    alert = Alert(fingerprint="f", rule="stuck_run", severity="warning",
                  labels={"agent": agent, "run_id": run_id}, playbook="runaway_run",
                  summary="s", value=1.0, state="firing", started_at=now)
    enriched = engine._with_evidence(alert, now)
    assert enriched.evidence[REPLAY_EVIDENCE] == {
        "columns": ["run_id", "replay", "command"],
        "rows": [[run_id, f"http://lw.example:8765/#/replay/{run_id}",
                  f"loopwatch replay {run_id}"],
                 [other, f"http://lw.example:8765/#/replay/{other}",
                  f"loopwatch replay {other}"]]}
    assert enriched.link == f"http://lw.example:8765/runs/{run_id}"
    # an agent-level alert names its runs through its evidence alone
    agent_alert = Alert(fingerprint="g", rule="stuck_run", severity="warning",
                        labels={"agent": agent}, playbook="runaway_run", summary="s",
                        value=1.0, state="firing", started_at=now)
    rows = engine._with_evidence(agent_alert, now).evidence[REPLAY_EVIDENCE]["rows"]
    assert sorted(row[0] for row in rows) == sorted([run_id, other])
