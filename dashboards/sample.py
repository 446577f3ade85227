"""A small scripted fleet, written through the real pipeline, so every panel has data.

The tests run each panel's SQL on it and the browser test takes its screenshot of it;
``python -m loopwatch.dashboards.sample DATA_DIR`` fills a throwaway store for a look at the page
(``loopwatch serve --data-dir DATA_DIR``). Times are relative to ``now`` so that the
real-time tier (last hour) and the trends tier (last days) both show something, with
the incidents an on-call engineer should spot: a tool whose timeout is too low, an
agent whose prompt misses the cache, a looping run, a 429 burst, and the deploys and
prompt changes drawn as annotations.
"""

from __future__ import annotations

import random
import sys
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
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
from loopwatch.store.sink import ClickHouseSink, RowBatch

MARKER_AGENT = "support-bot"


@dataclass(frozen=True)
class Agent:
    name: str
    model: str
    provider: str
    prompt_version: str
    deployment: str
    tools: tuple[str, ...]
    task_types: tuple[str, ...]
    system_tokens: int
    cache_stable: bool


FLEET: tuple[Agent, ...] = (
    Agent("support-bot", "claude-sonnet-4", "anthropic", "support-v12", "deploy-41",
          ("lookup_ticket", "issue_refund", "web_search"), ("refund", "faq"), 4000, True),
    Agent("research-agent", "claude-opus-4-1", "anthropic", "research-v3", "deploy-41",
          ("web_search", "fetch_page"), ("literature", "market"), 6000, True),
    Agent("sql-analyst", "gpt-4o", "openai", "analyst-v7", "deploy-40",
          ("run_sql", "fetch_page"), ("report",), 3000, False),
)
OUTCOMES = (("success", 0.82), ("hard_error", 0.03), ("budget_exhausted", 0.03),
            ("gave_up", 0.03), ("looped", 0.03), ("wrong", 0.04), ("abandoned", 0.02))
TIMEOUTS_MS = {"web_search": 1500.0, "fetch_page": 3000.0, "run_sql": 2000.0,
               "lookup_ticket": 1000.0, "issue_refund": 2500.0}
DEPLOY_AGO = timedelta(days=3, hours=5)
MODEL_CHANGE_AGO = timedelta(days=1, hours=2)
PROMPT_UPDATE_AGO = timedelta(minutes=38)
MEDIAN_MS = {"web_search": 700.0, "fetch_page": 250.0, "run_sql": 120.0,
             "lookup_ticket": 80.0, "issue_refund": 300.0}


