"""The guard on user SQL: one SELECT over loopwatch's tables, bounded, nothing else.

``readonly=1`` alone lets ClickHouse's scalar ``file()``, ``INTO OUTFILE``, ``KILL
QUERY`` and several statements in one string through, and has no limits. So every
query a user can type (``loopwatch query``, investigations, playbooks, the web view,
the store service's ``POST /query``) goes through :func:`guarded_query`:

1. ClickHouse's own parser reads it, on the engine that will run it (no parser
   differential): ``formatQuery`` (one statement, or a syntax error) and
   ``parseQueryToJSON`` of that canonical text, both given the text as a query
   *parameter*, so parsing executes nothing. Comments, unicode and quoting tricks are
   gone from the canonical text, and the canonical text is what runs.
2. :func:`check` walks the parsed tree and refuses, in one line, anything but a SELECT
   (``WITH``/``UNION``/subqueries included) over tables of the loopwatch database:
   ``INTO OUTFILE``, ``FORMAT``, any ``SETTINGS`` clause (the limits are loopwatch's,
   the output format is the CLI's ``--json``), table functions other than the pure
   generators, ``Identifier`` query parameters, other databases (``system``,
   ``information_schema``...), and every function not on the allowlist
   (:class:`FunctionCatalog`).
3. The engine enforces what it can (:class:`Limits`): ``readonly=1`` and time, memory
   and result-size limits as per-query settings; under ``readonly=1`` the query cannot
   change them (ClickHouse refuses any setting change in readonly mode).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import orjson
from clickhouse_connect.driver.client import Client

from loopwatch.core.config import Settings


class RefusedQuery(RuntimeError):
    """A user query the guard or a limit refused; the message is one line saying what."""


class StoreBusy(RefusedQuery):
    """Every reader of the store service is running a query."""


#: table functions that only generate values: no host, network or other table is
#: reached, and the time and result limits bound what they cost
TABLE_FUNCTIONS = frozenset({"numbers", "numbers_mt", "zeros", "zeros_mt",
                             "generate_series", "generateSeries"})

#: function categories (``system.functions.categories``) whose functions compute on
#: their arguments only; ``Other``, ``Internal``, ``Introspection``, ``Dictionary``,
#: ``Embedded Dictionary``, ``Machine Learning``, ``AI`` and ``Time Series`` are left
#: out: they hold ``file``, ``getSetting``, ``hostName``, ``dictGet``, ``joinGet``,
#: ``aiGenerate`` and the like, which reach files, the network, settings or other tables
SAFE_CATEGORIES = frozenset({
    "Arithmetic", "Arrays", "Bit", "Bitmap", "Comparison", "Conditional", "Dates and Times",
    "Distance", "Encoding", "Encryption", "Financial", "Geo", "Geo Polygon", "Hash",
    "IP Address", "JSON", "Logical", "Map", "Mathematical", "Null", "NumericIndexedVector",
    "QBit", "Random Number", "Rounding", "String", "String Replacement", "String Search",
    "String Splitting", "Time Window", "Tuple", "Type Conversion", "URL", "UUID",
})

#: harmless functions from the categories left out
EXTRA_FUNCTIONS = frozenset({
    "lambda", "exists", "caseWithExpression", "bar", "byteSize", "countDigits", "currentDatabase",
    "defaultValueOfArgumentType", "defaultValueOfTypeName", "errorCodeToName",
    "finalizeAggregation", "formatReadableDecimalSize", "formatReadableQuantity",
    "formatReadableSize", "formatReadableTimeDelta", "getSizeOfEnumType", "getSubcolumn",
    "identity", "ignore", "indexHint", "initializeAggregation", "isConstant",
    "isDecimalOverflow", "lowCardinalityIndices", "lowCardinalityKeys", "MACNumToString",
    "MACStringToNum", "MACStringToOUI", "materialize", "neighbor", "parseISO8601Duration",
    "parseReadableSize", "parseReadableSizeOrNull", "parseReadableSizeOrZero",
    "parseTimeDelta", "rowNumberInAllBlocks", "rowNumberInBlock", "runningAccumulate",
    "runningDifference", "runningDifferenceStartingWithFirstValue", "throwIf",
    "toColumnTypeName", "toTypeName", "transform", "variantElement", "variantType",
    "visibleWidth", "blockSize", "blockNumber",
})

#: refused although their category is safe: ``chdb()`` runs a query of its own
DENIED_FUNCTIONS = frozenset({"chdb"})

#: functions whose second argument names a table when it is an identifier
IN_FUNCTIONS = frozenset({"in", "notIn", "globalIn", "globalNotIn", "nullIn", "notNullIn",
                          "globalNullIn", "globalNotNullIn", "inIgnoreSet", "notInIgnoreSet"})

#: every node type a permitted SELECT parses into; anything else is refused
NODE_TYPES = frozenset({
    "SelectWithUnionQuery", "SelectIntersectExceptQuery", "SelectQuery", "ExpressionList",
    "Literal", "Identifier", "Function", "Asterisk", "QualifiedAsterisk",
    "ColumnsRegexpMatcher", "ColumnsListMatcher", "QualifiedColumnsRegexpMatcher",
    "QualifiedColumnsListMatcher", "ColumnsTransformerList", "ColumnsExceptTransformer",
    "ColumnsReplaceTransformer", "ColumnsReplaceTransformerReplacement",
    "ColumnsApplyTransformer", "Subquery", "TablesInSelectQuery",
    "TablesInSelectQueryElement", "TableExpression", "TableIdentifier", "TableJoin",
    "ArrayJoin", "OrderByElement", "WithElement", "WindowDefinition", "WindowListElement",
    "QueryParameter", "SampleRatio", "InterpolateElement", "Alias",
})


@dataclass(frozen=True)
class Limits:
    """The bounds every user query runs under, from :class:`Settings`."""

    timeout_s: float
    max_memory_bytes: int
    max_result_rows: int
    max_result_bytes: int

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(settings.query_timeout_s, settings.query_max_memory_bytes,
                   settings.query_max_result_rows, settings.query_max_result_bytes)

    def engine_settings(self) -> dict[str, Any]:
        """Per-query settings; ``readonly`` last, since under it nothing can be set."""
        return {
            "max_execution_time": self.timeout_s,
            "timeout_overflow_mode": "throw",
            "max_memory_usage": self.max_memory_bytes,
            "max_result_rows": self.max_result_rows,
            "max_result_bytes": self.max_result_bytes,
            "result_overflow_mode": "throw",
            "readonly": 1,
        }


class FunctionCatalog:
    """Which functions a user query may call, from the engine's own ``system.functions``
    (so aliases and case-insensitive spellings resolve as the engine resolves them).

    An allowlist: a function is allowed when it is an aggregate (with any combinator,
    ``countIf``, ``uniqStateMerge``...), or its canonical name's category is in
    :data:`SAFE_CATEGORIES`, or it is in :data:`EXTRA_FUNCTIONS`; never when it is in
    :data:`DENIED_FUNCTIONS`. A function a new ClickHouse adds to a left-out category is
    refused until someone looks at it.
    """

    def __init__(self, rows: list[tuple[str, int, int, str, str]], combinators: list[str]
                 ) -> None:
        self._canonical: dict[str, str] = {}
        self._folded: dict[str, str] = {}
        self._aggregates: set[str] = set()
        self._category: dict[str, str] = {}
        for name, is_aggregate, case_insensitive, alias_to, categories in rows:
            canonical = alias_to or name
            self._canonical[name] = canonical
            if case_insensitive:
                self._folded[name.lower()] = canonical
            if is_aggregate:
                self._aggregates.add(name)
                self._aggregates.add(canonical)
            if not alias_to:
                self._category[name] = categories
        self._combinators = sorted(combinators, key=len, reverse=True)

    @classmethod
    def load(cls, client: Client) -> FunctionCatalog:
        rows = client.query("SELECT name, is_aggregate, case_insensitive, alias_to, categories "
                            "FROM system.functions", settings={"readonly": 1}).result_rows
        combinators = client.query("SELECT name FROM system.aggregate_function_combinators",
                                   settings={"readonly": 1}).result_rows
        return cls([tuple(row) for row in rows], [row[0] for row in combinators])  # type: ignore[misc]

    def resolve(self, name: str) -> str | None:
        """The canonical name the engine calls for ``name``, or None if it knows none."""
        return self._canonical.get(name) or self._folded.get(name.lower())

    def allowed(self, name: str) -> bool:
        if name in EXTRA_FUNCTIONS:
            return True
        canonical = self.resolve(name)
        if canonical is None:
            return self._aggregate_with_combinators(name)
        if canonical in DENIED_FUNCTIONS:
            return False
        return (canonical in self._aggregates or canonical in EXTRA_FUNCTIONS
                or self._category.get(canonical, "") in SAFE_CATEGORIES)

    def _aggregate_with_combinators(self, name: str) -> bool:
        """``sumIf``, ``uniqMergeState``: an aggregate followed by combinator suffixes."""
        for combinator in self._combinators:
            if name.endswith(combinator) and len(name) > len(combinator):
                base = name[: -len(combinator)]
                canonical = self.resolve(base)
                if canonical in self._aggregates or self._aggregate_with_combinators(base):
                    return True
        return False


def _statement_kind(node_type: str) -> str:
    """``KillQueryQuery`` -> ``KILL QUERY``: how a refusal names a statement."""
    words: list[str] = []
    for char in node_type.removesuffix("Query"):
        if char.isupper() and words:
            words.append(" ")
        words.append(char.upper())
    return "".join(words) or node_type


#: the one read of a system table loopwatch itself makes through a user reader (the
#: demo and trace economics price the capture tables' compressed bytes): exactly this
#: shape, over the current database only, with any list of table names
TABLE_BYTES_SQL = ("SELECT sum(data_compressed_bytes) FROM system.parts "
                   "WHERE database = currentDatabase() AND active AND table IN ('t')")


def _names_list_as_marker(node: Any) -> Any:
    """``node`` with the string list of a ``table IN (...)`` replaced by a marker, so a
    parsed subquery compares with :data:`TABLE_BYTES_SQL` whatever tables it names."""
    if isinstance(node, list):
        return [_names_list_as_marker(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "Function" and node.get("name") == "in":
        left, right = ((node.get("arguments") or {}).get("children") or [None, None])[:2]
        if (isinstance(left, dict) and left.get("type") == "Identifier"
                and left.get("name") == "table" and _string_literal(right)):
            return {**node, "arguments": {"type": "ExpressionList",
                                          "children": [left, "names"]}}
    return {key: _names_list_as_marker(value) for key, value in node.items()}


def _string_literal(node: Any) -> bool:
    if not isinstance(node, dict) or node.get("type") != "Literal":
        return False
    value = node.get("value") or {}
    items = value.get("value") if value.get("field_type") in {"Tuple", "Array"} else [value]
    return all(isinstance(item, dict) and item.get("field_type") == "String"
               for item in items or [])


class _Check:
    """One walk over one parsed statement."""

    def __init__(self, catalog: FunctionCatalog, database: str,
                 table_bytes: dict[str, Any] | None = None) -> None:
        self.catalog = catalog
        self.database = database
        self.table_bytes = table_bytes

    def node(self, node: dict[str, Any]) -> None:
        kind = node.get("type")
        if (kind == "SelectQuery" and self.table_bytes is not None
                and _names_list_as_marker(node) == self.table_bytes):
            return
        if kind not in NODE_TYPES:
            raise RefusedQuery(f"query refused: {kind} is not part of a plain SELECT")
        if node.get("out_file") is not None or node.get("is_into_outfile_with_stdout"):
            raise RefusedQuery("query refused: INTO OUTFILE writes a file; use --json or "
                               "redirect the output instead")
        if node.get("format_ast") is not None or node.get("format") is not None:
            raise RefusedQuery("query refused: FORMAT is not allowed; the output format is "
                               "the CLI's (--json)")
        if node.get("settings") is not None or node.get("settings_ast") is not None:
            raise RefusedQuery("query refused: a SETTINGS clause is not allowed; the limits "
                               "are loopwatch's (LOOPWATCH_QUERY_* settings)")
        if kind == "TableIdentifier":
            self.table(node)
        elif kind == "TableExpression" and node.get("table_function") is not None:
            self.table_function(node["table_function"])
        elif kind == "Function":
            self.function(node)
        elif kind == "QueryParameter" and node.get("param_type") == "Identifier":
            raise RefusedQuery("query refused: a query parameter of type Identifier "
                               "can name any table")
        elif kind == "ColumnsApplyTransformer":
            self.function_name(str(node.get("func_name", "")))
        self.children(node, skip="table_function" if kind == "TableExpression" else None)

    def children(self, node: dict[str, Any], skip: str | None = None) -> None:
        if node.get("type") == "Literal":
            return
        for key, value in node.items():
            if key != skip:
                self.value(value)

    def value(self, value: Any) -> None:
        if isinstance(value, dict):
            if "type" in value:
                self.node(value)
            else:
                self.children(value)
        elif isinstance(value, list):
            for item in value:
                self.value(item)

    def table(self, node: dict[str, Any]) -> None:
        parts = node.get("name_parts") or [node.get("name", "")]
        if any(child.get("type") == "QueryParameter" for child in node.get("children", [])):
            raise RefusedQuery("query refused: a table named by a query parameter")
        if len(parts) > 1 and parts[0] != self.database:
            raise RefusedQuery(f"query refused: table {'.'.join(parts)} is outside the "
                               f"{self.database} database")
        if len(parts) > 2:
            raise RefusedQuery(f"query refused: table {'.'.join(parts)} is not a table name")

    def table_function(self, node: dict[str, Any]) -> None:
        name = str(node.get("name", ""))
        if name not in TABLE_FUNCTIONS:
            raise RefusedQuery(f"query refused: table function {name}() is not allowed "
                               f"(only {', '.join(sorted(TABLE_FUNCTIONS))})")
        self.children(node)

    def function(self, node: dict[str, Any]) -> None:
        name = str(node.get("name", ""))
        self.function_name(name)
        if name in IN_FUNCTIONS or self.catalog.resolve(name) in IN_FUNCTIONS:
            arguments = (node.get("arguments") or {}).get("children") or []
            if len(arguments) == 2 and arguments[1].get("type") == "Identifier":
                parts = arguments[1].get("name_parts") or [arguments[1].get("name", "")]
                if len(parts) > 1 and parts[0] != self.database:
                    raise RefusedQuery(f"query refused: IN {'.'.join(parts)} reads a table "
                                       f"outside the {self.database} database")

    def function_name(self, name: str) -> None:
        if not self.catalog.allowed(name):
            raise RefusedQuery(f"query refused: function {name}() is not allowed in user "
                               "queries (it can reach files, the network, settings or "
                               "other tables)")


def check(tree: dict[str, Any], catalog: FunctionCatalog, database: str,
          table_bytes: dict[str, Any] | None = None) -> None:
    """Refuse (:class:`RefusedQuery`) a parsed statement that is not one plain SELECT
    over ``database``'s tables; see the module docstring for the rules. ``table_bytes``
    is :data:`TABLE_BYTES_SQL`'s parsed ``SelectQuery`` (as :func:`_names_list_as_marker`
    leaves it), the one system read allowed."""
    kind = str(tree.get("type"))
    if kind not in {"SelectWithUnionQuery", "SelectIntersectExceptQuery"}:
        raise RefusedQuery(f"query refused: user SQL is readonly: one SELECT, not "
                           f"{_statement_kind(kind)}")
    _Check(catalog, database, table_bytes).node(tree)


def parse(client: Client, sql: str, limits: Limits) -> tuple[str, dict[str, Any]]:
    """The canonical text of ``sql`` and its tree, by the engine's own parser; refuses
    (one line) what is not exactly one statement."""
    try:
        row = client.query(
            "SELECT formatQuery({sql:String}) AS canonical, parseQueryToJSON(canonical)",
            parameters={"sql": sql}, settings=limits.engine_settings()).result_rows[0]
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        if "Unknown function" in message and "parseQueryToJSON" in message:
            raise RefusedQuery("query refused: this ClickHouse cannot parse queries for the "
                               "guard (parseQueryToJSON needs ClickHouse 26.8 or later)"
                               ) from exc
        raise RefusedQuery(f"query refused: not one valid SQL statement: "
                           f"{_engine_reason(message)}") from exc
    return str(row[0]), dict(orjson.loads(row[1]))


def _engine_reason(message: str) -> str:
    """ClickHouse's reason without its scope echo (which repeats the whole query)."""
    reason = message.split(": In scope SELECT formatQuery", 1)[0]
    return reason.removeprefix("Code: 62. DB::Exception: ")[:300]


