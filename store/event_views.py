"""The views that turn raw events into rows, rendered from the event contract.

The processors hand the store each Kafka message's events once, as canonical JSON
(``events_in``, migration 006: one row per message). Here ClickHouse does the rest,
in its own threads: one view parses every event once into typed columns (a ``Null``
table, :data:`PARSED`), and one view per table writes ``events``, ``llm_calls``,
``tool_calls`` and ``labels`` from them. Building those rows in Python and encoding them
as JSON for ClickHouse to parse again cost ~9 µs an event of the processor's CPU more
than this path (docs/performance.md, "write path").

Everything here is generated, so that there is one definition of each thing:

- the parsed columns and their types come from the models of
  :mod:`loopwatch.ingest.events` (a field the models give two types is an error);
- a row's columns are the same expressions the processors used to compute in Python
  (``processors/rows.py`` keeps the Python rows for the events that still take that
  path); ``tests/test_event_views.py`` checks both give equal tables, column for column,
  on the bench's event mix;
- ``cost_usd`` and ``cost_mismatch`` are the price table's arithmetic
  (:class:`loopwatch.core.pricing.PriceTable`, the settings' ``prices_file`` and
  ``cost_mismatch_tolerance``), ``near_miss`` the settings' ``near_miss_factor``,
  rendered as literals; a test checks SQL and Python agree on every price-table entry.

The rendered text is versioned beside the migrations: :func:`install` records its
sha256 in :data:`RECORD` (a record table like the migrations' own, which it creates)
and, when the text this build renders differs, changes the views at start: a new price
table or another near-miss factor replaces the table views' queries in place, a
contract change drops and re-creates them all. Migration 006's own view, which split
``events_in`` into ``events`` alone, is dropped the first time (:data:`REPLACED`).

What stays in Python: rows that depend on run state. An OTLP span's event claims its
trace's agent (:mod:`loopwatch.processors.attribution`); its ``llm_calls`` /
``tool_calls`` / ``labels`` rows take the run's agent and rank, so the views leave out
every event carrying the claim's extra (:data:`CLAIM_EXTRA`) and the processors build
those rows as before. ``annotations`` are rare and also stay Python's; ``runs``,
revisions and dead letters need the fold.
"""

from __future__ import annotations

import hashlib
import re
import types
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Union, get_args, get_origin

from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings
from loopwatch.core.pricing import PriceTable
from loopwatch.ingest.attribution import EXPLICIT, RANK_EXTRA
from loopwatch.ingest.events import EVENT_TYPES, EventBase, Label, LlmCall, ToolCall
from loopwatch.store import tables

#: the extra whose presence marks an event that makes an agent claim (its call rows are
#: the processors'); the name the OTLP receiver writes
CLAIM_EXTRA = RANK_EXTRA
#: the ``Null`` table every event passes through once, parsed
PARSED = tables.EVENTS_PARSED
#: the record of the installed text (name -> sha256)
RECORD = tables.GENERATED_VIEWS
#: the record's columns and table settings after ``ENGINE = <engine>`` (the cluster DDL
#: creates the same table, replicated)
RECORD_COLUMNS = ("    name          String,\n    content_hash  String,\n"
                  "    applied_at    DateTime64(3, 'UTC')")
RECORD_TAIL = "ORDER BY name"
#: the record's names: the views' whole text, and the part no query change can alter
RECORD_NAME = "event_views"
STRUCTURE_NAME = "event_views.structure"
#: the view that parses ``events_in`` into :data:`PARSED`
PARSE_VIEW = "events_in_parse"
#: views of an earlier build these replace (migration 006's split into ``events``)
REPLACED = ("events_in_split",)

#: event fields ``events`` keeps as columns, and so leaves out of ``payload``
EVENT_COLUMNS = ("event_id", "event_type", "schema_version", "ts", "run_id", "trace_id",
                 "span_id", "parent_span_id", "agent", "agent_version", "task_type",
                 "model", "prompt_version", "deployment", "traffic_slice", "worker_id")
