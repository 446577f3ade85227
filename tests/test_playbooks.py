"""The incident playbooks (``detectors/playbooks/*.toml``): they load, route only the alert
rules the rules engine defines, and every SQL step runs against the real schema in chdb.

Each playbook gets a scripted incident under its own agent name, fed through the real
engine-free pipeline (events -> Pipeline -> ClickHouseSink) into the session's in-process
store, and its key investigation steps must return exactly the offending runs, tools,
versions and buckets.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from loopwatch.detectors.playbooks import (
    PARAMETERS,
    SEVERITIES,
    Playbook,
    PlaybookError,
    load_playbooks,
    parse_playbook,
    render_markdown,
    routing,
)
from loopwatch.detectors.rules import load_rules
from loopwatch.ingest.events import (
    Annotation,
    EventBase,
    Label,
    LlmCall,
    RunEnd,
    RunStart,
    Step,
    ToolCall,
)
from loopwatch.ingest.wire import encode_envelope
from loopwatch.processors.jobs.reprocess import MemoryRunStore
from loopwatch.processors.pipeline import Pipeline, RawMessage
from loopwatch.store.clickhouse import run_query
from loopwatch.store.sink import ClickHouseSink

RULES = load_rules()
ALERT_RULES = frozenset(RULES)
PLAYBOOKS = {
    "agent_stuck_in_loop", "hallucination_spike", "cost_spike", "quality_degradation",
    "upstream_tool_outage", "retry_storm_permanent_error", "rate_limit_storm",
    "timeout_miscalibration", "silent_failures_loop_drift", "silent_prompt_cache_miss",
    "pipeline_health",
}
BASE_TABLES = ("events", "llm_calls", "tool_calls", "runs", "labels", "annotations",
               "dead_letters")

T0 = datetime(2027, 3, 1, 10, 0, tzinfo=UTC)  # the incident window is [T0, T0 + 1h)
SINCE, UNTIL = T0, T0 + timedelta(hours=1)
MODEL = "claude-sonnet-4"  # $3 per million input tokens in processors/prices.json


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def naive(moment: datetime) -> datetime:
    """chdb returns DateTime64 values as naive UTC datetimes."""
    return moment.replace(tzinfo=None)


# --- the playbooks as data -------------------------------------------------------------


@pytest.fixture(scope="module")
def books() -> dict[str, Playbook]:
    return load_playbooks()


def test_the_ten_incident_playbooks_and_pipeline_health_exist(books):
    assert set(books) == PLAYBOOKS


def test_every_playbook_is_complete(books):
    for name, book in books.items():
        assert book.name == name
        assert book.severity in SEVERITIES, name
        assert len(book.steps) >= 3, name
        assert len(book.sql_steps) >= 1, name
        assert book.symptoms and book.mitigation and book.prevention and book.source, name
        assert book.alerts, name  # some rule routes to it
        assert set(book.alerts) <= ALERT_RULES, (name, set(book.alerts) - ALERT_RULES)
        for step in book.steps:
            assert step.sql or step.action, (name, step.title)
            assert step.why.endswith((".", ")", "'")), (name, step.title, step.why)


def test_severities_follow_the_seed(books):
    assert books["hallucination_spike"].severity == "critical"  # P1
    assert books["upstream_tool_outage"].severity == "critical"  # P1-P3 by tool criticality
    assert "P1-P3" in (books["upstream_tool_outage"].severity_note or "")
    for name in ("agent_stuck_in_loop", "cost_spike", "quality_degradation"):  # P2
        assert books[name].severity == "warning"


def test_rules_and_playbooks_route_to_each_other(books):
    """One routing, stated once by the rules (``rule.playbook``) and derived for the
    playbooks (``playbook.alerts``, in the rules' order), seen from both sides."""
    for rule in RULES.values():
        assert rule.name in books[rule.playbook].alerts, (rule.name, rule.playbook)
    for book in books.values():
        for alert in book.alerts:
            assert RULES[alert].playbook == book.name, (book.name, alert)
    assert books["agent_stuck_in_loop"].alerts == ("stuck_run", "loop_rate_critical",
                                                  "loop_rate_warning")
    assert routing(RULES.values()) == {name: book.alerts for name, book in books.items()}


def test_a_rule_routed_to_a_missing_playbook_stops_the_load():
    import dataclasses

    stray = dataclasses.replace(RULES["stuck_run"], name="stray", playbook="no_such_book")
    stray_route = re.escape("do not exist: {'no_such_book': ('stray',)}")
    with pytest.raises(PlaybookError, match=stray_route):
        load_playbooks([*RULES.values(), stray])
    assert load_playbooks(RULES.values()) == load_playbooks()


def test_sql_is_read_only_reads_base_tables_with_final_and_filters_agents(books):
    table_ref = re.compile(r"\b(?:FROM|JOIN)\s+(\w+)(\s+AS\s+\w+)?(\s+FINAL)?", re.IGNORECASE)
    for name, book in books.items():
        for step in book.sql_steps:
            assert step.sql is not None
            where = (name, step.title)
            assert set(step.parameters) <= set(PARAMETERS), where
            for table, _alias, final in table_ref.findall(step.sql):
                if table in BASE_TABLES:
                    assert final, (*where, table)
            if "agent" in step.parameters:
                assert "({agent:String} = '' OR agent = {agent:String}" in step.sql, where
            assert not re.search(r"\b(INSERT|ALTER|DROP|TRUNCATE|OPTIMIZE)\b", step.sql), where
            if re.search(r"\bLIMIT\s+\d+", step.sql) is None:  # else it must aggregate
                assert "GROUP BY" in step.sql or "count()" in step.sql, where


def test_render_markdown_shows_every_step_and_its_sql(books):
    for book in books.values():
        text = render_markdown(book)
        assert text.startswith(f"# {book.title} (`{book.name}`)\n")
        for step in book.steps:
            assert step.title in text
            assert step.sql is None or step.sql in text
            assert step.action is None or step.action in text


VALID = """
name = "demo"
title = "Demo"
severity = "warning"
source = ["seed"]
summary = "s"
symptoms = ["x"]
mitigation = ["m"]
prevention = ["p"]

[[steps]]
title = "t"
why = "w."
sql = "SELECT 1 WHERE run_id = {run_id:String}"
"""


def test_a_valid_playbook_parses():
    book = parse_playbook(VALID, "demo.toml", expected_name="demo")
    assert book.steps[0].parameters == ("run_id",)
    assert book.parameters == ("run_id",)


@pytest.mark.parametrize(("broken", "message"), [
    (VALID.replace('"warning"', '"P2"'), "severity 'P2' is not one of"),
    (VALID.replace('name = "demo"', 'name = "other"'), "must match the file name"),
    (VALID.replace("{run_id:String}", "{customer:String}"), "unknown parameter {customer}"),
    (VALID.replace("{run_id:String}", "{run_id:UInt64}"), "expected {run_id:String}"),
    (VALID.replace('sql = "SELECT 1', 'sql = "DELETE FROM runs'), "read-only SELECT"),
    (VALID.replace('sql = "SELECT 1 WHERE run_id = {run_id:String}"', ""), "needs `sql` or"),
    (VALID.replace('mitigation = ["m"]', "") + 'mitigation = ["m"]\n', "write top-level keys"),
    (VALID.replace("summary", "sumary"), "unknown field(s) ['sumary']"),
    (VALID.replace('mitigation = ["m"]', 'alerts = ["stuck_run"]\nmitigation = ["m"]'),
     "a playbook does not list its alerts: each rule names its playbook"),
    (VALID.replace("SELECT 1 WHERE", "SELECT {{ ratio nope }} WHERE"),
     "steps[0].sql: '{{ ratio nope }}': no metric 'nope'"),
    (VALID.replace('symptoms = ["x"]', "symptoms = []"), "symptoms must be a non-empty list"),
    ("name = ", "not valid TOML"),
])
def test_errors_name_the_file_and_the_problem(broken, message):
    with pytest.raises(PlaybookError) as caught:
        parse_playbook(broken, "detectors/playbooks/demo.toml", expected_name="demo")
    assert str(caught.value).startswith("detectors/playbooks/demo.toml: ")
    assert message in str(caught.value)


# --- scripted incidents ----------------------------------------------------------------


@dataclass(frozen=True)
class Fleet:
    client: Any
    prefix: str

    def agent(self, scenario: str) -> str:
        return f"{self.prefix}-{scenario}"

    def run_id(self, scenario: str, name: str) -> str:
        return f"{self.prefix}-{scenario}-{name}"


class Script:
    """Builds one scenario's events with a shared envelope (agent, model, ...)."""

    def __init__(self, fleet: Fleet, scenario: str) -> None:
        self.fleet, self.scenario = fleet, scenario
        self.agent = fleet.agent(scenario)
        self.events: list[EventBase] = []

    def run(self, name: str, **envelope: Any) -> Run:
        return Run(self, self.fleet.run_id(self.scenario, name),
                   {"agent": self.agent, "model": MODEL, **envelope})

    def annotate(self, seconds: float, **fields: Any) -> None:
        self.events.append(Annotation(ts=at(seconds), agent=self.agent, **fields))


class Run:
    def __init__(self, script: Script, run_id: str, envelope: dict[str, Any]) -> None:
        self.script, self.run_id, self.envelope = script, run_id, envelope

    def add(self, kind: type[EventBase], seconds: float, **fields: Any) -> Run:
        self.script.events.append(kind(ts=at(seconds), run_id=self.run_id,
                                       **{**self.envelope, **fields}))
        return self

    def start(self, seconds: float = 0) -> Run:
        return self.add(RunStart, seconds)

    def end(self, seconds: float, reason: str = "model_done", **fields: Any) -> Run:
        return self.add(RunEnd, seconds, terminal_reason=reason, **fields)

    def tool(self, seconds: float, tool: str, args: str = "a", **fields: Any) -> Run:
        return self.add(ToolCall, seconds, tool=tool, args_hash=args, **fields)

    def llm(self, seconds: float, **fields: Any) -> Run:
        return self.add(LlmCall, seconds, provider="anthropic", **fields)

    def label(self, seconds: float, verdict: str = "correct", **fields: Any) -> Run:
        return self.add(Label, seconds, verdict=verdict, **fields)


def loop_incident(script: Script) -> None:
    """A running run calling search_docs with the same arguments 4 times (plus one other
    call), a long running run with 22 steps and no tools, and a healthy run."""
    script.annotate(-600, kind="prompt_change", old_value="p1", new_value="p2", actor="ci")
    looping = script.run("loop", prompt_version="p2", worker_id="w1").start()
    for step in range(4):
        looping.add(Step, 10 + step * 10, step=step)
        looping.tool(11 + step * 10, "search_docs", "h-loop", step=step, http_status=200,
                     result_count=0, latency_ms=100)
    looping.tool(60, "read_file", "h-other", step=4, result_count=1)
    looping.llm(61, input_tokens=100_000, system_prompt_hash="sp1")  # $0.30
    long = script.run("long", prompt_version="p1", worker_id="w2").start()
    for step in range(22):
        long.add(Step, 1 + step, step=step)
    script.run("ok", prompt_version="p1").start().tool(5, "search_docs", "h-ok").end(6)


def hallucination_incident(script: Script) -> None:
    """Ten labelled runs; the four on the new model snapshot got empty search results and
    three of them were flagged as hallucinated, all in the 10:10 bucket."""
    script.annotate(5, kind="model_change", model=MODEL, old_value="claude-sonnet-4-20270101",
                    new_value="claude-sonnet-4-20270215", actor="provider")
    for index in range(10):
        new = index >= 6
        flagged = index in (6, 7, 8)
        run = script.run(f"r{index}", prompt_version="p1").start(index)
        run.llm(index + 1, input_tokens=1000,
                response_model="claude-sonnet-4-20270215" if new else "claude-sonnet-4-20270101")
        run.tool(index + 2, "kb_search", f"q{index}", result_count=0 if flagged else 5)
        run.end(index + 3)
        run.label(720 + index if new else 120 + index, "wrong" if flagged else "correct",
                  hallucination=flagged)


def cost_incident(script: Script) -> None:
    """Two cheap runs three days before; in the window, one run spends $9.30 and hits its
    cost cap, three normal runs spend $0.30 each while 'fetch' returns 5x larger results."""
    for index in range(2):
        run = script.run(f"base{index}").start(-3 * 86400 + index)
        run.llm(-3 * 86400 + index + 1, input_tokens=100_000)
        run.tool(-3 * 86400 + index + 2, "fetch", result_size_bytes=1000)
        run.end(-3 * 86400 + index + 3)
    big = script.run("big").start(0)
    for step, tokens in enumerate((1_000_000, 2_000_000, 100_000)):  # $3, $6, $0.30
        big.llm(1 + step, step=step, input_tokens=tokens)
    big.end(10, "cap", cap="cost")
    for index in range(3):
        run = script.run(f"n{index}").start(20 + index)
        run.llm(25 + index, step=0, input_tokens=100_000)
        run.tool(30 + index, "fetch", f"n{index}", result_size_bytes=5000)
        run.end(40 + index)


def quality_incident(script: Script) -> None:
    """Quality 0.9 three days before on snapshot v1; 0.6 in the window on snapshot v2, on
    a worker whose 'kb' calls time out."""
    script.annotate(-1800, kind="model_change", old_value="m-v1", new_value="m-v2")
    for index in range(4):
        run = script.run(f"base{index}", worker_id="w-ok").start(-3 * 86400 + index)
        run.llm(-3 * 86400 + index + 1, output_tokens=400, response_model="m-v1")
        run.end(-3 * 86400 + index + 2).label(-3 * 86400 + index + 60, quality_score=0.9)
    for index in range(4):
        run = script.run(f"now{index}", worker_id="w-hot").start(index)
        run.llm(index + 1, output_tokens=100, response_model="m-v2")
        run.tool(index + 2, "kb", f"q{index}", timed_out=index < 2, timeout_ms=1000,
                 latency_ms=1000 if index < 2 else 100)
        run.end(index + 3).label(300 + index, quality_score=0.6)


def outage_incident(script: Script) -> None:
    """crm_api fails: 503s, timeouts from one worker, and a run with 401s; weather is fine,
    and one LLM call gets a 500."""
    calls = {
        "o0": ("crash", [503, 503]), "o1": ("crash", [503, 503]),
        "o2": ("cannot_complete", [503, 503]), "o3": ("cannot_complete", ["timeout"] * 2),
        "o4": ("model_done", [200, 200]), "o5": ("crash", [401, 401]),
    }
    for index, (name, (reason, results)) in enumerate(calls.items()):
        run = script.run(name, task_type="support",
                         worker_id="w-net" if name == "o3" else "w1").start(60 + index * 5)
        for call, result in enumerate(results):
            seconds = 61 + index * 5 + call
            if result == "timeout":
                run.tool(seconds, "crm_api", f"{name}-{call}", timed_out=True,
                         error_type="timeout", timeout_ms=5000, latency_ms=5000)
            elif result == 200:
                run.tool(seconds, "crm_api", f"{name}-{call}", http_status=200)
            else:
                run.tool(seconds, "crm_api", f"{name}-{call}", http_status=result,
                         error_type="auth" if result == 401 else "http_503")
        run.end(63 + index * 5, reason)
    for name in ("o6", "o7"):
        run = script.run(name, task_type="support").start(100)
        run.tool(101, "weather", f"{name}-0").tool(102, "weather", f"{name}-1")
        if name == "o6":
            run.llm(103, http_status=500, error_type="server_error").llm(104)
        run.end(105)


def retry_incident(script: Script) -> None:
    """PM400 in small: 'enrich' returns 400 for record 42 on all 5 attempts, in two runs
    (the job re-queued it) while the model re-plans 3 times; record 7 recovers from a 503."""
    script.annotate(-900, kind="tool_deploy", old_value="enrich 1.4", new_value="enrich 1.5",
                    actor="enrichment-team", message="field segment is now required")
    for name, worker in (("p0", "w1"), ("p1", "w2")):
        run = script.run(name, worker_id=worker).start(0)
        for attempt in range(1, 6):
            run.tool(attempt, "enrich", "rec-42", attempt=attempt, http_status=400,
                     error_type="bad_request")
        if name == "p0":
            for attempt in range(1, 4):
                run.llm(10 + attempt, logical_op_id="op-42", attempt=attempt,
                        input_tokens=100_000)
        run.end(20, "crash")
    run = script.run("p2", worker_id="w1").start(0)
    run.tool(1, "enrich", "rec-7", attempt=1, http_status=503, error_type="http_503")
    run.tool(2, "enrich", "rec-7", attempt=2, http_status=200).end(3)


def rate_limit_incident(script: Script) -> None:
    """q0 retries 2 s after a 'Retry-After: 17' and gets a second 429, then waits and
    succeeds but the run still crashes; q1 honors its Retry-After; q2's model calls are
    unaffected, its search tool answers one 429 and the retry succeeds."""
    q0 = script.run("q0").start(0)
    q0.llm(0, logical_op_id="op-1", attempt=1, http_status=429, error_type="rate_limited",
           retry_after_s=17)
    q0.llm(2, logical_op_id="op-1", attempt=2, http_status=429, error_type="rate_limited",
           retry_after_s=17)
    q0.llm(20, logical_op_id="op-1", attempt=3, http_status=200).end(21, "crash")
    q1 = script.run("q1").start(4)
    q1.llm(5, logical_op_id="op-2", attempt=1, http_status=429, error_type="rate_limited",
           retry_after_s=10)
    q1.llm(16, logical_op_id="op-2", attempt=2, http_status=200).end(17)
    script.run("q2").start(29).llm(30, logical_op_id="op-3").llm(40, logical_op_id="op-4") \
        .tool(41, "search", attempt=1, http_status=429, error_type="rate_limited") \
        .tool(45, "search", attempt=2)


TIMEOUT_CALLS: list[tuple[str, int, bool, float, float | None]] = [
    # (args, attempt, timed_out, latency_ms, late_completion_ms) for slow_api, T = 1000 ms
    ("a1", 1, True, 1000, 1200), ("a1", 2, False, 200, None),
    ("a2", 1, True, 1000, 1200), ("a2", 2, False, 200, None),
    ("a3", 1, True, 1000, 5000), ("a3", 2, True, 1000, None),
    ("a4", 1, False, 200, None), ("a5", 1, False, 700, None), ("a6", 1, False, 900, None),
]


def timeout_incident(script: Script) -> None:
    """slow_api's timeout was lowered from 5 s to 1 s ten days ago; its calls now take up
    to 1.2 s, so two of its four timeouts are near misses."""
    script.annotate(-10 * 86400, kind="threshold_change", old_value="slow_api timeout 5000ms",
                    new_value="slow_api timeout 1000ms", actor="ops")
    run = script.run("t0").start(0)
    for index, (args, attempt, timed_out, latency, late) in enumerate(TIMEOUT_CALLS):
        run.tool(1 + index, "slow_api", args, attempt=attempt, timed_out=timed_out,
                 timeout_ms=1000, latency_ms=latency, late_completion_ms=late,
                 error_type="timeout" if timed_out else None)
    run.end(20)


def silent_incident(script: Script) -> None:
    """Eight runs of one version: one looped while alternating two greps until the step
    cap, one gave up, one hit its token cap, one crashed after two tool faults, one
    'success' was labelled wrong, one was verified correct, two are unverified."""
    script.run("s0", prompt_version="p1").start(0).tool(1, "read", "x").tool(2, "edit", "y") \
        .end(3)
    s1 = script.run("s1", prompt_version="p1").start(10)
    for index in range(8):
        s1.tool(11 + index, "grep", "discount" if index % 2 else "-i discount", step=index)
    s1.end(20, "cap", cap="step")
    script.run("s2", prompt_version="p1").start(30).end(31, "cannot_complete")
    script.run("s3", prompt_version="p1").start(40).tool(41, "read", "z").end(42, "cap",
                                                                             cap="token")
    s4 = script.run("s4", prompt_version="p1").start(50)
    s4.tool(51, "read", "ok", step=0).tool(52, "run_tests", "1", step=1, error_type="exit_1")
    s4.tool(53, "run_tests", "2", step=2, error_type="exit_1").end(54, "crash")
    script.run("s5", prompt_version="p1").start(60).end(61).label(300, "wrong")
    script.run("s6", prompt_version="p1").start(70).end(71).label(300, "correct")
    script.run("s7", prompt_version="p1").start(80).end(81)


def cache_incident(script: Script) -> None:
    """Deployment d2 puts a timestamp in the system prompt: every call writes the cache and
    none reads it, and one step waits 6 minutes; d1 reads its stable prefix."""
    script.annotate(-300, kind="deploy", deployment="d2", old_value="d1", new_value="d2")
    broken = script.run("c0", deployment="d2", prompt_version="p1").start(0)
    for index, seconds in enumerate((1, 61, 121, 481)):
        broken.llm(seconds, input_tokens=10_000, cache_creation_input_tokens=6000,
                   system_prompt_hash=f"sp-{index}")
    broken.end(490)
    healthy = script.run("c1", deployment="d1", prompt_version="p1").start(0)
    for index, seconds in enumerate((1, 61, 121, 181)):
        healthy.llm(seconds, input_tokens=10_000, system_prompt_hash="sp-stable",
                    **({"cache_creation_input_tokens": 6000} if index == 0
                       else {"cache_read_input_tokens": 6000}))
    healthy.end(190)


INCIDENTS = {
    "loop": loop_incident, "halluc": hallucination_incident, "cost": cost_incident,
    "quality": quality_incident, "outage": outage_incident, "retry": retry_incident,
    "ratelimit": rate_limit_incident, "timeout": timeout_incident,
    "silent": silent_incident, "cache": cache_incident,
}
SCENARIO_OF = {
    "agent_stuck_in_loop": "loop", "hallucination_spike": "halluc", "cost_spike": "cost",
    "quality_degradation": "quality", "upstream_tool_outage": "outage",
    "retry_storm_permanent_error": "retry", "rate_limit_storm": "ratelimit",
    "timeout_miscalibration": "timeout", "silent_failures_loop_drift": "silent",
    "silent_prompt_cache_miss": "cache",
}
SCENARIO_TOOL = {"outage": "crm_api", "timeout": "slow_api"}
SCENARIO_RUN = {"loop": "loop", "cost": "big"}


@pytest.fixture(scope="module")
def fleet(local_store) -> Fleet:
    """Every scripted incident, through the real pipeline into the session's chdb store."""
    settings, client = local_store
    seeded = Fleet(client, f"pb-{uuid.uuid4().hex[:8]}")
    messages = []
    for offset, (scenario, script_incident) in enumerate(INCIDENTS.items()):
        script = Script(seeded, scenario)
        script_incident(script)
        messages.append(RawMessage("loopwatch.events", 0, offset, encode_envelope(script.events)))
    work = Pipeline(settings, MemoryRunStore()).process(messages)
    assert not work.dead
    ClickHouseSink(client).write_batch(work.rows)
    return seeded


def query(fleet: Fleet, book: Playbook, title: str, **given: Any) -> list[dict[str, Any]]:
    """Run one step the way ``loopwatch playbook`` would: only the parameters it declares,
    read-only."""
    step = next(step for step in book.steps if step.title == title)
    assert step.sql is not None
    values = {"agent": "", "tool": "", "run_id": "", "since": SINCE, "until": UNTIL, **given}
    return run_query(fleet.client, step.sql, {name: values[name] for name in step.parameters},
                     readonly=True).records()


@pytest.mark.parametrize("name", sorted(PLAYBOOKS - {"pipeline_health"}))
def test_every_sql_step_finds_evidence_of_its_incident(fleet, books, name):
    """Every SQL step returns rows on its playbook's scripted incident, and also runs for
    all agents at once (``agent`` = '')."""
    book = books[name]
    scenario = SCENARIO_OF[name]
    given = {"tool": SCENARIO_TOOL.get(scenario, ""),
             "run_id": fleet.run_id(scenario, SCENARIO_RUN.get(scenario, ""))}
    for step in book.sql_steps:
        assert query(fleet, book, step.title, agent=fleet.agent(scenario), **given), step.title
        query(fleet, book, step.title, agent="", **given)


def pick(rows: list[dict[str, Any]], *columns: str) -> list[tuple[Any, ...]]:
    return [tuple(row[column] for column in columns) for row in rows]


def test_stuck_in_loop(fleet, books):
    book, agent = books["agent_stuck_in_loop"], fleet.agent("loop")
    loop_run = fleet.run_id("loop", "loop")
    stuck = query(fleet, book, "Identify the stuck sessions", agent=agent)
    assert pick(stuck, "run_id", "steps", "tool_calls", "loop_detected", "cost_usd") == [
        (fleet.run_id("loop", "long"), 22, 0, 0, 0.0), (loop_run, 4, 5, 1, 0.3)]
    assert stuck[1]["loop_summary"] == "search_docs called 3x with args h-loop within 10 tool calls"
    trace = query(fleet, book, "Pull the session trace", run_id=loop_run)
    assert len(trace) == 11 and trace[0]["event_type"] == "run.start"
    assert [row["tool"] for row in trace if row["event_type"] == "tool.call"] == [
        "search_docs"] * 4 + ["read_file"]
    pattern = query(fleet, book, "Identify the loop pattern", run_id=loop_run)
    assert pick(pattern, "tool", "args_hash", "calls", "first_step", "last_step",
                "distinct_action_ratio") == [("search_docs", "h-loop", 4, 0, 3, 0.4)]
    response = query(fleet, book, "Check the tool response", run_id=loop_run)
    assert pick(response[:1], "tool", "error_type", "http_status", "timed_out", "result_count",
                "calls") == [("search_docs", "", 200, 0, 0, 4)]
    prompts = query(fleet, book, "Check the system prompt and exit condition", agent=agent)
    assert pick(prompts, "prompt_version", "system_prompt_hash", "runs", "looping_runs",
                "loop_rate") == [("p2", "sp1", 1, 1, 1.0), ("p1", "", 2, 0, 0.0)]
    changes = query(fleet, book, "Check for recent changes", agent=agent)
    assert pick(changes, "kind", "old_value", "new_value") == [("prompt_change", "p1", "p2")]
    grouped = query(fleet, book, "One session or many? Group the looping sessions", agent=agent)
    assert pick(grouped, "tool", "prompt_version", "worker_id", "looping_runs") == [
        ("search_docs", "p2", "w1", 1)]


def test_hallucination_spike(fleet, books):
    book, agent = books["hallucination_spike"], fleet.agent("halluc")
    timeline = query(fleet, book, "Check the timeline", agent=agent)
    assert pick(timeline, "bucket", "flagged_or_cleared", "hallucinated", "hallucination_rate",
                "above_threshold") == [(naive(at(0)), 6, 0, 0.0, 0),
                                       (naive(at(600)), 4, 3, 0.75, 1)]
    versions = query(fleet, book, "Check the model version", agent=agent)
    assert pick(versions, "response_model", "calls") == [
        ("claude-sonnet-4-20270101", 6), ("claude-sonnet-4-20270215", 4)]
    by_version = query(fleet, book, "Hallucination rate by model and prompt version",
                       agent=agent)
    assert pick(by_version, "response_model", "prompt_version", "labelled_runs",
                "hallucinated", "hallucination_rate") == [
        ("claude-sonnet-4-20270215", "p1", 4, 3, 0.75),
        ("claude-sonnet-4-20270101", "p1", 6, 0, 0.0)]
    changes = query(fleet, book, "Correlate with deployment events", agent=agent)
    assert pick(changes, "kind", "new_value") == [("model_change", "claude-sonnet-4-20270215")]
    flagged = query(fleet, book, "Check retrieval quality on sample flagged sessions",
                    agent=agent)
    assert sorted(pick(flagged, "run_id", "empty_results")) == [
        (fleet.run_id("halluc", f"r{index}"), 1) for index in (6, 7, 8)]
    tools = query(fleet, book, "Check tool responses: flagged vs clean runs", agent=agent)
    assert pick(tools, "tool", "runs_kind", "calls", "empty_results", "empty_rate") == [
        ("kb_search", "clean", 7, 0, 0.0), ("kb_search", "flagged", 3, 3, 1.0)]


def test_cost_spike(fleet, books):
    book, agent = books["cost_spike"], fleet.agent("cost")
    big = fleet.run_id("cost", "big")
    top = query(fleet, book, "Identify the top-cost sessions", agent=agent)
    assert pick(top, "run_id", "outcome", "cost_usd")[0] == (big, "budget_exhausted", 9.3)
    assert [row["cost_usd"] for row in top[1:]] == [0.3] * 3
    steps = query(fleet, book, "Find the most expensive step of a top session", run_id=big)
    assert pick(steps, "step", "cost_usd") == [(1, 6.0), (0, 3.0), (2, 0.3)]
    by_outcome = query(fleet, book, "Check for loops: spend by outcome", agent=agent)
    assert pick(by_outcome, "outcome", "runs", "cost_usd", "share_of_spend") == [
        ("budget_exhausted", 1, 9.3, 0.912), ("success", 3, 0.9, 0.088)]
    inflation = query(fleet, book, "Check for tool result inflation", agent=agent)
    assert pick(inflation, "tool", "avg_bytes_window", "avg_bytes_7d", "growth") == [
        ("fetch", 5000.0, 1000.0, 5.0)]
    traffic = query(fleet, book, "Traffic spike or per-session cost?", agent=agent)
    assert pick(traffic, "period", "runs", "cost_usd", "runs_per_hour", "cost_per_run") == [
        ("window", 4, 10.2, 4.0, 2.55), ("previous_7d", 2, 0.6, 0.012, 0.3)]
    concurrency = query(fleet, book, "Check concurrency", agent=agent)
    assert pick(concurrency, "peak_active_runs", "peak_minute") == [(4, naive(at(0)))]


def test_quality_degradation(fleet, books):
    book, agent = books["quality_degradation"], fleet.agent("quality")
    timeline = query(fleet, book, "Check the timeline", agent=agent)
    assert pick(timeline, "hour", "scored_runs", "quality_1h", "quality_7d_avg",
                "below_threshold") == [(naive(T0), 4, 0.6, 0.9, 1)]
    by_version = query(fleet, book, "Check the model version: quality by version", agent=agent)
    assert pick(by_version, "response_model", "scored_runs", "avg_quality") == [
        ("m-v2", 4, 0.6), ("m-v1", 4, 0.9)]
    sample = query(fleet, book, "Run an A/B comparison on 50 recent queries", agent=agent)
    assert [row["run_id"] for row in sample] == [
        fleet.run_id("quality", f"now{index}") for index in (3, 2, 1, 0)]
    assert {row["quality_score"] for row in sample} == {0.6}
    tokens = query(fleet, book, "Check the completion-token distribution per model version",
                   agent=agent)
    assert pick(tokens, "response_model", "avg_output_tokens") == [("m-v2", 100.0)]
    tools = query(fleet, book, "Check tool availability", agent=agent)
    assert pick(tools, "tool", "period", "calls", "timeout_rate", "error_rate") == [
        ("kb", "window", 4, 0.5, 0.5)]
    pressure = query(fleet, book, "Check resource pressure", agent=agent)
    assert pick(pressure, "worker_id", "tool_calls", "timeouts", "timeout_rate") == [
        ("w-hot", 4, 2, 0.5)]


def test_upstream_tool_outage(fleet, books):
    book, agent = books["upstream_tool_outage"], fleet.agent("outage")
    failing = query(fleet, book, "Identify the failing tool", agent=agent)
    assert pick(failing, "tool", "error_type", "http_status", "timed_out", "errors",
                "runs") == [("crm_api", "http_503", 503, 0, 6, 3),
                            ("crm_api", "auth", 401, 0, 2, 1),
                            ("crm_api", "timeout", 0, 1, 2, 1)]
    sustained = query(fleet, book, "Confirm the error rate is sustained", agent=agent,
                      tool="crm_api")
    assert pick(sustained, "minute", "calls", "errors", "timeouts", "error_rate",
                "above_outage_threshold") == [(naive(at(60)), 12, 10, 2, 0.833, 1)]
    breaker = query(fleet, book, "Check the circuit breaker state", agent=agent)
    assert pick(breaker, "tool", "last_calls", "failures", "breaker_would_open",
                "oldest_to_newest") == [("crm_api", 12, 10, 1, "xxxxxxxx..xx"),
                                        ("weather", 4, 0, 0, "....")]
    credentials = query(fleet, book, "Check credentials", agent=agent, tool="crm_api")
    assert pick(credentials, "tool", "http_status", "calls") == [("crm_api", 401, 2)]
    network = query(fleet, book, "Check the network", agent=agent, tool="")
    assert pick(network, "tool", "error_type", "worker_id", "failures") == [
        ("crm_api", "timeout", "w-net", 2)]
    blast = query(fleet, book, "Assess the blast radius", agent=agent, tool="crm_api")
    assert pick(blast, "task_type", "runs", "runs_using_tool", "runs_hit_by_errors",
                "share_depending_on_tool", "hit_runs_failed") == [
        ("support", 8, 6, 5, 0.75, 5)]
    llm = query(fleet, book, "If the LLM provider is the failing dependency", agent=agent)
    assert pick(llm, "provider", "calls", "errors", "error_rate", "error_statuses") == [
        ("anthropic", 2, 1, 0.5, "500")]


def test_retry_storm_on_a_permanent_error(fleet, books):
    book, agent = books["retry_storm_permanent_error"], fleet.agent("retry")
    top = query(fleet, book, "Top inputs by attempts", agent=agent)
    assert pick(top, "tool", "args_hash", "attempts", "runs", "max_attempt", "failed_attempts",
                "statuses") == [("enrich", "rec-42", 10, 2, 5, 10, "400"),
                                ("enrich", "rec-7", 2, 1, 2, 1, "200,503")]
    deterministic = query(fleet, book, "Find deterministic failures", agent=agent)
    assert pick(deterministic, "tool", "args_hash", "status", "error", "attempts", "runs") == [
        ("enrich", "rec-42", 400, "bad_request", 10, 2)]
    not_retryable = query(fleet, book, "Find retries of non-retryable statuses", agent=agent)
    assert pick(not_retryable, "source", "target", "http_status", "retried_attempts",
                "runs") == [("tool", "enrich", 400, 8, 2)]
    replans = query(fleet, book, "Model re-plans per logical operation", agent=agent)
    assert pick(replans, "logical_op_id", "run_id", "attempts", "cost_usd") == [
        ("op-42", fleet.run_id("retry", "p0"), 3, 0.9)]
    workers = query(fleet, book, "Spend and retries per worker per minute", agent=agent)
    assert pick(workers, "worker_id", "tool_retries", "tool_errors", "llm_calls",
                "cost_usd") == [("w1", 5, 6, 3, 0.9), ("w2", 4, 5, 0, 0.0)]
    deploys = query(fleet, book, "Look for a deploy just before the onset", agent=agent)
    assert pick(deploys, "kind", "new_value", "message") == [
        ("tool_deploy", "enrich 1.5", "field segment is now required")]
    success = query(fleet, book, "Retry success rate and amplification per tool", agent=agent)
    assert pick(success, "tool", "operations", "retried_operations", "retried_succeeded",
                "retry_success_rate", "amplification", "investigate_now", "flag_oncall") == [
        ("enrich", 3, 3, 1, 0.333, 4.0, 1, 1)]


def test_rate_limit_storm(fleet, books):
    book, agent = books["rate_limit_storm"], fleet.agent("ratelimit")
    rate = query(fleet, book, "429 rate per provider, model and tool per minute", agent=agent)
    assert pick(rate, "minute", "source", "target", "calls", "rate_limited", "rate_429",
                "above_threshold", "retries") == [(naive(T0), "llm", MODEL, 7, 3, 0.429, 1, 3),
                                                  (naive(T0), "tool", "search", 2, 1, 0.5, 1, 1)]
    honored = query(fleet, book, "Was Retry-After honored?", agent=agent)
    q0, q1 = fleet.run_id("ratelimit", "q0"), fleet.run_id("ratelimit", "q1")
    assert pick(honored, "run_id", "attempt", "retry_after_s", "waited_s", "not_honored",
                "second_429") == [(q0, 1, 17.0, 2.0, 1, 1), (q0, 2, 17.0, 18.0, 0, 0),
                                  (q1, 1, 10.0, 11.0, 0, 0)]
    ratio = query(fleet, book, "Retry-to-original ratio", agent=agent)
    assert pick(ratio, "source", "originals", "retries", "retry_ratio") == [("llm", 4, 3, 0.75),
                                                                          ("tool", 1, 1, 1.0)]
    budget = query(fleet, book, "Did 429s drain the failure budget or trip breakers?",
                   agent=agent)
    assert pick(budget, "outcome", "terminal_reason", "runs", "rate_limited_calls",
                "other_llm_errors") == [("hard_error", "crash", 1, 2, 0),
                                        ("success", "model_done", 1, 1, 0)]
    traffic = query(fleet, book, "Traffic and concurrency against the 429s", agent=agent)
    assert pick(traffic, "active_runs", "llm_calls", "rate_limited") == [(3, 7, 3)]


def tmo_cost(timeout_s: float) -> float:
    """timeout-is-a-bet's cost per call over the scripted durations (unknown = hung)."""
    durations = [(late if late is not None else (float("inf") if timed_out else latency)) / 1000
                 for _, _, timed_out, latency, late in TIMEOUT_CALLS]
    costs = [0.002 * d if d <= timeout_s else 0.002 * timeout_s + 0.10 * 1.2 for d in durations]
    return round(sum(costs) / len(costs), 4)


def test_timeout_miscalibration(fleet, books):
    book, agent = books["timeout_miscalibration"], fleet.agent("timeout")
    histogram = query(fleet, book, "Latency histogram per tool relative to its timeout",
                      agent=agent)
    assert pick(histogram, "bucket", "calls", "mean_true_ms") == [
        ("1 completed <= 0.5T", 3, 200.0), ("2 completed 0.5-0.8T", 1, 700.0),
        ("3 completed 0.8-1T", 1, 900.0), ("4 timed out, near miss", 2, 1200.0),
        ("5 timed out, beyond the near-miss factor", 1, 5000.0),
        ("6 timed out, true duration unknown", 1, 1000.0)]
    ratio = query(fleet, book, "Near-miss ratio per tool", agent=agent)
    assert pick(ratio, "tool", "calls", "timeouts", "timeout_rate", "known_durations",
                "near_misses", "near_miss_ratio") == [("slow_api", 9, 4, 0.444, 3, 2, 0.667)]
    drift = query(fleet, book, "Near-miss ratio and latency drift over time", agent=agent)
    assert pick(drift, "hour", "near_miss_ratio", "max_timeout_ms") == [
        (naive(T0), 0.667, 1000.0)]
    changed = query(fleet, book, "When was T last changed?", agent=agent)
    assert pick(changed, "kind", "new_value") == [("threshold_change", "slow_api timeout 1000ms")]
    retries = query(fleet, book, "Retries triggered by timeouts and their cost", agent=agent)
    assert pick(retries, "tool", "ops_with_timeout", "total_attempts", "retry_attempts",
                "recovered_ops", "near_miss_timeouts", "seconds_waited_on_timeouts") == [
        ("slow_api", 3, 6, 3, 2, 2, 4.0)]
    curve = query(fleet, book, "Price candidate timeouts on the observed durations",
                  agent=agent, tool="slow_api")
    assert pick(curve, "candidate_timeout_s", "expected_cost_per_call") == [
        (factor, tmo_cost(factor)) for factor in (0.5, 0.75, 1.0, 1.3, 1.5, 2.0, 3.0)]
    cheapest = min(curve, key=lambda row: row["expected_cost_per_call"])
    assert cheapest["candidate_timeout_s"] == 1.3  # the near misses say: T is too low


def test_silent_failures_and_loop_drift(fleet, books):
    book, agent = books["silent_failures_loop_drift"], fleet.agent("silent")
    ratio = query(fleet, book, "Silent-failure ratio vs exception rate by version", agent=agent)
    assert pick(ratio, "prompt_version", "closed_runs", "silent_failures", "hard_errors",
                "silent_failure_ratio", "exception_rate") == [("p1", 8, 4, 1, 0.5, 0.125)]
    mix = query(fleet, book, "Outcome mix and cost of failure by prompt and model version",
                agent=agent)
    assert {row["outcome"]: row["runs"] for row in mix} == {
        "success": 3, "looped": 1, "gave_up": 1, "budget_exhausted": 1, "hard_error": 1,
        "wrong": 1}
    caps = query(fleet, book, "Cap hits by cap type", agent=agent)
    assert pick(caps, "cap", "runs") == [("token", 1)]
    drifting = query(fleet, book, "Find the drifting runs", agent=agent)
    assert pick(drifting, "run_id", "outcome", "tool_calls", "min_novel_in_8",
                "distinct_action_ratio") == [
        (fleet.run_id("silent", "s1"), "looped", 8, 2, 0.25)]
    faults = query(fleet, book, "First fault step and contaminated runs", agent=agent)
    assert pick(faults, "outcome", "runs_with_faults", "contaminated_runs",
                "p50_first_fault_step") == [("hard_error", 1, 1, 1)]
    sample = query(fleet, book, "Sample 'successful' runs for verification", agent=agent)
    assert {row["run_id"] for row in sample} == {fleet.run_id("silent", "s0"),
                                                 fleet.run_id("silent", "s7")}
    gap = query(fleet, book, "Mechanical vs verified success", agent=agent)
    assert pick(gap, "closed_runs", "mechanical_successes", "labelled_runs",
                "verified_successes", "verified_success_rate") == [(8, 4, 2, 1, 0.5)]


def test_silent_prompt_cache_miss(fleet, books):
    book, agent = books["silent_prompt_cache_miss"], fleet.agent("cache")
    broken = fleet.run_id("cache", "c0")
    by_deploy = query(fleet, book, "Hit rate by deployment and prompt version", agent=agent)
    assert pick(by_deploy, "deployment", "llm_calls", "cache_hit_rate", "cache_write_share") == [
        ("d2", 4, 0.0, 0.6), ("d1", 4, 0.45, 0.15)]
    never = query(fleet, book, "Runs that never read the cache", agent=agent)
    assert pick(never, "run_id", "deployment", "llm_calls", "calls_writing_cache",
                "calls_reading_cache", "read_tokens", "write_tokens") == [
        (broken, "d2", 4, 4, 0, 0, 24000)]
    volatile = query(fleet, book, "Volatile content or unstable serialization in the prefix",
                     agent=agent)
    assert pick(volatile, "run_id", "distinct_system_prompts") == [(broken, 4)]
    gaps = query(fleet, book, "Gaps between calls longer than the cache TTL", agent=agent)
    assert pick(gaps, "run_id", "cache_ttl", "gaps", "gaps_over_ttl", "max_gap_s") == [
        (broken, "5m", 3, 1, 360.0)]
    hourly = query(fleet, book, "When did the hit rate drop, and what changed?", agent=agent)
    assert pick(hourly, "hour", "llm_calls", "cache_hit_rate", "deployments") == [
        (naive(T0), 8, 0.225, "d1,d2")]
    changes = query(fleet, book, "Deploys and prompt changes around the drop", agent=agent)
    assert pick(changes, "kind", "deployment", "new_value") == [("deploy", "d2", "d2")]


def test_pipeline_health_finds_late_events_dead_letters_and_silent_agents(local_store, books):
    """loopwatch's own incident: events stored late, a refused message, a quiet agent,
    a run that stored fewer steps than its agent sent."""
    settings, client = local_store
    agent = "pipeline-health-agent"
    late = Step(run_id="ph-run", agent=agent, step=0, ts=datetime.now(UTC) - timedelta(minutes=7))
    losing = "pipeline-health-losing-agent"
    short = [RunStart(run_id="ph-short", agent=losing, worker_id="w-3"),
             Step(run_id="ph-short", agent=losing, worker_id="w-3", step=0),
             RunEnd(run_id="ph-short", agent=losing, worker_id="w-3",
                    terminal_reason="model_done", total_steps=3)]
    messages = [RawMessage("t", 0, 1, encode_envelope([late])),
                RawMessage("t", 0, 2, b"{not json, from pipeline-health"),
                RawMessage("t", 0, 3, encode_envelope(short))]
    ClickHouseSink(client).write_batch(
        Pipeline(settings, MemoryRunStore()).process(messages).rows)
    book = books["pipeline_health"]
    now = datetime.now(UTC)
    values = {"agent": agent, "since": now - timedelta(hours=1), "until": now + timedelta(hours=1)}

    def rows(title: str, **given: Any) -> list[dict[str, Any]]:
        step = next(step for step in book.steps if step.title == title)
        assert step.sql is not None
        return run_query(client, step.sql, {k: {**values, **given}[k] for k in step.parameters},
                         readonly=True).records()

    delay = rows("Storage delay per minute")
    assert [row["events"] for row in delay] == [1]
    assert delay[0]["p95_delay_s"] >= 7 * 60
    reasons = {row["reason"].split(":")[0] for row in rows("Dead letters by reason")}
    assert "malformed JSON" in reasons
    assert [row["agent"] for row in rows("Last event per agent")] == [agent]
    lost = rows("Runs with fewer steps stored than their agent sent", agent=losing)
    assert [(row["agent"], row["worker_id"], row["runs"], row["steps_missing"],
             row["example_runs"]) for row in lost] == [(losing, "w-3", 1, 2, ["ph-short"])]
    assert rows("Runs with fewer steps stored than their agent sent") == []
