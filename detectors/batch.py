"""Every rule of a detector pass in one query (UNION ALL) instead of one query per rule.

A pass used to send each rule's SQL on its own (26 event-time rules: 26 queries, each
planned, scheduled and converted apart). Batched, the store plans one query and runs
the rules' branches together: about a quarter less CPU per pass on the reference
machine, for ``loopwatch up`` every ``detect_interval_s`` and for the scorecard's every
simulated minute.

Each rule's rows are reduced to what :func:`loopwatch.detectors.rules.evaluate` reads
(its label columns, ``value``, ``samples``, ``baseline``, ``history_s``, ``k``, ``t``),
in one common shape so the branches can be unioned (a rule's output columns come from
``DESCRIBE``, once). The rows a rule gets are the ones it got alone
(tests/test_rules.py compares the findings).
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from loopwatch.detectors.rules import Rule
from loopwatch.store.clickhouse import QueryResult

log = logging.getLogger(__name__)
Query = Callable[[str, dict[str, Any]], QueryResult]

#: the columns evaluate() reads besides the labels, and the common type of each
FIELDS: dict[str, str] = {
    "value": "Nullable(Float64)", "samples": "Nullable(Float64)",
    "baseline": "Nullable(Float64)", "history_s": "Nullable(Float64)",
    "k": "Nullable(Float64)", "t": "Nullable(DateTime64(3, 'UTC'))",
}
#: the engine's query parameters, renamed per rule inside a batch (their values differ)
_PARAMETER = re.compile(r"\{(now|start|baseline_start|wall_now|excluded_slices):")


def branch(index: int, rule: Rule, columns: Sequence[str]) -> str:
    """Rule ``index``'s SQL as one branch of the batch: ``rule_index``, its labels in the
    rule's order (as text, '' where a column is missing), then :data:`FIELDS`."""
    sql = _PARAMETER.sub(lambda match: f"{{{match.group(1)}_{index}:", rule.sql)
    labels = ", ".join(f"toString(`{name}`)" if name in columns else "''"
                       for name in rule.labels)
    fields = ", ".join(f"CAST(`{name}` AS {kind}) AS `{name}`" if name in columns
                       else f"CAST(NULL AS {kind}) AS `{name}`"
                       for name, kind in FIELDS.items())
    return (f"SELECT {index} AS rule_index, CAST([{labels}] AS Array(Nullable(String))) "
            f"AS labels, {fields} FROM ({sql})")


def batched(rules: Sequence[Rule], columns: Mapping[str, Sequence[str]],
            parameters: Sequence[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The one query for ``rules`` (whose columns are known, by SQL) and its parameters."""
    merged: dict[str, Any] = {}
    for index, values in enumerate(parameters):
        merged.update({f"{name}_{index}": value for name, value in values.items()})
    sql = "\nUNION ALL\n".join(branch(index, rule, columns[rule.sql])
                               for index, rule in enumerate(rules))
    return sql, merged


def split(rules: Sequence[Rule], result: QueryResult) -> dict[str, list[dict[str, Any]]]:
    """The batch's rows back per rule, as evaluate() reads them (the rule's rows alone)."""
    rows: dict[str, list[dict[str, Any]]] = {rule.name: [] for rule in rules}
    position = {name: place for place, name in enumerate(result.columns)}
    for row in result.rows:
        rule = rules[int(row[position["rule_index"]])]
        record = dict(zip(rule.labels, row[position["labels"]], strict=True))
        record.update({name: row[position[name]] for name in FIELDS})
        rows[rule.name].append(record)
    return rows


#: the query that checks the handle is in step again (:func:`in_step`)
IN_STEP_SQL = "SELECT {token:String} AS token"


def in_step(query: Query, attempts: int = 4) -> bool:
    """After a failed query, make sure the next one gets its own answer: chdb leaves the
    rest of a query that failed mid-stream on the handle, for the next query to read
    (as :func:`loopwatch.store.reader.resync` does for the readers)."""
    for _ in range(attempts):
        token = uuid.uuid4().hex
        try:
            if query(IN_STEP_SQL, {"token": token}).rows == [[token]]:
                return True
        except Exception:
            continue
    return False


#: each rule SQL's output columns, shared by the engines of a process: they follow from
#: the SQL's text and the store's schema, which migrations settle before an engine runs.
#: Described once per process rather than once per engine: each costs the rule's
#: analysis (3-6 ms), 27 of them ~0.15 s, which every engine a test or a scorecard
#: built paid again.
DESCRIBED: dict[str, list[str]] = {}


class RuleQueries:
    """The rows of every rule of a pass in one query. A rule's output columns come from
    ``DESCRIBE`` the first time its SQL is seen (``columns``, by SQL: :data:`DESCRIBED`
    by default); a rule that cannot be described,
    and every rule when the batch fails, is queried alone, so one rule's failure stays
    that rule's; a rule that failed alone stays out of the batch until it answers."""

    def __init__(self, query: Query, alone: set[str],
                 columns: dict[str, list[str]] | None = None) -> None:
        self.query = query
        self.columns = DESCRIBED if columns is None else columns
        self.alone = alone

    def rows(self, work: Sequence[tuple[Rule, dict[str, Any]]]
             ) -> dict[str, list[dict[str, Any]] | Exception]:
        found: dict[str, list[dict[str, Any]] | Exception] = {}
        for rule, values in work:
            if rule.sql not in self.columns:
                try:
                    described = self.query(f"DESCRIBE TABLE ({rule.sql})", values)
                except Exception:  # queried alone below, where its error is reported
                    in_step(self.query)
                    continue
                self.columns[rule.sql] = [str(row[0]) for row in described.rows]
        together = [(rule, values) for rule, values in work
                    if rule.sql in self.columns and rule.name not in self.alone]
        if together:
            rules = [rule for rule, _ in together]
            sql, merged = batched(rules, self.columns, [values for _, values in together])
            try:
                found.update(split(rules, self.query(sql, merged)))
            except Exception as exc:  # each rule alone below: a failure is its rule's
                log.warning("the batched rule query failed (%s); rules one by one",
                            str(exc).splitlines()[0][:300] if str(exc) else exc)
                in_step(self.query)
        for rule, values in work:
            if rule.name in found:
                continue
            try:
                result = self.query(rule.sql, values)
            except Exception as exc:
                found[rule.name] = exc
                self.alone.add(rule.name)
                in_step(self.query)
                continue
            self.alone.discard(rule.name)
            found[rule.name] = result.records()
        return found
