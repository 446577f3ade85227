"""An alert's summary keeps the figure it fired with and shows the current one beside
it (issue 26, item 16), on the shipped loop-rate rule: it fired at 5 of 43 runs looped
(11.6%), then the run count moved on."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from loopwatch.detectors.alerts import Alert, AlertBook
from loopwatch.detectors.rules import Finding, load_rules

NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)
RULE = next(rule for rule in load_rules().values()
            if "runs looped" in rule.summary and rule.for_ == timedelta(0))


def finding(looped: int, runs: int) -> Finding:
    return Finding(RULE, {"agent": "support"}, looped / runs, "active", samples=runs)


def test_a_firing_alert_shows_its_current_figure_beside_the_firing_one():
    book = AlertBook()
    fired = book.observe(RULE, [finding(5, 43)], NOW)
    assert [(t.kind, t.alert.row(NOW)["summary"]) for t in fired] == [
        ("fired", "11.6% of support's runs looped in the last 15m")]
    later = book.observe(RULE, [finding(5, 51)], NOW + timedelta(minutes=1))
    rows = [(t.kind, t.alert.row(NOW)["summary"], round(t.alert.row(NOW)["value"], 4),
             t.alert.version) for t in later]
    assert rows == [("updated", "11.6% of support's runs looped in the last 15m · now 9.8% of "
                     "support's runs looped in the last 15m", 0.098, 3)]
    # the same figure again: nothing to write
    assert book.observe(RULE, [finding(5, 51)], NOW + timedelta(minutes=2)) == []
    # restored after a restart from its row: still both figures, and no double "now"
    restored = AlertBook([Alert.from_row(later[0].alert.row(NOW))])
    again = restored.observe(RULE, [finding(6, 60)], NOW + timedelta(minutes=3))
    assert [t.alert.row(NOW)["summary"] for t in again] == [
        "11.6% of support's runs looped in the last 15m · now 10.0% of support's runs looped "
        "in the last 15m"]
    back = restored.observe(RULE, [finding(5, 43)], NOW + timedelta(minutes=4))
    assert [t.alert.row(NOW)["summary"] for t in back] == [
        "11.6% of support's runs looped in the last 15m"]
