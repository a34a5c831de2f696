"""Bin packing of samples into rows of ``packing_length`` tokens: pure numpy, CPU, deterministic.

``plan_packs(lengths, packing_length, *, strategy="bfd"|"sequential", overflow=..., seed=0) -> PackPlan``.
"""

from __future__ import annotations

from varpack.plan.bfd import best_fit_decreasing
from varpack.plan.plan import (
    DEFAULT_PACKING_LENGTH,
    OVERFLOW_POLICIES,
    STRATEGIES,
    PackPlan,
    lengths_fingerprint,
    plan_packs,
)
from varpack.plan.sequential import next_fit

__all__ = [
    "DEFAULT_PACKING_LENGTH",
    "OVERFLOW_POLICIES",
    "STRATEGIES",
    "PackPlan",
    "best_fit_decreasing",
    "lengths_fingerprint",
    "next_fit",
    "plan_packs",
]