#: optional ids whose absence the columns store as ''
OPTIONAL_IDS = ("trace_id", "span_id", "parent_span_id")
#: parsed columns are the event's fields under this prefix (a view's ``x AS x`` over a
#: column ``x`` would be a cyclic alias)
PREFIX = "f_"


@dataclass(frozen=True)
class FieldType:
    """A contract field as a parsed column: how JSONExtract reads it, the column's type,
    and the expression that turns the one into the other (``{}``: the extracted value)."""

    extract: str
    column: str
    convert: str = "{}"


def _kind(annotation: Any) -> tuple[Any, bool]:
    """(the type inside an optional, whether it is optional)."""
    if get_origin(annotation) in (Union, types.UnionType):
        members = [member for member in get_args(annotation) if member is not type(None)]
        if len(members) != 1:
            raise TypeError(f"no parsed column for {annotation!r}")
        return members[0], True
    return annotation, False


def field_type(annotation: Any) -> FieldType:
    """How a field of the contract is parsed.

    >>> field_type(int | None), field_type(bool).column
    (FieldType(extract='Nullable(Int64)', column='Nullable(Int64)', convert='{}'), 'UInt8')
    >>> field_type(datetime).convert
    "parseDateTime64BestEffort({}, 3, 'UTC')"
    """
    inner, optional = _kind(annotation)
    if inner is datetime:
        if optional:
            raise TypeError("no parsed column for an optional time")
        return FieldType("String", "DateTime64(3, 'UTC')",
                         "parseDateTime64BestEffort({}, 3, 'UTC')")
    if inner is uuid.UUID:
        if optional:
            raise TypeError("no parsed column for an optional UUID")
        return FieldType("String", "UUID", "toUUID({})")
    if get_origin(inner) is Literal or inner is str:
        base = "String"
    elif inner is bool:  # before int: a bool is an int
        base = "UInt8"
    elif inner is int:
        base = "Int64"
    elif inner is float:
        base = "Float64"
    else:
        raise TypeError(f"no parsed column for {annotation!r}")
    typed = f"Nullable({base})" if optional else base
    return FieldType(typed, typed)


def contract_fields() -> dict[str, FieldType]:
    """Every field of every event type, as parsed; a field two models type differently
    (other than one optional and one not, which parses optional) is an error."""
    found: dict[str, tuple[Any, bool]] = {}
    for model in EVENT_TYPES:
        for name, info in model.model_fields.items():
            inner, optional = _kind(info.annotation)
            if get_origin(inner) is Literal:
                inner = str
            if name in found:
                known, was_optional = found[name]
                if known is not inner:
                    raise TypeError(f"{model.__name__}.{name} is a {inner!r}, elsewhere "
                                    f"a {known!r}: one parsed column cannot hold both")
                optional = optional or was_optional
            found[name] = (inner, optional)
    return {name: field_type(inner | None if optional else inner)  # type: ignore[operator]
            for name, (inner, optional) in found.items()}


def _sql_string(text: str) -> str:
    r"""A ClickHouse string literal.

    >>> print(_sql_string("it's a \\ test"))
    'it\'s a \\ test'
    """
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _number(value: float) -> str:
    """A float literal that reads back as the same double (``repr`` round-trips)."""
    text = repr(float(value))
    if not re.fullmatch(r"[0-9.e+-]+", text):
        raise ValueError(f"not a finite number: {value!r}")
    return text


def _price_of(prices: PriceTable, which: str) -> str:
    default = _number(getattr(prices.default, which))
    if not prices.models:
        return default
    names = ", ".join(_sql_string(model) for model in prices.models)
    values = ", ".join(_number(getattr(price, which)) for price in prices.models.values())
    return f"transform({PREFIX}model, [{names}], [{values}], {default})"


