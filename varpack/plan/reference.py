"""Reference packers: the naive, obviously-correct twins of :mod:`varpack.plan.bfd` and
:mod:`varpack.plan.sequential`, for tests and benchmarks.

Public so that tests, benchmarks and users' own checks compare against the same definition (as
``varpack.ops.gated_delta_rule.naive`` is for the gated delta rule); ``plan_packs`` never uses them. They
work on Python lists, one item at a time, and return the bins as lists of item indices in placement order,
which is ``[items[offsets[p]:offsets[p+1]] for p ...]`` of the vectorized functions' CSR output.

- :func:`naive_bfd`: best-fit decreasing written the obvious way, O(I * bins): the definition varpack's
  vectorized BFD (:func:`varpack.plan.bfd.best_fit_decreasing`) must reproduce item for item.
- :func:`segment_tree_bfd`: best-fit decreasing with one Python step per item and a segment tree over
  remaining capacities ``0..L`` (the approach of TRL's ``pack_dataset(strategy="bfd")``), written here from
  the algorithm's description. Ties go to the lowest bin index (a heap per capacity), so its output is
  identical to :func:`naive_bfd` and can be compared exactly at benchmark scale (``benchmarks/planner.py``).
- :func:`naive_next_fit`: order-preserving next-fit (:func:`varpack.plan.sequential.next_fit`), one item at
  a time.

Every function takes ``lengths`` (a sequence of ints, each in ``1..capacity`` tokens) and ``capacity``
(``L``, tokens per bin) and does not validate them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["bfd_item_order", "naive_bfd", "naive_next_fit", "segment_tree_bfd"]


def bfd_item_order(lengths: Sequence[int]) -> list[int]:
    """Longest first, ties by lower index first."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def naive_bfd(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices in placement order) of best-fit decreasing; every length in 1..capacity."""
    remaining: list[int] = []
    bins: list[list[int]] = []
    for i in bfd_item_order(lengths):
        s = lengths[i]
        best = -1
        for b, r in enumerate(remaining):
            if r >= s and (best < 0 or r < remaining[best]):
                best = b
        if best < 0:
            remaining.append(capacity)
            bins.append([])
            best = len(bins) - 1
        remaining[best] -= s
        bins[best].append(i)
    return bins


def segment_tree_bfd(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Same result as :func:`naive_bfd`, O(I log L): per item, find the smallest remaining capacity >= length
    that some bin has (segment tree of bin counts over capacities), take that capacity's lowest bin index."""
    size = 1
    while size < capacity + 1:
        size *= 2
    tree = [0] * (2 * size)  # tree[size + r] = number of bins with remaining capacity r
    heaps: dict[int, list[int]] = {}

    def add(r: int, delta: int) -> None:
        i = size + r
        while i:
            tree[i] += delta
            i //= 2

    def first_at_least(s: int) -> int:
        i = size + s
        if tree[i]:
            return s
        while i > 1:  # climb until a right sibling holds a bin
            if i % 2 == 0 and tree[i + 1]:
                i += 1
                break
            i //= 2
        else:
            return -1
        while i < size:  # descend to the leftmost leaf with a bin
            i = 2 * i if tree[2 * i] else 2 * i + 1
        return i - size

    bins: list[list[int]] = []
    for i in bfd_item_order(lengths):
        s = lengths[i]
        r = first_at_least(s)
        if r < 0:
            b, r = len(bins), capacity
            bins.append([])
        else:
            b = heapq.heappop(heaps[r])
            add(r, -1)
        bins[b].append(i)
        r -= s
        if r > 0:
            heapq.heappush(heaps.setdefault(r, []), b)
            add(r, 1)
    return bins


def naive_next_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Order-preserving next-fit: a new bin as soon as the next item does not fit."""
    bins: list[list[int]] = []
    room = -1
    for i, s in enumerate(lengths):
        if not bins or s > room:
            bins.append([])
            room = capacity
        bins[-1].append(i)
        room -= s
    return bins
