"""The price table, where the processors have always imported it from.

It lives in :mod:`loopwatch.core.pricing` since the store renders it into the views that
price ``llm_calls`` rows (:mod:`loopwatch.store.event_views`), and the store may not
import the processors; this name stays for the processors, detectors and the shell.
"""

from loopwatch.core.pricing import Price, PricedCall, PriceTable, cost_mismatch

__all__ = ["Price", "PriceTable", "PricedCall", "cost_mismatch"]