def priced_cost(prices: PriceTable) -> str:
    """:meth:`PriceTable.cost` as SQL over the parsed columns: the same operations in
    the same order, so the doubles are the same."""
    p = PREFIX
    price_in, price_out = _price_of(prices, "input"), _price_of(prices, "output")
    write = (f"if({p}cache_ttl = '1h', {_number(prices.write_1h)}, "
             f"{_number(prices.write_5m)})")
    uncached = (f"greatest(0, {p}input_tokens - {p}cache_read_input_tokens - "
                f"{p}cache_creation_input_tokens)")
    return (f"({uncached} * {price_in} + {p}cache_creation_input_tokens * {price_in} * "
            f"{write} + {p}cache_read_input_tokens * {price_in} * {_number(prices.read)} + "
            f"{p}output_tokens * {price_out}) / 1000000")


def cost_mismatch(tolerance: float, computed: str = "priced") -> str:
    """:func:`loopwatch.core.pricing.cost_mismatch` as SQL (``computed``: the priced
    cost's alias)."""
    reported = f"{PREFIX}cost_usd"
    return (f"if(isNull({reported}), 0, abs(assumeNotNull({reported}) - {computed}) > "
            f"{_number(tolerance)} * greatest(abs({computed}), 1e-9) + 1e-9)")


def near_miss(factor: float) -> str:
    """:func:`loopwatch.processors.rows.near_miss` as SQL."""
    p = PREFIX
    return (f"if({p}timed_out AND isNotNull({p}timeout_ms) AND "
            f"isNotNull({p}late_completion_ms), toUInt8(assumeNotNull({p}late_completion_ms)"
            f" <= {_number(factor)} * assumeNotNull({p}timeout_ms)), NULL)")


def _copy(*names: str) -> dict[str, str]:
    return {name: f"{PREFIX}{name}" for name in names}


def _or(default: str, *names: str) -> dict[str, str]:
    return {name: f"ifNull({PREFIX}{name}, {default})" for name in names}


#: a 429 is no error, rate limits are counted apart (the models' ``is_error``)
_STATUS = f"ifNull({PREFIX}http_status, 0)"
_FAILED = f"(isNotNull({PREFIX}error_type) AND {_STATUS} != 429)"
_ROW_TAIL = {"ingested_at": "ingested_at"}
_CALL_TAIL = {**_ROW_TAIL, "agent_rank": str(EXPLICIT)}
_SCOPE = ("task_type", "model", "prompt_version", "deployment", "traffic_slice")


def table_columns(settings: Settings, prices: PriceTable) -> dict[str, dict[str, str]]:
    """Per table: column -> its expression over the parsed columns (processors/rows.py's
    ``llm_call_row``, ``tool_call_row``, ``label_row``; ``events`` as migration 006's)."""
    return {
        tables.EVENTS: {
            **_copy(*(name for name in EVENT_COLUMNS if name not in OPTIONAL_IDS)),
            **_or("''", *OPTIONAL_IDS),
            "payload": "payload", "extras": "extras", "kafka_partition": "kafka_partition",
            "kafka_offset": "kafka_offset", **_ROW_TAIL},
        tables.LLM_CALLS: {
            **_copy("event_id", "ts", "run_id", "agent", *_SCOPE, "response_model",
                    "provider", "purpose", "step", "input_tokens", "output_tokens",
                    "cache_read_input_tokens", "cache_creation_input_tokens",
                    "cache_ttl", "token_convention", "latency_ms", "ttft_ms", "attempt"),
            "uncached_input_tokens": (f"greatest(0, {PREFIX}input_tokens - "
                                      f"{PREFIX}cache_read_input_tokens - "
                                      f"{PREFIX}cache_creation_input_tokens)"),
            "cost_usd": "priced",
            "reported_cost_usd": f"{PREFIX}cost_usd",
            "cost_mismatch": cost_mismatch(settings.cost_mismatch_tolerance),
            "price_version": _sql_string(prices.version),
            "http_status": _STATUS,
            "rate_limited": f"{_STATUS} = 429",
            "is_error": _FAILED,
            **_or("''", "error_type", "logical_op_id", "stop_reason", "system_prompt_hash",
                  "tools_hash", "history_hash"),
            **_CALL_TAIL},
        tables.TOOL_CALLS: {
            **_copy("event_id", "ts", "run_id", "agent", *_SCOPE, "step", "latency_ms",
                    "timeout_ms", "timed_out", "late_completion_ms", "result_count",
                    "result_size_bytes", "attempt"),
            **_or("''", "tool", "args_hash", "error_type"),
            "near_miss": near_miss(settings.near_miss_factor),
            "http_status": _STATUS,
            "is_error": f"({PREFIX}timed_out OR {_FAILED})",
            **_CALL_TAIL},
        tables.LABELS: {
            **_copy("event_id", "ts", "run_id", "agent", "verdict", "label_source",
                    "quality_score", "hallucination"),
            **_ROW_TAIL},
    }


