"""Order-preserving next-fit packing.

Source: next-fit, the simplest on-line bin-packing rule (Johnson 1973; Coffman, Garey, Johnson 1996):
items are taken in their given order and a new bin is opened as soon as the next item does not fit. It is
"concatenate in data order and cut at sample boundaries" (unlike TRL's ``strategy="wrapped"``, which cuts
samples at the row end). It keeps the data order (curricula, deterministic streams) at the cost of fill.
"""

from __future__ import annotations

import numpy as np

__all__ = ["next_fit"]


def next_fit(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack items in their given order, opening a new bin whenever the next item does not fit.

    Args:
        lengths: ``[I]`` integer array, every value in ``1..capacity`` (tokens).
        capacity: the bin size ``L`` in tokens (``packing_length``), ``>= 1``.

    Returns:
        ``(offsets, items)`` in CSR layout as in :func:`varpack.plan.bfd.best_fit_decreasing`; here
        ``items == arange(I)`` (order preserved) and only ``offsets`` ``[P+1]`` int64 carries information.

    Raises:
        ValueError: if a length is outside ``1..capacity``.

    Cost: one cumulative sum and one vectorized ``searchsorted`` (O(I log I)), then one Python step per
    bin (not per item) to follow the chain of bin starts.
    """
    lengths = np.asarray(lengths)
    n = int(lengths.shape[0])
    items = np.arange(n, dtype=np.int64)
    if n == 0:
        return np.zeros(1, np.int64), items
    if int(lengths.min()) < 1 or int(lengths.max()) > capacity:
        bad = int(np.flatnonzero((lengths < 1) | (lengths > capacity))[0])
        raise ValueError(
            f"next_fit needs lengths in 1..{capacity}; item {bad} has length {int(lengths[bad])}"
        )
    cs = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=cs[1:])
    # A bin starting at item i holds items i..j-1, j the last index with cs[j] - cs[i] <= capacity (j > i
    # because every length <= capacity, and j <= i + capacity because every length >= 1). nxt[i] = j is
    # computed vectorized per block; the chain 0 -> nxt[0] -> ... of bin starts is then followed with one
    # Python step per bin.
    starts = [0]
    block = 1 << 20
    i = 0
    for a in range(0, n, block):
        b = min(n, a + block)
        if i >= b:
            continue
        window = cs[a : min(n + 1, b + capacity + 1)]
        nxt = (np.searchsorted(window, cs[a:b] + capacity, side="right") - 1 + a).tolist()
        while i < b:
            i = nxt[i - a]
            if i >= n:
                break
            starts.append(i)
    offsets = np.asarray(starts + [n], dtype=np.int64)
    return offsets, items