#: statements a guard remembers as vetted (their canonical text): the processors'
#: lookups, the detectors' rules and the dashboards send the same few texts again and
#: again, and each vet is a round trip to the engine's parser (~1.5 ms of its CPU, as
#: much as a lookup of a few runs itself)
VETTED_KEPT = 512


class SqlGuard:
    """The rules and limits for one store; the function catalog is read from the first
    client it sees (one engine per store, so one catalog). A statement that passed is
    remembered by its exact text (parameters are bound apart, so the text is all the
    vet reads); a refused one is vetted again each time."""

    def __init__(self, settings: Settings) -> None:
        self.database = settings.database
        self.limits = Limits.of(settings)
        self._catalog: FunctionCatalog | None = None
        self._table_bytes: dict[str, Any] | None = None
        self._vetted: dict[str, str] = {}
        self._lock = threading.Lock()

    def catalog(self, client: Client) -> tuple[FunctionCatalog, dict[str, Any] | None]:
        """The engine's function catalog and the parsed :data:`TABLE_BYTES_SQL`."""
        with self._lock:
            if self._catalog is None:
                _, tree = parse(client, TABLE_BYTES_SQL, self.limits)
                select = tree["list_of_selects"]["children"][0]
                self._table_bytes = _names_list_as_marker(select)
                self._catalog = FunctionCatalog.load(client)
            return self._catalog, self._table_bytes

    def vet(self, client: Client, sql: str) -> str:
        """The canonical SQL to run for ``sql``, or :class:`RefusedQuery`."""
        with self._lock:
            known = self._vetted.get(sql)
        if known is not None:
            return known
        canonical, tree = parse(client, sql, self.limits)
        catalog, table_bytes = self.catalog(client)
        check(tree, catalog, self.database, table_bytes)
        with self._lock:
            if len(self._vetted) >= VETTED_KEPT:
                self._vetted.clear()
            self._vetted[sql] = canonical
        return canonical


#: ClickHouse error codes of the limits, and what a user is told
LIMIT_ERRORS = {
    "TIMEOUT_EXCEEDED": "the query ran longer than LOOPWATCH_QUERY_TIMEOUT_S ({timeout:g} s)",
    "MEMORY_LIMIT_EXCEEDED": "the query needed more memory than "
                             "LOOPWATCH_QUERY_MAX_MEMORY_BYTES ({memory} bytes)",
    "TOO_MANY_ROWS_OR_BYTES": "the result is larger than LOOPWATCH_QUERY_MAX_RESULT_ROWS "
                              "({rows} rows) or LOOPWATCH_QUERY_MAX_RESULT_BYTES ({bytes} "
                              "bytes); add a LIMIT or aggregate",
    "QUERY_WAS_CANCELLED": "the query was cancelled (KILL QUERY, or the store stopping)",
}


def limit_hit(message: str, limits: Limits) -> str | None:
    """The one-line explanation when ``message`` is a limit's error, else None."""
    for code, text in LIMIT_ERRORS.items():
        if f"({code})" in message:
            return "query stopped: " + text.format(
                timeout=limits.timeout_s, memory=limits.max_memory_bytes,
                rows=limits.max_result_rows, bytes=limits.max_result_bytes)
    return None