#: which events each table's view takes (``events``: all of them)
_EVENT_TYPE: dict[str, type[EventBase]] = {
    tables.LLM_CALLS: LlmCall, tables.TOOL_CALLS: ToolCall, tables.LABELS: Label}


def view_name(table: str) -> str:
    return f"{PARSED}_{table}"


@dataclass(frozen=True)
class Rendered:
    """The statements that (re)create the views, in order, and their text's hash; and
    each table view's query alone, for changing a view in place."""

    drops: tuple[str, ...]
    creates: tuple[str, ...]
    queries: tuple[tuple[str, str], ...] = ()
    """(view, its ``SELECT``) of each table view: what a price table or a setting changes"""

    @property
    def content_hash(self) -> str:
        return hashlib.sha256(";\n".join(self.creates).encode()).hexdigest()

    @property
    def structure_hash(self) -> str:
        """The hash of what a view's query cannot change in place: the parsed table, the
        view that fills it, and which table views there are."""
        fixed = [*self.creates[:2], *(view for view, _ in self.queries)]
        return hashlib.sha256(";\n".join(fixed).encode()).hexdigest()

    @property
    def views(self) -> tuple[str, ...]:
        return (PARSE_VIEW, *(view_name(table) for table in _TABLE_ORDER))


_TABLE_ORDER = (tables.EVENTS, tables.LLM_CALLS, tables.TOOL_CALLS, tables.LABELS)


#: the column the canonical JSON writes last (the base model's last field: the mirror
#: writes the tag, then the base model's fields, then the type's own)
LAST_COLUMN = list(EventBase.model_fields)[-1]


def _payload_check() -> None:
    """What :func:`payload`'s cut relies on: the columns are the tag and the base
    model's fields, and the last of them is a plain string, which the mirror's encoder
    always writes (it leaves out nulls only)."""
    if set(EVENT_COLUMNS) != {"event_type", *EventBase.model_fields}:
        raise TypeError("the events columns must be event_type and the base model's fields")
    if EventBase.model_fields[LAST_COLUMN].annotation is not str:
        raise TypeError(f"the base model's last field {LAST_COLUMN!r} must be a plain str")


@dataclass(frozen=True)
class Payload:
    """``payload``'s SQL over ``event`` (one canonical event object) and ``event_extra``:
    the aliases it needs (``WITH``), when the cut applies, and the event's own fields
    (the object's text between its braces) by the cut and by the exact path."""

    aliases: tuple[str, ...]
    cut_applies: str
    cut: str
    exact: str

    @property
    def own_fields(self) -> str:
        """The own fields by the cut where it applies, else by the exact path."""
        return f"if({self.cut_applies}, {self.cut}, {self.exact})"

    @property
    def expression(self) -> str:
        """The own fields and the extras as one object. :attr:`own_fields` is used
        once, so that ClickHouse evaluates the exact path's regular expression only
        for the events the cut does not apply to: an expression used twice is computed
        for every row, whichever branch of ``if`` it is in (12.9 µs an event on an OTLP
        burst's events, which carry extras, against 0.86 this way)."""
        extras = ("arrayStringConcat(arrayMap((key, value) -> concat(toJSONString(key), "
                  "':', value), mapKeys(event_extra), mapValues(event_extra)), ',')")
        return f"concat('{{', trimBoth(concat({self.own_fields}, ',', {extras}), ','), '}}')"


