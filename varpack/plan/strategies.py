"""The packing strategies, by name: the one table that ``plan_packs``, the CLI and ``SFTConfig`` read.

A strategy is a function with one signature::

    pack(lengths, capacity) -> (offsets, items)

- ``lengths``: ``[I]`` int64 item lengths in tokens, every value in ``1..capacity``. The items are whole
  samples and pieces of overlong samples, in dataset order (a piece sits where its sample was); empty and
  overlong samples were already handled by :func:`varpack.plan.plan_packs` (the overflow policy is shared,
  not per strategy).
- ``capacity``: ``L``, the token budget of one pack (``packing_length``), an int ``>= 1``.
- returns the packs in CSR form: ``offsets`` ``[P+1]`` int64 (``offsets[0] == 0``, ``offsets[-1] == I``,
  non-decreasing) and ``items`` ``[I]`` int64, a permutation of ``arange(I)``: pack ``p`` holds the items
  ``items[offsets[p]:offsets[p+1]]``, whose lengths sum to at most ``capacity``.
- it raises ``ValueError`` for a length outside ``1..capacity``.
- it is deterministic: the same lengths and capacity give the same packs. A plan's fingerprint covers only
  the lengths and the settings, and the seed only reorders packs between epochs
  (:meth:`varpack.plan.PackPlan.pack_order`), so a strategy takes no seed or random generator.

A new strategy is one module (its function, with its source in the docstring) plus one line in
:data:`STRATEGY_TABLE`; ``tests/plan/test_plan.py`` checks every registered strategy against these rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from varpack.plan.bfd import best_fit_decreasing
from varpack.plan.sequential import next_fit

__all__ = ["STRATEGIES", "STRATEGY_TABLE", "PackFn", "Strategy", "strategies_help"]

#: ``pack(lengths [I] int64, capacity) -> (offsets [P+1] int64, items [I] int64)``, see the module docstring.
PackFn = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]


class Strategy(NamedTuple):
    """One entry of :data:`STRATEGY_TABLE`."""

    pack: PackFn
    """The packing function (signature in the module docstring)."""
    summary: str
    """A few words for ``--help`` (``varpack plan`` / ``varpack sft``)."""


#: name -> strategy. The order is the order of the CLI's choices.
STRATEGY_TABLE: dict[str, Strategy] = {
    "bfd": Strategy(best_fit_decreasing, "global best-fit decreasing"),
    "sequential": Strategy(next_fit, "order-preserving next-fit"),
}

#: The strategy names (``plan_packs(strategy=...)``, ``--packing-strategy``, ``SFTConfig.packing_strategy``).
STRATEGIES: tuple[str, ...] = tuple(STRATEGY_TABLE)


def strategies_help() -> str:
    """``"bfd: global best-fit decreasing; sequential: order-preserving next-fit"``: one clause per strategy."""
    return "; ".join(f"{name}: {s.summary}" for name, s in STRATEGY_TABLE.items())
