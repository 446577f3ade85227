"""``loopwatch demo``: the embedded stack, a simulated fleet, and the four metrics.

The demo keeps its data in ``<data_dir>/demo``, started afresh each time, and runs the
stack as a child ``loopwatch up`` that owns the store; the demo itself is just another
client (an emitter and a reader), as a real agent fleet would be.
"""

from __future__ import annotations

import shutil
import threading
import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from ingest.sdk import Emitter
from loopwatch.config import Settings
from loopwatch.report import fleet_report
from loopwatch.simulator import FleetSimulator, SimulatorResult
from loopwatch.upprocess import UpProcess

SETTINGS_ENV = ("abandon_ttl_s", "idle_advance_s", "late_allowance_s")


def _status_line(phase: str, started: float, result: SimulatorResult, emitter: Emitter,
                 health: dict[str, Any]) -> Table:
    counters = health.get("counters", {})
    table = Table.grid(padding=(0, 2))
    table.add_row(
        f"[bold]{phase}[/bold]", f"{time.monotonic() - started:5.1f}s",
        f"runs started {result.runs}", f"events sent {emitter.stats.sent}",
        f"processed {counters.get('events', 0)}", f"runs closed {counters.get('runs_closed', 0)}",
        f"dead letters {counters.get('dead_letters', 0)}",
    )
    return table


def _wait_until_stored(up: UpProcess, emitter: Emitter, timeout_s: float) -> None:
    """Every event sent is processed and stored, and no run is left open."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
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


def run_demo(settings: Settings, duration_s: float, rate: float, seed: int,
             progress: bool, console: Console) -> dict[str, Any]:
    data_dir = settings.data_dir / "demo"
    shutil.rmtree(data_dir, ignore_errors=True)
    env = {f"LOOPWATCH_{name.upper()}": str(getattr(settings, name)) for name in SETTINGS_ENV}
    up = UpProcess(data_dir, env)
    if progress:
        console.print(f"starting the embedded stack in {data_dir} ...")
    with up:
        emitter = Emitter(up.info["kafka_bootstrap"], up.info["events_topic"],
                          data_dir / "spool")
        simulator = FleetSimulator(emitter, seed=seed)
        started = time.monotonic()
        stop = threading.Event()
        with Live(console=console, transient=True, auto_refresh=False,
                  redirect_stdout=False) as live:

            def tick(result: SimulatorResult) -> None:
                if progress:
                    live.update(_status_line("simulating", started, result, emitter,
                                             up.health()), refresh=True)

            result = simulator.run(duration_s, rate, stop, on_tick=tick)
            emitter.close()
            if progress:
                live.update(_status_line("draining", started, result, emitter, up.health()),
                            refresh=True)
            _wait_until_stored(up, emitter, timeout_s=settings.abandon_ttl_s * 3 + 120)
        report = fleet_report(up.reader)
    report["store"] = f"chdb://{data_dir / 'chdb'}"
    report["emitted_events"] = emitter.stats.sent
    report["planned_outcomes"] = {agent: dict(counts)
                                  for agent, counts in sorted(result.planned.items())}
    return report


def _fmt(value: float | None, percent: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:.1%}" if percent else f"${value:.4f}"


def print_report(report: dict[str, Any], console: Console) -> None:
    outcomes = ["success", "hard_error", "budget_exhausted", "gave_up", "looped", "wrong",
                "abandoned"]
    table = Table(title=f"{report['runs']} runs, {report['events']} events")
    for column in ["agent", "runs", *outcomes, "silent fail", "exceptions", "near-miss",
                   "cache hit", "$/success"]:
        table.add_column(column, justify="left" if column == "agent" else "right")
    for agent, entry in report["agents"].items():
        table.add_row(
            agent, str(entry["runs"]), *(str(entry["outcomes"].get(o, 0)) for o in outcomes),
            _fmt(entry["silent_failure_ratio"], True), _fmt(entry["exception_rate"], True),
            _fmt(entry["near_miss_timeout_ratio"], True), _fmt(entry["cache_hit_rate"], True),
            _fmt(entry["cost_per_successful_run"]),
        )
    console.print(table)
    cost = Table(title="mean cost per run, by outcome")
    cost.add_column("agent")
    for outcome in outcomes:
        cost.add_column(outcome, justify="right")
    for agent, entry in report["agents"].items():
        cost.add_row(agent, *(_fmt(entry["cost_per_outcome"].get(o)) for o in outcomes))
    console.print(cost)
    console.print(f"data: {report['store']}  (query it: loopwatch query --data-dir "
                  f"{report['store'].removeprefix('chdb://').removesuffix('/chdb')} \"SQL\")")
