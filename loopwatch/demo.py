"""``loopwatch demo``: the embedded stack, a simulated fleet, and the four metrics.

The demo keeps its data in ``<data_dir>/demo``, started afresh each time, and runs the
stack as a child ``loopwatch up`` that owns the store; the demo itself is just another
client (an emitter and a reader), as a real agent fleet would be.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from loopwatch.core.config import Settings
from loopwatch.core.embedded.lifecycle import discard_broker
from loopwatch.core.money import usd
from loopwatch.dashboards.web.server import serve_in_thread
from loopwatch.ingest.redact import Redactor
from loopwatch.ingest.sdk import Emitter
from loopwatch.liveline import LiveLine
from loopwatch.report import fleet_report
from loopwatch.simulator import FleetSimulator, SimulatorResult
from loopwatch.upprocess import UpProcess

SETTINGS_ENV = ("abandon_ttl_s", "idle_advance_s", "late_allowance_s", "detect_interval_s",
                "capture", "capture_success_sample")
#: The demo decides captures often, so its report can say what was kept.
CAPTURE_DECIDE_INTERVAL_S = 2.0
CAPTURE_SQL = """
SELECT
  (SELECT count() FROM capture_decisions FINAL) AS decided,
  (SELECT countIf(keep = 1) FROM capture_decisions FINAL) AS kept,
  (SELECT count() FROM runs FINAL WHERE status = 'closed'
     AND run_id IN (SELECT run_id FROM capture_staging)
     AND run_id NOT IN (SELECT run_id FROM capture_decisions)) AS waiting,
  (SELECT count() FROM capture_parts FINAL) AS parts,
  (SELECT sum(bytes) FROM capture_parts FINAL) AS part_bytes,
  (SELECT count() FROM capture_blobs FINAL) AS blobs,
  (SELECT sum(bytes) FROM capture_blobs FINAL) AS blob_bytes,
  (SELECT sum(data_compressed_bytes) FROM system.parts
     WHERE database = currentDatabase() AND active
       AND table IN ('capture_blobs', 'capture_parts')) AS disk_bytes
"""
UNDECIDED_FAILURES_SQL = """
SELECT count() FROM runs FINAL
WHERE status = 'closed' AND outcome != 'success'
  AND run_id IN (SELECT run_id FROM capture_staging)
  AND run_id NOT IN (SELECT run_id FROM capture_decisions)
"""
ALERTS_SQL = """
SELECT rule, severity, playbook, count() AS episodes, countIf(state = 'firing') AS firing,
       argMax(summary, updated_at) AS latest
FROM alerts FINAL
WHERE state != 'pending' OR fired_at IS NOT NULL
GROUP BY rule, severity, playbook
ORDER BY severity = 'critical' DESC, severity = 'warning' DESC, rule
"""


def _status_line(phase: str, started: float, result: SimulatorResult, emitter: Emitter,
                 health: dict[str, Any]) -> list[str]:
    counters = health.get("counters", {})
    return [phase, f"{time.monotonic() - started:5.1f}s", f"runs started {result.runs}",
            f"events sent {emitter.stats.sent}", f"processed {counters.get('events', 0)}",
            f"runs closed {counters.get('runs_closed', 0)}",
            f"dead letters {counters.get('dead_letters', 0)}"]


def _wait_until_stored(up: UpProcess, emitter: Emitter, timeout_s: float,
                       on_wait: Callable[[], None] = lambda: None) -> None:
    """Every event sent is processed and stored, and no run is left open (``on_wait``
    is called on every poll: the status line)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        on_wait()
        health = up.health()
        processed = health["counters"]["events"]
        if processed >= emitter.stats.sent and health["caught_up"]:
            open_runs = up.reader.query(
                "SELECT count() FROM runs FINAL WHERE status = 'running'"
            ).scalar()
            if not open_runs:
                return
        time.sleep(0.5)
    raise TimeoutError(f"the pipeline did not store every event within {timeout_s:.0f}s")