def payload() -> Payload:
    """``payload``: every non-null field that is not a column, then the extras, as one
    JSON object in the event's order and its encoder's spelling (``0.0``).

    The cut (every event the msgspec mirror encoded, so nearly all): the object after
    its last column. The mirror writes the tag first, then the columns, then the type's
    own fields, and leaves nulls out; in an event with no backslash no quote is inside a
    string, so the first quote after the one that opens the last column's value closes
    it.

    The exact path (pydantic's order, nulls written, escapes): the columns and the nulls
    deleted by a regular expression. A quote-delimited key followed by ``:`` cannot
    begin inside a string, where every quote is escaped.

    Either way no field text begins or ends with a comma (a JSON value cannot end with
    one), so trimming commas (``trimBoth``) leaves exactly the separators between fields.

    Parsing each event's keys and values again for this cost the store ~4.7 µs an event
    of its ~13 (docs/performance.md)."""
    _payload_check()
    columns = "|".join(EVENT_COLUMNS)
    columns_and_nulls = (rf'"(?:{columns})":(?:"(?:[^"\\]|\\.)*"|null),?'
                         r'|"[a-z0-9_]+":null,?')
    last = f',"{LAST_COLUMN}":"'
    aliases = (
        f"position(event, {_sql_string(last)}) AS last_column_at",
        f"position(event, '\"', last_column_at + {len(last)}) AS last_column_end",
    )
    tag_first = _sql_string('{"event_type":')
    backslash = _sql_string("\\")
    cut_applies = (f"startsWith(event, {tag_first}) AND position(event, {backslash}) = 0 "
                   "AND position(event, ':null') = 0 AND last_column_at > 0")
    cut = "substring(event, last_column_end + 2, -1)"
    exact = (f"trimBoth(substring(replaceRegexpAll(event, {_sql_string(columns_and_nulls)}, "
             "''), 2, -1), ',')")
    return Payload(aliases, cut_applies, cut, exact)


def render(settings: Settings, prices: PriceTable | None = None) -> Rendered:
    """The views for ``settings`` (and its price table unless ``prices`` is given)."""
    prices = prices or PriceTable.load(settings.prices_file)
    columns = table_columns(settings, prices)
    fields = contract_fields()
    used = sorted({name for spec in columns.values() for expression in spec.values()
                   for name in re.findall(rf"\b{PREFIX}(\w+)", expression)} | {"event_type"})
    unknown = [name for name in used if name not in fields]
    if unknown:
        raise TypeError(f"the views read fields the contract does not have: {unknown}")
    tuple_type = ", ".join(f"{name} {fields[name].extract}" for name in used)
    parsed_columns = ",\n".join(
        [f"    {PREFIX}{name} {fields[name].column}" for name in used]
        + ["    payload String", "    extras Map(String, String)",
           "    kafka_partition UInt32", "    kafka_offset UInt64",
           "    ingested_at DateTime64(3, 'UTC')"])
    # by position, not ``c.name``: the analyzer resolves each element name anew (1.7 ms
    # of every insert each, 90 of the view's ~100 ms fixed cost), a position in 0.3 ms
    event_payload = payload()
    parse = ",\n".join(
        [f"    {fields[name].convert.format(f'tupleElement(c, {place})')} AS {PREFIX}{name}"
         for place, name in enumerate(used, start=1)]
        + [f"    {event_payload.expression} AS payload",
           "    event_extra AS extras", "    kafka_partition", "    kafka_offset",
           "    ingested_at"])
    creates = [
        f"CREATE TABLE IF NOT EXISTS {PARSED}\n(\n{parsed_columns}\n)\nENGINE = Null",
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {PARSE_VIEW} TO {PARSED} AS\nWITH\n"
        f"    JSONExtract(event, 'Tuple({tuple_type})') AS c,\n"
        + ",\n".join(f"    {alias}" for alias in event_payload.aliases)
        + f"\nSELECT\n{parse}\n"
        f"FROM {tables.EVENTS_IN}\nARRAY JOIN\n    event_objects AS event,\n"
        "    arrayResize(event_extras, length(event_objects)) AS event_extra",
    ]
    queries: list[tuple[str, str]] = []
    for table in _TABLE_ORDER:
        select = ",\n".join(f"    {expression}" if expression == column
                            else f"    {expression} AS {column}"
                            for column, expression in columns[table].items())
        model = _EVENT_TYPE.get(table)
        where = "" if model is None else (
            f"\nWHERE {PREFIX}event_type = "
            f"{_sql_string(str(model.model_fields['event_type'].default))} "
            f"AND NOT mapContains(extras, {_sql_string(CLAIM_EXTRA)})")
        with_ = (f"WITH {priced_cost(prices)} AS priced\n"
                 if table == tables.LLM_CALLS else "")
        query = f"{with_}SELECT\n{select}\nFROM {PARSED}{where}"
        queries.append((view_name(table), query))
        creates.append(f"CREATE MATERIALIZED VIEW IF NOT EXISTS {view_name(table)} TO "
                       f"{table} AS\n{query}")
    views = (*REPLACED, PARSE_VIEW, *(view_name(table) for table in _TABLE_ORDER))
    drops = (*(f"DROP VIEW IF EXISTS {name}" for name in views),
             f"DROP TABLE IF EXISTS {PARSED}")
    return Rendered(drops, tuple(creates), tuple(queries))