class SampleFleet:
    """Builds one run at a time as events, with a seeded random generator."""

    def __init__(self, now: datetime, seed: int = 7) -> None:
        self.now = now
        self.rng = random.Random(seed)
        #: run ids differ per build (the same seed at another ``now``): a store seeded
        #: twice, e.g. a test session longer than ensure_seeded's 20 minutes, then holds
        #: two samples side by side instead of one run with every event twice
        self.salt = uuid.uuid5(uuid.NAMESPACE_URL, f"sample:{now.isoformat()}").int
        self.events: list[EventBase] = []
        self.run_ids: list[str] = []

    def outcome(self, agent: Agent, start: datetime) -> str:
        """Drawn from the fleet's mix; research-agent loops more since its model change."""
        mix = dict(OUTCOMES)
        if agent.name == "research-agent" and start > self.now - MODEL_CHANGE_AGO:
            mix["looped"] += 0.07
        pick, total = self.rng.random() * sum(mix.values()), 0.0
        for name, share in mix.items():
            total += share
            if pick <= total:
                return name
        return "success"

    def versions(self, agent: Agent, start: datetime) -> dict[str, str]:
        """Model, prompt and deployment in force at ``start`` (see :func:`change_annotations`)."""
        versions = {"model": agent.model, "prompt_version": agent.prompt_version,
                    "deployment": agent.deployment}
        if agent.deployment == "deploy-41" and start < self.now - DEPLOY_AGO:
            versions["deployment"] = "deploy-40"
        if agent.name == "research-agent" and start < self.now - MODEL_CHANGE_AGO:
            versions["model"] = "claude-opus-4"
        if agent.name == "support-bot" and start < self.now - PROMPT_UPDATE_AGO:
            versions["prompt_version"] = "support-v11"
        return versions

    def run(self, agent: Agent, start: datetime, outcome: str, open_run: bool = False) -> str:
        rng = self.rng
        run_id = f"sample-{uuid.UUID(int=rng.getrandbits(128) ^ self.salt).hex[:20]}"
        common: dict[str, Any] = {
            "run_id": run_id, "agent": agent.name, "task_type": rng.choice(agent.task_types),
            **self.versions(agent, start), "agent_version": "1.4.2",
            "worker_id": f"worker-{rng.randrange(6)}",
        }
        self.events.append(RunStart(ts=start, step_cap=12, **common))
        steps = {"budget_exhausted": 12, "looped": rng.randint(5, 7)}.get(
            outcome, rng.randint(3, 8))
        at = start
        for number in range(steps):
            at += timedelta(seconds=rng.uniform(1.5, 6))
            if at > self.now:
                break
            self.events.append(Step(ts=at, step=number, step_type="plan" if number == 0
                                    else "act", duration_ms=rng.uniform(300, 2500), **common))
            self._llm_call(agent, common, at, number)
            looping = outcome == "looped" and number >= steps - 3
            tool = agent.tools[0] if looping else rng.choice(agent.tools)
            args = "same-query" if looping else f"{tool}-{rng.getrandbits(40):x}"
            self._tool_call(common, at + timedelta(milliseconds=400), number, tool, args,
                            fail=outcome == "hard_error" and number == steps - 1)
        if open_run or at > self.now or outcome == "abandoned":
            self.run_ids.append(run_id)
            return run_id
        end_at = at + timedelta(seconds=1)
        reason = {"hard_error": "crash", "budget_exhausted": "cap",
                  "gave_up": "cannot_complete"}.get(outcome, "model_done")
        self.events.append(RunEnd(ts=end_at, terminal_reason=reason,
                                  cap="step" if reason == "cap" else None, **common))
        if outcome == "wrong" and end_at + timedelta(seconds=30) < self.now:
            self.events.append(Label(ts=end_at + timedelta(seconds=30), verdict="wrong",
                                     run_id=run_id, agent=agent.name))
        self.run_ids.append(run_id)
        return run_id

    def _llm_call(self, agent: Agent, common: dict[str, Any], at: datetime, number: int) -> None:
        rng = self.rng
        context = agent.system_tokens + 450 * number + rng.randint(0, 300)
        read, creation = 0, 0
        if agent.cache_stable:
            read, creation = (0, agent.system_tokens) if number == 0 else (agent.system_tokens, 0)
        burst = self.now - timedelta(minutes=25) < at < self.now - timedelta(minutes=18)
        limited = rng.random() < (0.25 if burst and agent.provider == "openai" else 0.01)
        failed = not limited and rng.random() < 0.01
        self.events.append(LlmCall(
            ts=at, step=number, provider=agent.provider, input_tokens=context,
            output_tokens=rng.randint(80, 600), cache_read_input_tokens=read,
            cache_creation_input_tokens=creation, latency_ms=rng.lognormvariate(7.0, 0.4),
            http_status=429 if limited else (500 if failed else 200),
            error_type="rate_limited" if limited else ("server_error" if failed else None),
            **common))

    def _tool_call(self, common: dict[str, Any], at: datetime, number: int, tool: str,
                   args_hash: str, fail: bool) -> None:
        rng = self.rng
        timeout = TIMEOUTS_MS[tool]
        latency = rng.lognormvariate(0, 0.6) * MEDIAN_MS[tool]
        if tool == "web_search" and at > self.now - timedelta(minutes=20):
            latency *= 1.7  # the upstream slowed down: timeouts, mostly near-misses
        timed_out = latency > timeout
        failed = fail or rng.random() < 0.01
        self.events.append(ToolCall(
            ts=at, step=number, tool=tool, args_hash=args_hash,
            latency_ms=min(latency, timeout), timeout_ms=timeout, timed_out=timed_out,
            late_completion_ms=latency if timed_out else None,
            error_type="http_5xx" if failed else None,
            result_count=rng.randint(0, 12), **common))
        if failed and tool == "lookup_ticket":  # retried, and through on the second attempt
            self.events.append(ToolCall(
                ts=at + timedelta(milliseconds=min(latency, timeout) + 1), step=number,
                tool=tool, args_hash=args_hash, attempt=2, latency_ms=MEDIAN_MS[tool],
                timeout_ms=timeout, result_count=1, **common))


def change_annotations(now: datetime) -> list[EventBase]:
    """The changes an engineer needs on the time axis to explain a step in a chart."""
    return [
        Annotation(ts=now - DEPLOY_AGO, kind="deploy", agent="*",
                   deployment="deploy-41", old_value="deploy-40", new_value="deploy-41",
                   actor="ci", message="weekly release"),
        Annotation(ts=now - MODEL_CHANGE_AGO, kind="model_change",
                   agent="research-agent", model="claude-opus-4-1",
                   old_value="claude-opus-4", new_value="claude-opus-4-1", actor="ml-platform"),
        Annotation(ts=now - PROMPT_UPDATE_AGO, kind="prompt_update", agent="support-bot",
                   prompt_version="support-v12", old_value="support-v11",
                   new_value="support-v12", actor="alice", message="shorter refund policy"),
    ]