def _wait_for_captures(up: UpProcess, emitter: Emitter, timeout_s: float) -> None:
    """Every capture message sent is staged, and every failed run is decided (successes
    wait for the label window, which outlasts a demo)."""
    if emitter.stats.captures_sent == 0:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        staged = up.reader.query("SELECT uniqExact(event_id) FROM capture_staging").scalar()
        if staged >= emitter.stats.captures_sent and not up.reader.query(
                UNDECIDED_FAILURES_SQL).scalar():
            return
        time.sleep(0.5)


#: A kept failed run worth replaying: a loop first, since its replay shows the repeats.
EXAMPLE_RUN_SQL = """
SELECT run_id FROM capture_decisions FINAL WHERE keep = 1 AND outcome != 'success'
ORDER BY outcome = 'looped' DESC, parts DESC, run_id LIMIT 1
"""


def capture_summary(reader: Any) -> dict[str, Any]:
    """Runs kept, parts, bytes, and how much content addressing saved (dedup ratio)."""
    row = reader.query(CAPTURE_SQL).records()[0]
    summary: dict[str, Any] = {name: int(value or 0) for name, value in row.items()}
    summary["dedup_ratio"] = (summary["part_bytes"] / summary["blob_bytes"]
                              if summary["blob_bytes"] else None)
    example = reader.query(EXAMPLE_RUN_SQL).rows
    summary["example_run"] = example[0][0] if example else None
    return summary


def run_demo(settings: Settings, duration_s: float, rate: float, seed: int,
             progress: bool, console: Console) -> dict[str, Any]:
    data_dir = settings.data_dir / "demo"
    discard_broker(data_dir)  # a killed demo's broker: its record goes with the folder
    shutil.rmtree(data_dir, ignore_errors=True)
    env = {f"LOOPWATCH_{name.upper()}": str(getattr(settings, name)) for name in SETTINGS_ENV}
    env["LOOPWATCH_CAPTURE_DECIDE_INTERVAL_S"] = str(CAPTURE_DECIDE_INTERVAL_S)
    up = UpProcess(data_dir, env)
    if progress:
        console.print(f"starting the embedded stack in {data_dir} ...")
    with up:
        web_url, stop_web = serve_in_thread(up.reader)
        if progress:
            console.print(f"live dashboards: [bold]{web_url}[/bold]  (open it while the demo runs)")
        emitter = Emitter(up.info["kafka_bootstrap"], up.info["events_topic"],
                          data_dir=data_dir, capture=settings.capture,
                          redactor=Redactor.from_settings(settings),
                          captures_topic=settings.captures_topic,
                          max_part_bytes=settings.capture_max_part_bytes)
        simulator = FleetSimulator(emitter, seed=seed)
        started = time.monotonic()
        stop = threading.Event()
        with LiveLine(console, enabled=progress) as live:

            def tick(result: SimulatorResult) -> None:
                if progress:
                    live.update(_status_line("simulating", started, result, emitter,
                                             up.health()), phase="simulating")

            def draining() -> None:
                if progress:
                    live.update(_status_line("draining", started, result, emitter,
                                             up.health()), phase="draining")

            result = simulator.run(duration_s, rate, stop, on_tick=tick)
            emitter.close()
            draining()
            _wait_until_stored(up, emitter, timeout_s=settings.abandon_ttl_s * 3 + 120,
                               on_wait=draining)
            if progress:
                live.update(["finishing", f"{time.monotonic() - started:5.1f}s",
                             "a last detector pass, then the capture decisions"],
                            phase="finishing")
            time.sleep(settings.detect_interval_s * 2)  # one more detector pass on the end
            _wait_for_captures(up, emitter, timeout_s=60 + 4 * CAPTURE_DECIDE_INTERVAL_S)
        report = fleet_report(up.reader)
        report["capture"] = capture_summary(up.reader)
        report["alerts"] = up.reader.query(ALERTS_SQL).records()
        stop_web()
    report["dashboards_url"] = web_url
    report["store"] = f"chdb://{data_dir / 'chdb'}"
    report["emitted_events"] = emitter.stats.sent
    report["planned_outcomes"] = {agent: dict(counts)
                                  for agent, counts in sorted(result.planned.items())}
    return report


def _fmt(value: float | None, percent: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:.1%}" if percent else usd(value)


SEVERITY_STYLES = {"critical": "bold red", "warning": "yellow"}