def installed_hash(client: Client, name: str = RECORD_NAME) -> str | None:
    """The hash the store records under ``name`` (the views' text by default), if any."""
    client.command(f"CREATE TABLE IF NOT EXISTS {RECORD}\n(\n{RECORD_COLUMNS}\n)\n"
                   f"ENGINE = ReplacingMergeTree(applied_at)\n{RECORD_TAIL}")
    rows = client.query(f"SELECT argMax(content_hash, applied_at) FROM {RECORD} "
                        "WHERE name = {n:String}", parameters={"n": name}).result_rows
    return str(rows[0][0]) if rows and rows[0][0] else None


def _present(client: Client, names: tuple[str, ...]) -> bool:
    found = client.query("SELECT count() FROM system.tables WHERE database = "
                         "currentDatabase() AND name IN {n:Array(String)}",
                         parameters={"n": [*names, PARSED]}).result_rows[0][0]
    return int(found) == len(names) + 1


def install(client: Client, settings: Settings, prices: PriceTable | None = None) -> bool:
    """Make the store's views the ones this build renders for ``settings``; True if they
    changed. Each step can run again, so a crash in the middle is repaired by the next
    start (the hashes are recorded last).

    A new price table or setting changes only the table views' queries: each is
    replaced in place (``ALTER TABLE ... MODIFY QUERY``), so an insert into
    ``events_in`` at any moment is stored by the old query or the new one, never by
    none. That matters where other processes keep writing while one starts: extra
    workers, or a shared ClickHouse server. A change of the parsed table (a new build's
    contract) drops and re-creates everything, before anything is written: between the
    drops and the creates an insert would store nothing (``events_in`` is a ``Null``
    table), so every process writing to the store must be stopped for that upgrade."""
    rendered = render(settings, prices)
    digest = rendered.content_hash
    present = _present(client, rendered.views)
    if installed_hash(client) == digest and present:
        return False
    if present and installed_hash(client, STRUCTURE_NAME) == rendered.structure_hash:
        for view, query in rendered.queries:
            client.command(f"ALTER TABLE {view} MODIFY QUERY {query}")
    else:
        for statement in (*rendered.drops, *rendered.creates):
            client.command(statement)
    for name, value in ((STRUCTURE_NAME, rendered.structure_hash), (RECORD_NAME, digest)):
        client.command(f"INSERT INTO {RECORD} (name, content_hash, applied_at) VALUES "
                       "({n:String}, {h:String}, now64(3))", parameters={"n": name, "h": value})
    return True
