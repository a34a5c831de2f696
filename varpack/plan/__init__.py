"""Bin packing of samples into rows of ``packing_length`` tokens: pure numpy, CPU, deterministic.

``plan_packs(lengths, packing_length, *, strategy="bfd"|"sequential", overflow=..., seed=0) -> PackPlan``.

- :mod:`varpack.plan.plan`: ``plan_packs`` (the overflow policy, shared by every strategy) and ``PackPlan``.
- :mod:`varpack.plan.strategies`: ``STRATEGY_TABLE``, name -> packing function (``bfd.py``,
  ``sequential.py``); a new strategy is one module plus one line there.
- :mod:`varpack.plan.reference`: naive, obviously-correct packers that tests and benchmarks compare the
  vectorized ones with, pack for pack (not used by ``plan_packs``).
- :mod:`varpack.plan.report`: the packing report, as data (``plan_summary``) and renderers (text, rich
  table, PNG histograms).

Importing this package imports numpy only (the CLI's parsers read ``STRATEGIES`` from here).
"""

from __future__ import annotations

from varpack.plan.bfd import best_fit_decreasing
from varpack.plan.plan import (
    DEFAULT_PACKING_LENGTH,
    OVERFLOW_POLICIES,
    PackPlan,
    lengths_fingerprint,
    plan_packs,
)
from varpack.plan.sequential import next_fit
from varpack.plan.strategies import STRATEGIES, STRATEGY_TABLE, Strategy, strategies_help

__all__ = [
    "DEFAULT_PACKING_LENGTH",
    "OVERFLOW_POLICIES",
    "STRATEGIES",
    "STRATEGY_TABLE",
    "PackPlan",
    "Strategy",
    "best_fit_decreasing",
    "lengths_fingerprint",
    "next_fit",
    "plan_packs",
    "strategies_help",
]