def alert_rows(now: datetime, loop_run: str) -> list[dict[str, Any]]:
    """Two firing alerts as the detectors would have written them, and an advisor's
    info alert (detectors/advisors/alerting.py)."""
    fired = now - timedelta(minutes=6)

    def row(rule: str, severity: str, labels: dict[str, str], summary: str, playbook: str,
            value: float, evidence: str = "{}") -> dict[str, Any]:
        return {"fingerprint": uuid.uuid5(uuid.NAMESPACE_URL, rule + str(labels)).hex[:16],
                "started_at": fired - timedelta(minutes=1), "rule": rule,
                "severity": severity, "state": "firing", "labels": labels,
                "summary": summary, "playbook": playbook, "value": value, "fired_at": fired,
                "resolved_at": None, "evidence": evidence, "link": "", "version": 2,
                "updated_at": fired}

    return [
        row("timeout_near_miss", "warning", {"agent": "support-bot", "tool": "web_search"},
            "web_search: 80% of timeouts are near-misses; its 1.5 s timeout is too low",
            "timeout_miscalibration", 0.8),
        row("loop_detected", "critical",
            {"agent": "research-agent", "run_id": loop_run, "task_type": "literature"},
            "research-agent run looped: web_search with the same args 3 times",
            "agent_stuck_in_loop", 3.0),
        row("advisor_timeout", "info", {"agent": "support-bot", "subject": "web_search"},
            "Raise web_search's timeout from 1.5 s to 2.2 s: expected cost per call "
            "$0.0092 -> $0.0015", "timeout_miscalibration", 2200.0,
            '{"evidence": {}, "query": "", "saving_usd_per_day": 40.12}'),
    ]


def _busy_hours(now: datetime, days: int) -> list[tuple[datetime, datetime]]:
    """The daily peak: the hour before ``now``, on every sampled day (today included)."""
    return [(now - timedelta(days=day, minutes=70), now - timedelta(days=day, minutes=2))
            for day in range(days)]


def build(now: datetime, days: int = 8, seed: int = 7) -> tuple[list[EventBase], list[str]]:
    """Events for ``days`` of history with a daily peak at this hour, plus open runs.

    A run every 40 minutes per agent off-peak and every minute at the peak, so that
    1-minute buckets are full and the real-time tier sees traffic like that of the same
    hour on other days, as its baselines expect.
    """
    fleet = SampleFleet(now, seed)
    rng = fleet.rng
    moment = now - timedelta(days=days)
    while moment < now - timedelta(minutes=70):
        for agent in FLEET:
            at = moment + timedelta(seconds=rng.uniform(0, 600))
            fleet.run(agent, at, fleet.outcome(agent, at))
        moment += timedelta(minutes=40)
    for begin, end in _busy_hours(now, days):
        step = timedelta(seconds=60)
        moment = begin
        while moment < end:
            for agent in FLEET:
                at = moment + timedelta(seconds=rng.uniform(0, step.total_seconds()))
                fleet.run(agent, at, fleet.outcome(agent, at))
            moment += step
    for agent in FLEET:
        fleet.run(agent, now - timedelta(seconds=40), "success", open_run=True)
    loop_run = fleet.run(FLEET[1], now - timedelta(minutes=9), "looped")
    fleet.events.extend(change_annotations(now))
    return fleet.events, [loop_run, *fleet.run_ids]


def seed(client: Client, settings: Settings, now: datetime | None = None,
         days: int = 8) -> str:
    """Write the sample fleet into ``client``'s store; returns the looping run's id.

    Runs go through the real engine-free pipeline (run assembly, outcomes, pricing),
    then the pipeline sweeps so that runs that never ended are abandoned.
    """
    now = now or datetime.now(UTC)
    events, run_ids = build(now, days)
    pipeline = Pipeline(settings, MemoryRunStore(), clock=lambda: now.timestamp())
    sink = ClickHouseSink(client)
    events.sort(key=lambda event: event.ts)
    messages = [RawMessage("sample", 0, offset, encode_envelope(events[index:index + 500]))
                for offset, index in enumerate(range(0, len(events), 500))]
    sink.write_batch(pipeline.process(messages).rows)
    sink.write_batch(pipeline.sweep().rows)
    sink.write_batch(RowBatch({"alerts": alert_rows(now, run_ids[0])}))
    return run_ids[0]


def ensure_seeded(client: Client, settings: Settings) -> str:
    """Seed unless a recent sample is already there (tests share one store per session);
    returns the looping run's id either way."""
    recent = client.query(
        "SELECT labels['run_id'] FROM alerts FINAL WHERE rule = 'loop_detected' "
        "AND labels['run_id'] LIKE 'sample-%' AND fired_at > now() - INTERVAL 20 MINUTE "
        "ORDER BY fired_at DESC LIMIT 1").result_rows
    if recent:
        return str(recent[0][0])
    return seed(client, settings)


def main() -> None:
    """``python -m loopwatch.dashboards.sample DATA_DIR``: a store to point ``loopwatch serve``
    at."""
    from loopwatch.store.clickhouse import migrate

    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m loopwatch.dashboards.sample DATA_DIR\n")
        raise SystemExit(2)
    settings = Settings(data_dir=Path(sys.argv[1]))
    run_id = seed(migrate(settings), settings)
    sys.stdout.write(f"sample fleet written to {settings.chdb_path}; looping run {run_id}\n")


if __name__ == "__main__":
    main()
