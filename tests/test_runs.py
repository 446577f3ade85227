"""Run assembly and outcome labelling, on scripted events (no services needed)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import orjson
import pytest

from loopwatch.ingest.events import EventBase, Label, LlmCall, RunEnd, RunStart, Step, ToolCall
from loopwatch.processors.runs import RunState, abandon_if_expired, apply_event

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def fold(*events: EventBase, window: int = 10, repeats: int = 3) -> RunState:
    state = RunState("r", 0)
    for event in events:
        apply_event(state, event, loop_window=window, loop_repeats=repeats)
    return state


def ev(kind: type[EventBase], seconds: float = 0, **fields) -> EventBase:
    return kind(run_id="r", agent="a", ts=T0 + timedelta(seconds=seconds), **fields)


@pytest.mark.parametrize(
    ("reason", "cap", "outcome"),
    [
        ("model_done", None, "success"),
        ("crash", None, "hard_error"),
        ("cap", "step", "budget_exhausted"),
        ("budget", "cost", "budget_exhausted"),
        ("budget", None, "budget_exhausted"),
        ("cannot_complete", None, "gave_up"),
        ("loop_detector", None, "looped"),
        ("drift_monitor", None, "looped"),
        ("cancelled", None, "abandoned"),
        (None, None, "unknown"),
    ],
)
def test_terminal_reason_decides_the_outcome(reason, cap, outcome):
    state = fold(ev(RunStart), ev(RunEnd, 1, terminal_reason=reason, cap=cap))
    assert state.outcome == outcome
    assert state.closed


def test_a_running_run_has_no_outcome():
    assert fold(ev(RunStart), ev(Step, 1, step=0)).outcome == ""


def grep(seconds: float, args: str) -> ToolCall:
    return ev(ToolCall, seconds, tool="grep", args_hash=args)  # type: ignore[return-value]


def test_loop_detector_trips_on_three_identical_calls_within_ten():
    calls = [grep(i, "same" if i in (0, 4, 9) else f"other{i}") for i in range(10)]
    state = fold(ev(RunStart), *calls, ev(RunEnd, 20, terminal_reason="model_done"))
    assert state.loop_detected
    assert state.loop_summary == "grep called 3x with args same within 10 tool calls"
    assert state.outcome == "looped"


def test_three_identical_calls_spread_over_eleven_do_not_trip():
    calls = [grep(i, "same" if i in (0, 5, 10) else f"other{i}") for i in range(11)]
    assert not fold(*calls).loop_detected


def test_retries_of_one_call_are_not_a_loop_but_the_agent_calling_it_again_is():
    """A call retried (``attempt`` 2, 3, ...) is one action of the agent's, not three:
    the retry storm playbook's case, not the loop's."""
    retried = [ev(ToolCall, i, tool="grep", args_hash="same", attempt=i + 1) for i in range(5)]
    state = fold(ev(RunStart), *retried, ev(RunEnd, 20, terminal_reason="model_done"))
    assert not state.loop_detected and state.outcome == "success"
    state = fold(ev(RunStart), *retried, grep(6, "same"), grep(7, "same"))
    assert state.loop_detected
    assert state.loop_summary == "grep called 3x with args same within 10 tool calls"


def test_loop_threshold_is_configurable():
    calls = [grep(i, "same") for i in range(3)]
    assert not fold(*calls, repeats=4).loop_detected
    assert fold(*calls, grep(4, "same"), repeats=4).loop_detected


def test_looping_agent_that_hit_its_cap_is_looped_but_a_crash_stays_a_crash():
    calls = [grep(i, "same") for i in range(3)]
    assert fold(*calls, ev(RunEnd, 9, terminal_reason="cap", cap="step")).outcome == "looped"
    assert fold(*calls, ev(RunEnd, 9, terminal_reason="crash")).outcome == "hard_error"


def test_late_wrong_label_revises_success_but_not_other_failures():
    success = fold(ev(RunStart), ev(RunEnd, 1, terminal_reason="model_done"))
    apply_event(success, ev(Label, 60, verdict="wrong"))
    assert success.outcome == "wrong"
    gave_up = fold(ev(RunStart), ev(RunEnd, 1, terminal_reason="cannot_complete"))
    apply_event(gave_up, ev(Label, 60, verdict="wrong"))
    assert gave_up.outcome == "gave_up"


def test_a_verdict_labels_an_imported_run_without_one():
    imported = fold(ev(RunStart), ev(RunEnd, 1))
    assert imported.outcome == "unknown"
    apply_event(imported, ev(Label, 2, verdict="correct"))
    assert imported.outcome == "success"


def test_redelivered_events_are_applied_once():
    call = ev(LlmCall, 1, input_tokens=100, output_tokens=10)
    state = fold(ev(RunStart), call)
    assert apply_event(state, call, priced_cost=1.0) is False
    assert (state.llm_calls, state.input_tokens, state.cost_usd, state.version) == (1, 100, 0, 2)


def test_abandonment_runs_on_event_time_and_a_late_end_revises_it():
    state = fold(ev(RunStart), ev(Step, 5, step=0))
    last_ms = int((T0 + timedelta(seconds=5)).timestamp() * 1000)
    assert not abandon_if_expired(state, last_ms + 59_999, 60_000)
    assert abandon_if_expired(state, last_ms + 60_000, 60_000)
    assert (state.outcome, state.closed_ms) == ("abandoned", last_ms + 60_000)
    apply_event(state, ev(RunEnd, 120, terminal_reason="model_done"))
    assert state.outcome == "success"


def test_model_and_dimensions_come_from_run_start():
    state = RunState("r", 0)
    apply_event(state, LlmCall(run_id="r", agent="a", model="gpt-4o", ts=T0))
    apply_event(state, RunStart(run_id="r", agent="a", model="claude-sonnet-4", task_type="qa",
                                ts=T0 - timedelta(seconds=1)))
    apply_event(state, LlmCall(run_id="r", agent="a", model="gpt-4o-mini", ts=T0))
    assert (state.model, state.task_type) == ("claude-sonnet-4", "qa")


def test_abandonment_ttl_follows_task_type_then_the_declared_time_cap():
    from loopwatch.core.config import Settings
    from loopwatch.processors.jobs.reprocess import MemoryRunStore
    from loopwatch.processors.pipeline import Pipeline

    settings = Settings(abandon_ttl_s=100, abandon_ttl_by_task_type={"batch": 7})
    pipeline = Pipeline(settings, MemoryRunStore())
    capped = fold(ev(RunStart, time_cap_s=30))
    assert pipeline.abandon_ttl_ms(capped) == 60_000
    assert pipeline.abandon_ttl_ms(fold(ev(RunStart))) == 100_000
    assert pipeline.abandon_ttl_ms(fold(ev(RunStart, task_type="batch", time_cap_s=30))) == 7_000


def test_a_price_table_with_a_price_that_is_no_number_is_refused_naming_it(tmp_path):
    """A quoted number would load, then make pricing raise on every call of that model."""
    import json
    from pathlib import Path

    from loopwatch.processors.pricing import PriceTable

    shipped = json.loads((Path(__file__).parent.parent / "processors/prices.json").read_text())
    for model, field, bad in (("gpt-4o", "input", "2.5"), ("default", "output", None)):
        table = json.loads(json.dumps(shipped))
        entry = table["default"] if model == "default" else table["models"][model]
        entry[field] = bad
        path = tmp_path / f"{model}.json"
        path.write_text(json.dumps(table))
        with pytest.raises(ValueError) as refused:
            PriceTable.load(path)
        assert str(refused.value) == f"{path}: {model}.{field} must be a number >= 0, not {bad!r}"
    assert PriceTable.load().models["gpt-4o"].input == shipped["models"]["gpt-4o"]["input"]


# -- a label that comes before its run (issue 24 §6) -------------------------------------

NOW_S = T0.timestamp() + 3600


def label_pipeline(**settings: float):
    """A pipeline on a memory run store with a fixed wall clock an hour after T0."""
    from pathlib import Path

    from loopwatch.core.config import Settings
    from loopwatch.processors.jobs.reprocess import MemoryRunStore
    from loopwatch.processors.pipeline import Pipeline

    config = Settings(data_dir=Path("/nonexistent-labels"), **settings)
    return Pipeline(config, MemoryRunStore(), clock=lambda: NOW_S)


def messages(*events: EventBase):
    from loopwatch.ingest.wire import encode_event
    from loopwatch.processors.pipeline import RawMessage

    return [RawMessage("loopwatch.events", 0, offset, encode_event(event))
            for offset, event in enumerate(events)]


def run_rows(work) -> list[dict]:
    return work.rows.tables.get("runs", [])


def test_a_label_before_its_run_makes_no_run_and_is_applied_once_when_it_comes():
    pipeline = label_pipeline()
    label = ev(Label, 30, verdict="wrong", label_source="human")
    first = pipeline.process(messages(label))
    assert run_rows(first) == []
    # stored all the same: the label's row is written by the store's views from its
    # events_in row (store/event_views.py), not built here
    assert "labels" not in first.rows.tables
    assert [event["event_type"] for row in first.rows.tables["events_in"]
            for event in orjson.loads(orjson.dumps(row["event_objects"]))] == ["label"]
    assert pipeline.store.get("r").awaiting_run is True

    run = [ev(Step, 1, step=0, traffic_slice="canary"),
           ev(RunEnd, 2, terminal_reason="model_done", traffic_slice="canary")]
    second = pipeline.process(messages(*run, label))  # the label once more: redelivered
    (row,) = run_rows(second)
    assert (row["status"], row["outcome"], row["label_source"], row["steps"]) == (
        "closed", "wrong", "human", 1)
    assert row["traffic_slice"] == "canary"  # the run's, not the label's default
    assert row["started_ts"] == T0 + timedelta(seconds=1)
    counters = pipeline.counters
    assert (counters.labels_unmatched, counters.pending_labels_matched,
            counters.pending_labels_expired, counters.duplicates, counters.runs_closed) == (
        1, 1, 0, 1, 1)


def test_a_label_whose_run_never_comes_is_forgotten_after_the_label_window():
    pipeline = label_pipeline(label_window_s=100, abandon_ttl_s=5)
    label = ev(Label, 0, verdict="correct")
    work = pipeline.process(messages(label, ev(Label, 1, verdict="wrong")))
    assert run_rows(work) == []
    # event time moves on with other runs' events; the label waits through the TTL
    other = [Step(run_id="other", agent="a", step=n, ts=T0 + timedelta(seconds=s))
             for n, s in enumerate((30, 50, 70))]
    for event in other:
        pipeline.process(messages(event))
        assert [row["run_id"] for row in run_rows(pipeline.sweep())] in ([], ["other"])
    assert pipeline.store.get("r") is not None
    pipeline.process(messages(Step(run_id="other", agent="a", step=9,
                                   ts=T0 + timedelta(seconds=120))))
    assert "r" not in [row["run_id"] for row in run_rows(pipeline.sweep())]
    assert pipeline.store.get("r") is None
    assert (pipeline.counters.labels_unmatched, pipeline.counters.pending_labels_matched,
            pipeline.counters.pending_labels_expired) == (2, 0, 1)


def test_a_label_for_a_run_the_store_knows_is_applied_to_it_not_kept_waiting():
    pipeline = label_pipeline()
    known = fold(ev(RunStart), ev(RunEnd, 1, terminal_reason="model_done"))
    pipeline.lookup_run = lambda run_id: known if run_id == "r" else None
    (row,) = run_rows(pipeline.process(messages(ev(Label, 60, verdict="wrong"))))
    assert row["outcome"] == "wrong"
    assert pipeline.counters.labels_unmatched == 0


def test_waiting_labels_rebuilt_from_the_store_are_applied_when_the_run_comes():
    from loopwatch.processors.runs import pending_label_state

    label = ev(Label, 30, verdict="wrong", label_source="human")
    rebuilt = pending_label_state("r", 0, [{
        "event_id": str(label.event_id), "ts": int(label.ts.timestamp() * 1000),
        "agent": "a", "verdict": "wrong", "label_source": "human"}])
    pipeline = label_pipeline()
    assert pipeline.adopt([rebuilt]) == 1
    run = [ev(RunStart), ev(RunEnd, 2, terminal_reason="model_done"), label]
    (row,) = run_rows(pipeline.process(messages(*run)))
    assert (row["outcome"], row["label_source"]) == ("wrong", "human")
    assert (pipeline.counters.pending_labels_matched, pipeline.counters.duplicates) == (1, 1)
