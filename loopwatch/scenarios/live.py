"""One scenario through the whole running stack: broker, processors, store, detectors.

The stack is a child ``loopwatch up`` on its own data directory. A day of clean history
is emitted first (stamped in the simulated past, as fast as the broker takes it) so
baseline rules have something to compare with; then simulated time runs ``speed`` times
faster than the clock: each simulated minute of traffic is emitted, then the scenario
waits ``60 / speed`` seconds. The detectors inside ``up`` evaluate on event time every
second, so time to detect is measured in simulated seconds with a resolution of about
``speed`` simulated seconds.

The result does not depend on the machine keeping up: once everything is emitted, the
run waits (by what the store holds, not by a sleep) until every emitted event is stored
and the detectors have made two passes that began after that, so the last stretch of
traffic is always judged. On a loaded machine detection reads later in simulated time,
never missing.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from loopwatch.ingest.sdk import Emitter
from loopwatch.scenarios import FLEET, Scenario
from loopwatch.scenarios.traffic import Injection, Traffic
from loopwatch.store.clickhouse import read_time
from loopwatch.upprocess import UpProcess

STORED_SQL = "SELECT count() FROM events FINAL"
LAST_PASS_SQL = "SELECT max(evaluated_at) FROM rule_evaluations"
#: how long to wait for the stack to take in and judge what was emitted
SETTLE_TIMEOUT_S = 900.0

ALERTS_SQL = """
SELECT rule, severity, labels['agent'] AS agent,
       min(coalesce(fired_at, started_at)) AS first_fired
FROM alerts FINAL
WHERE state != 'pending' AND coalesce(fired_at, started_at) >= {inject:DateTime64(3, 'UTC')}
GROUP BY rule, severity, agent
ORDER BY first_fired
"""


def run_live(scenario: Scenario, data_dir: Path, *, speed: float = 60.0, seed: int = 7,
             history_hours: float = 24.0, before_minutes: float = 10.0,
             observe_minutes: float = 60.0,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = progress or (lambda message: None)
    shutil.rmtree(data_dir, ignore_errors=True)
    env = {"LOOPWATCH_DETECT_INTERVAL_S": "1", "LOOPWATCH_ABANDON_TTL_S": "360",
           "LOOPWATCH_MAX_CLOCK_SKEW_S": str(86400 * 7)}  # simulated time runs ahead
    traffic = Traffic(FLEET, seed)
    with UpProcess(data_dir, env) as up:
        emitter = Emitter(up.info["kafka_bootstrap"], up.info["events_topic"],
                          data_dir=data_dir)
        sim_start = datetime.now(UTC).replace(microsecond=0)
        say(f"emitting {history_hours:g} h of clean history")
        emitted = 0
        for event in traffic.events(sim_start - timedelta(hours=history_hours), sim_start):
            emitter.emit(event)
            emitted += 1
        emitter.flush(300)
        inject_at = sim_start + timedelta(minutes=before_minutes)
        injection = Injection(scenario.agent, inject_at, scenario.behaviour)
        end = inject_at + timedelta(minutes=observe_minutes)
        moment = sim_start
        say(f"playing {before_minutes + observe_minutes:g} simulated minutes at {speed:g}x")
        while moment < end:
            started = time.monotonic()
            for event in traffic.events(moment, moment + timedelta(minutes=1), injection):
                emitter.emit(event)
                emitted += 1
            moment += timedelta(minutes=1)
            time.sleep(max(0.0, 60.0 / speed - (time.monotonic() - started)))
        emitter.close()
        say(f"waiting until the {emitted} events are stored and judged")
        settled = settle(up, emitted)
        fired = up.reader.query(ALERTS_SQL, {"inject": inject_at}).records()
    mine = [row for row in fired if row["agent"] in (scenario.agent, "")]
    first: dict[str, float] = {}
    for row in mine:
        moment_fired = read_time(row["first_fired"])
        first.setdefault(row["rule"], (moment_fired - inject_at).total_seconds())
    caught = [rule for rule in scenario.expected if rule in first]
    return {
        "scenario": scenario.name, "playbook": scenario.playbook,
        "expected": list(scenario.expected), "fired": sorted(first),
        "detected": bool(caught),
        "time_to_detect_s": min(first[rule] for rule in caught) if caught else None,
        "alerts": [{"rule": rule, "after_s": after} for rule, after in
                   sorted(first.items(), key=lambda item: item[1])],
        "speed": speed, "store": f"chdb://{data_dir / 'chdb'}", "settled": settled,
    }


def settle(up: UpProcess, emitted: int, timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """Wait until ``emitted`` events are stored, then for two detector passes begun
    after that (the first may have started before the last insert was visible); False
    if ``timeout_s`` passed first (the alerts are read regardless)."""
    deadline = time.monotonic() + timeout_s

    def scalar(sql: str) -> Any:
        return up.reader.query(sql).scalar()

    while int(scalar(STORED_SQL) or 0) < emitted:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    mark = datetime.now(UTC)
    for _ in range(2):
        while (last := read_time(scalar(LAST_PASS_SQL))) is None or last <= mark:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        mark = last
    return True