def _count(number: int, noun: str) -> str:
    """The number and the noun, plural unless the number is 1.

    >>> _count(1, "episode"), _count(3, "episode")
    ('1 episode', '3 episodes')
    """
    return f"{number} {noun}{'' if number == 1 else 's'}"


def alerts_list(alerts: list[dict[str, Any]]) -> Table:
    """One entry per rule: severity, then the rule and its counts, its latest summary
    and its playbook on lines of their own, so that no name is cut on 80 columns (as
    table columns, rule and playbook names were cut to 12 characters)."""
    listing = Table.grid(padding=(0, 2))
    listing.title = "alerts raised (loopwatch alerts)"
    listing.add_column(no_wrap=True)
    listing.add_column()
    for alert in alerts:
        listing.add_row(
            Text(alert["severity"], style=SEVERITY_STYLES.get(alert["severity"], "")),
            Text.assemble((alert["rule"], "bold"),
                          f"  {_count(alert['episodes'], 'episode')}, "
                          f"{alert['firing']} firing now\n",
                          f"{alert['latest']}\n",
                          (f"loopwatch playbook {alert['playbook']}", "dim")))
    return listing


def print_report(report: dict[str, Any], console: Console) -> None:
    """Agents as columns, so the report reads on an 80-column terminal."""
    agents = list(report["agents"])
    entries = [report["agents"][agent] for agent in agents]
    outcomes = Table(title=f"{report['runs']} runs, {report['events']} events: "
                           "runs and mean cost per run, by outcome")
    outcomes.add_column("outcome")
    for agent in agents:
        outcomes.add_column(agent, justify="right")
    for outcome in ("success", "hard_error", "budget_exhausted", "gave_up", "looped", "wrong",
                    "abandoned"):
        outcomes.add_row(outcome, *(
            f"{entry['outcomes'].get(outcome, 0)}  {_fmt(entry['cost_per_outcome'].get(outcome))}"
            for entry in entries))
    console.print(outcomes)
    metrics = Table(title="the four core metrics")
    metrics.add_column("metric")
    for agent in agents:
        metrics.add_column(agent, justify="right")
    rows = [
        ("runs", lambda e: str(e["runs"])),
        ("silent-failure ratio", lambda e: _fmt(e["silent_failure_ratio"], True)),
        ("exception rate", lambda e: _fmt(e["exception_rate"], True)),
        ("near-miss timeout ratio", lambda e: _fmt(e["near_miss_timeout_ratio"], True)),
        ("prompt-cache hit rate", lambda e: _fmt(e["cache_hit_rate"], True)),
        ("cost per successful run", lambda e: _fmt(e["cost_per_successful_run"])),
    ]
    for label, cell in rows:
        metrics.add_row(label, *(cell(entry) for entry in entries))
    console.print(metrics)
    if report.get("alerts"):
        console.print(alerts_list(report["alerts"]))
    capture = report.get("capture")
    if capture:
        ratio = capture["dedup_ratio"]
        console.print(
            f"capture: {capture['kept']} of {capture['decided']} decided runs kept "
            f"({capture['waiting']} successes wait for the label window), "
            f"{capture['parts']} parts, {capture['part_bytes'] / 1e6:.1f} MB of bodies "
            f"stored as {capture['blobs']} blobs of {capture['blob_bytes'] / 1e6:.1f} MB "
            f"(dedup {'-' if ratio is None else f'{ratio:.1f}x'}; "
            f"{capture['disk_bytes'] / 1e6:.1f} MB on disk compressed)")
    data_dir = report["store"].removeprefix("chdb://").removesuffix("/chdb")
    commands = [f"data: {report['store']}",
                f"investigate: loopwatch investigate top_cost_runs --data-dir {data_dir}",
                f"advice:      loopwatch advise --data-dir {data_dir}",
                f"dashboards:  loopwatch serve --data-dir {data_dir}"]
    if capture and capture.get("example_run"):
        commands.append(f"replay:      loopwatch replay {capture['example_run']} "
                        f"--data-dir {data_dir}")
    for line in commands:  # whole lines, so that a command copies in one piece
        console.print(line, soft_wrap=True, highlight=False)
