"""Cost recomputed from tokens with the versioned price table (``prices.json``).

The one definition of a call's cost: the processors price calls with it, and the store
renders the same table and arithmetic into the view that writes ``llm_calls``
(:mod:`loopwatch.store.event_views`), which is why it sits on the floor both import.
The table file itself stays the processors' package data (``processors/prices.json``).

Cache writes cost 1.25 x the input price (2 x for the 1-hour TTL), cache reads 0.1 x.
A model missing from the table is priced at the table's default and says so.

The seed's worked example (15 steps, a 6,000-token stable block, 400 new tokens per
step, Sonnet-class $3/MTok): $0.396 uncached, about $0.174 cached.

>>> table = PriceTable.load()
>>> def step_cost(k, read, write):
...     return table.cost("claude-sonnet-4", 6000 + 400 * k, 0, read, write).cost_usd
>>> uncached = sum(step_cost(k, 0, 0) for k in range(15))
>>> round(uncached, 4)
0.396
>>> round(step_cost(0, 0, 6000) + sum(step_cost(k, 6000, 0) for k in range(1, 15)), 4)
0.1737

A write for the 1-hour TTL costs 2 x input, not 1.25 x (D12): 6,000 tokens at $3/MTok.

>>> [round(table.cost("claude-sonnet-4", 6000, 0, 0, 6000, ttl).cost_usd, 4)
...  for ttl in ("5m", "1h")]
[0.0225, 0.036]
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Price:
    input: float
    output: float


@dataclass(frozen=True, slots=True)
class PricedCall:
    cost_usd: float
    price_version: str
    known_model: bool


def _dollars(value: Any, where: str) -> float:
    """A price or multiplier as read from the table: a finite number >= 0.

    >>> _dollars(3, "m.input")
    3.0
    >>> _dollars("3.0", "m.input")
    Traceback (most recent call last):
    ValueError: m.input must be a number >= 0, not '3.0'
    """
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where} must be a number >= 0, not {value!r}")
    return float(value)


@dataclass(frozen=True)
class PriceTable:
    version: str
    default: Price
    models: dict[str, Price]
    write_5m: float
    write_1h: float
    read: float

    @classmethod
    def load(cls, path: Path | None = None) -> PriceTable:
        """The shipped table (``processors/prices.json``), or the one at ``path``.

        Every price and multiplier must be a number >= 0, else this raises naming it: a
        quoted number loaded as it was would make pricing raise on every call of that
        model, each a dead letter, instead of the processor refusing to start."""
        source = path or resources.files("loopwatch.processors").joinpath("prices.json")
        name = str(path or "processors/prices.json")
        data = json.loads(source.read_text())
        multipliers = data["cache_multipliers"]

        def price(model: str, entry: dict[str, Any]) -> Price:
            return Price(input=_dollars(entry.get("input"), f"{name}: {model}.input"),
                         output=_dollars(entry.get("output"), f"{name}: {model}.output"))

        def multiplier(key: str) -> float:
            return _dollars(multipliers.get(key), f"{name}: cache_multipliers.{key}")

        return cls(
            version=str(data["version"]),
            default=price("default", data["default"]),
            models={model: price(model, entry) for model, entry in data["models"].items()},
            write_5m=multiplier("write_5m"),
            write_1h=multiplier("write_1h"),
            read=multiplier("read"),
        )

    def cost(
        self,
        model: str,
        input_tokens: int,
        output_tokens: int,
        cache_read: int,
        cache_creation: int,
        cache_ttl: str = "5m",
    ) -> PricedCall:
        """Price one call; ``input_tokens`` includes the cache (OTel semantics)."""
        return self.priced(model, self.dollars(
            model, input_tokens, output_tokens, cache_read, cache_creation, cache_ttl))

    def priced(self, model: str, dollars: float) -> PricedCall:
        """A call of ``model`` that :meth:`dollars` priced at ``dollars``, with this
        table's version and whether it knows the model."""
        return PricedCall(dollars, self.version, model in self.models)

    def dollars(
        self,
        model: str,
        input_tokens: int,
        output_tokens: int,
        cache_read: int,
        cache_creation: int,
        cache_ttl: str = "5m",
    ) -> float:
        """:meth:`cost`'s dollars alone: the fold prices every model call and keeps only
        the figure (building the :class:`PricedCall` cost it as much again, ~1.5 µs).

        >>> table = PriceTable.load()
        >>> table.dollars("gpt-unknown", 1000, 10, 0, 0) == table.cost(
        ...     "gpt-unknown", 1000, 10, 0, 0).cost_usd
        True
        """
        price = self.models.get(model) or self.default
        uncached = max(0, input_tokens - cache_read - cache_creation)
        write_multiplier = self.write_1h if cache_ttl == "1h" else self.write_5m
        return (
            uncached * price.input
            + cache_creation * price.input * write_multiplier
            + cache_read * price.input * self.read
            + output_tokens * price.output
        ) / 1_000_000


def cost_mismatch(reported: float | None, computed: float, tolerance: float) -> bool:
    """True when the agent's own cost differs from ours by more than ``tolerance`` (relative).

    >>> cost_mismatch(0.0102, 0.01, 0.05), cost_mismatch(0.02, 0.01, 0.05)
    (False, True)
    >>> cost_mismatch(None, 1.0, 0.0)
    False
    """
    if reported is None:
        return False
    return abs(reported - computed) > tolerance * max(abs(computed), 1e-9) + 1e-9
