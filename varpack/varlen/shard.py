"""Context parallelism's split of one packed row: which tokens each rank of a context-parallel group holds.

Under context parallelism (``--context-parallel N``) the ``N`` ranks of a group share ONE packed row of ``T``
tokens: each rank runs the token-local layers (embedding, norms, MLP, projections, the loss) on its own
share and meets the others only where a layer mixes tokens (attention, the gated delta rule, the short
convolution; :mod:`varpack.attn.context_parallel`). This module is the pure index math of that split, on
the CPU, once per batch:

* :func:`zigzag_split` (the default): every document (segment of ``cu_seqlens``) is cut into ``2N`` chunks
  of near-equal size, and rank ``r`` takes chunks ``r`` and ``2N - 1 - r``. The causal work of a chunk grows
  with its distance from the document's start, so each rank gets one cheap and one dear chunk of every
  document: near-equal causal attention work per rank on any length mix (``benchmarks/context_parallel.py``
  measures it on the real mix). Chunk sizes differ by at most one token; the extra tokens of a document go
  to the ranks in turn, so token counts stay within a few tokens across ranks. Documents need no padding to
  a multiple of ``2N`` (Megatron's THD split and ring-flash-attn's zigzag varlen functions need one).
* :func:`contiguous_split`: the row cut into ``N`` contiguous runs, documents ignored (the baseline the
  benchmark compares with).

:class:`ContextParallelShard` carries the split of one row (every rank's token positions, so any rank can
reorder the whole row) and its own rank. It travels in the batch under ``cp_shard``
(:data:`varpack.schema.CP_SHARD`); the model's packing guard binds it to the process group and the attention
mode of the model (:meth:`ContextParallelShard.bind`), and every layer reads that one object.

The math of the split: a rank's tokens are listed in increasing row order (global position), so slicing a
token-aligned tensor with :attr:`ContextParallelShard.index` keeps each document's tokens in order; the
``order`` of the whole layout (rank 0's tokens, then rank 1's, ...) is the row order an all-to-all produces,
and :meth:`ContextParallelShard.inverse` maps it back to row order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "CONTEXT_PARALLEL_SPLITS",
    "ContextParallelShard",
    "contiguous_split",
    "split_row",
    "zigzag_split",
]


def _check(offsets: Sequence[int], size: int) -> np.ndarray:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"context-parallel size must be an int >= 1, got {size!r}")
    cu = np.asarray(offsets, dtype=np.int64)
    if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or (np.diff(cu) < 0).any():
        raise ValueError(f"offsets must be [0, ..., T] and never decrease, got {list(cu[:8])}...")
    return cu


def zigzag_split(offsets: Sequence[int], size: int) -> list[np.ndarray]:
    """Each document cut into ``2 * size`` chunks; rank ``r`` holds chunks ``r`` and ``2 * size - 1 - r``.

    Args:
        offsets: ``[N + 1]`` host offsets of the row's documents (``cu_seqlens``), ``[0, ..., T]``; zero-length
            documents are allowed.
        size: ranks of the context-parallel group.

    Returns:
        ``size`` int64 arrays: the row positions each rank holds, increasing; together every position once.

    Raises:
        ValueError: bad offsets or size.

    Example (one document of 10 tokens over 2 ranks: chunks of 3, 3, 2, 2; rank 0 takes chunks 0 and 3):
        >>> [p.tolist() for p in zigzag_split([0, 10], 2)]
        [[0, 1, 2, 8, 9], [3, 4, 5, 6, 7]]
    """
    cu = _check(offsets, size)
    chunks = 2 * size
    parts: list[list[np.ndarray]] = [[] for _ in range(size)]
    turn = 0  # the rank that gets the next extra token: extras go round the ranks, document after document
    for start, stop in zip(cu[:-1].tolist(), cu[1:].tolist()):
        length = stop - start
        if length == 0:
            continue
        base, extra = divmod(length, chunks)
        sizes = np.full(chunks, base, dtype=np.int64)
        for i in range(
            extra
        ):  # one extra token per rank in turn: its first chunk, then (extra > size) its second
            rank = (turn + i) % size
            sizes[rank if i < size else chunks - 1 - rank] += 1
        turn = (turn + extra) % size
        bounds = start + np.concatenate([[0], np.cumsum(sizes)])
        for r in range(size):
            parts[r].append(np.arange(bounds[r], bounds[r + 1]))
            parts[r].append(np.arange(bounds[chunks - 1 - r], bounds[chunks - r]))
    empty = np.zeros(0, dtype=np.int64)
    return [np.concatenate(p).astype(np.int64) if p else empty for p in parts]


def contiguous_split(offsets: Sequence[int], size: int) -> list[np.ndarray]:
    """The row cut into ``size`` contiguous runs of near-equal length, documents ignored (the first ``T %
    size`` runs one token longer).

    Raises:
        ValueError: bad offsets or size.

    Example:
        >>> [p.tolist() for p in contiguous_split([0, 3, 7], 2)]
        [[0, 1, 2, 3], [4, 5, 6]]
    """
    cu = _check(offsets, size)
    return [p.astype(np.int64) for p in np.array_split(np.arange(int(cu[-1]), dtype=np.int64), size)]


#: split name -> function ``(offsets, size) -> [positions of rank r]``
CONTEXT_PARALLEL_SPLITS: dict[str, Callable[[Sequence[int], int], list[np.ndarray]]] = {
    "zigzag": zigzag_split,
    "contiguous": contiguous_split,
}


def split_row(offsets: Sequence[int], size: int, split: str = "zigzag") -> list[np.ndarray]:
    """Every rank's row positions under ``split`` (a name of :data:`CONTEXT_PARALLEL_SPLITS`).

    Raises:
        ValueError: an unknown split name, bad offsets or size.
    """
    try:
        fn = CONTEXT_PARALLEL_SPLITS[split]
    except KeyError:
        raise ValueError(
            f"unknown context-parallel split {split!r}; choose one of {sorted(CONTEXT_PARALLEL_SPLITS)}"
        ) from None
    return fn(offsets, size)


class ContextParallelShard:
    """One rank's share of a packed row of ``T`` tokens split over a context-parallel group of ``size`` ranks.

    Args:
        parts: every rank's row positions (``size`` int64 arrays / tensors, each increasing, together a
            permutation of ``0..T-1``), e.g. from :func:`split_row`.
        rank: this rank's index in the group.
        split: the name of the split that made ``parts`` (reported; not re-derived).
        full_input_ids: the whole row's ``input_ids`` ``[T]`` (CPU int64), kept for a vision-language model:
            the rank finds which of the vision tower's feature rows fall on its tokens. ``None`` otherwise.

    Attributes (read-only):
        rank, size, total (``T``), counts (tokens of every rank, a tuple of ints), num_local (``counts[rank]``),
        index (``[T_r]`` int64 CPU: this rank's row positions, increasing), order (``[T]`` int64 CPU: rank 0's
        positions, then rank 1's, ...: the row order after an all-to-all), split, full_input_ids,
        group / attention (``None`` until :meth:`bind`).

    Per-batch derived values (device copies, document ids) are built once and kept (:meth:`memo`), as on
    :class:`varpack.varlen.VarlenMeta`. It pickles (DataLoader workers) without its process group.

    Raises:
        ValueError: ``parts`` that are not a permutation of the row, a rank outside the group.
    """

    __slots__ = (
        "_derived",
        "_lock",
        "attention",
        "counts",
        "full_input_ids",
        "group",
        "index",
        "order",
        "rank",
        "size",
        "split",
        "total",
    )

    def __init__(
        self,
        parts: Sequence[Any],
        rank: int,
        *,
        split: str = "zigzag",
        full_input_ids: torch.Tensor | None = None,
        _order: torch.Tensor | None = None,
        _check_parts: bool = True,
    ) -> None:
        size = len(parts)
        if size < 1:
            raise ValueError("a context-parallel shard needs the parts of at least one rank")
        if not 0 <= int(rank) < size:
            raise ValueError(f"rank {rank} is outside a context-parallel group of {size} ranks")
        arrays = [torch.as_tensor(np.asarray(p), dtype=torch.int64).reshape(-1) for p in parts]
        counts = tuple(int(a.numel()) for a in arrays)
        order = _order if _order is not None else torch.cat(arrays)
        total = int(order.numel())
        if _check_parts:
            seen = torch.zeros(total, dtype=torch.bool)
            if total and (int(order.min()) < 0 or int(order.max()) >= total):
                raise ValueError(f"the parts hold positions outside the row of {total} tokens")
            seen[order] = True
            if not bool(seen.all()):
                raise ValueError(f"the parts of the {size} ranks do not cover the row of {total} tokens once")
            for r, a in enumerate(arrays):
                if a.numel() > 1 and not bool((a[1:] > a[:-1]).all()):
                    raise ValueError(f"the positions of rank {r} must increase (row order)")
        if full_input_ids is not None:
            full_input_ids = torch.as_tensor(full_input_ids).reshape(-1)
            if full_input_ids.numel() != total:
                raise ValueError(f"full_input_ids has {full_input_ids.numel()} tokens, the row {total}")
        offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
        setattr_ = object.__setattr__
        setattr_(self, "rank", int(rank))
        setattr_(self, "size", size)
        setattr_(self, "total", total)
        setattr_(self, "counts", counts)
        setattr_(self, "order", order)
        setattr_(self, "index", order[offsets[rank] : offsets[rank + 1]])
        setattr_(self, "split", str(split))
        setattr_(self, "full_input_ids", full_input_ids)
        setattr_(self, "group", None)
        setattr_(self, "attention", None)
        setattr_(self, "_derived", {"offsets": offsets})
        setattr_(self, "_lock", threading.RLock())  # re-entrant: a build may read another memo

    @classmethod
    def from_offsets(
        cls,
        offsets: Sequence[int],
        size: int,
        rank: int,
        *,
        split: str = "zigzag",
        full_input_ids: torch.Tensor | None = None,
    ) -> ContextParallelShard:
        """The shard of ``rank`` for a row with document ``offsets`` (``cu_seqlens`` on the host) under
        ``split`` (:func:`split_row`).

        Raises:
            ValueError: an unknown split, bad offsets, a rank outside the group, or a row of fewer tokens
                than ranks (a rank would hold nothing).
        """
        parts = split_row(offsets, size, split)
        total = int(offsets[-1])
        if total < size:
            raise ValueError(
                f"a packed row of {total} tokens cannot be split over {size} context-parallel ranks (every rank "
                "needs at least one token)"
            )
        return cls(parts, rank, split=split, full_input_ids=full_input_ids, _check_parts=False)

    # -- immutability, pickling ------------------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ContextParallelShard is frozen (cannot set {name!r})")

    def __reduce__(self):  # the layout only: a process group does not pickle
        return (_rebuild, (self.parts(), self.rank, self.split, self.full_input_ids, self.order))

    def __repr__(self) -> str:
        bound = "" if self.group is None else f", bound ({self.attention})"
        return (
            f"ContextParallelShard(rank {self.rank} of {self.size}, T={self.total}, local={self.num_local}, "
            f"split={self.split}{bound})"
        )

    # -- views --------------------------------------------------------------------------------------------
    @property
    def num_local(self) -> int:
        """Tokens this rank holds (``T_r``)."""
        return self.counts[self.rank]

    def parts(self) -> list[torch.Tensor]:
        """Every rank's row positions (views of :attr:`order`)."""
        off = self._derived["offsets"]
        return [self.order[off[r] : off[r + 1]] for r in range(self.size)]

    def rank_index(self, rank: int) -> torch.Tensor:
        """``[T_rank]`` int64 CPU: the row positions of ``rank``."""
        off = self._derived["offsets"]
        return self.order[off[rank] : off[rank + 1]]

    def take(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The tokens of this rank from a tensor whose ``dim`` is the row's token axis (``T`` entries).

        Raises:
            ValueError: ``x`` does not have ``T`` entries along ``dim``.
        """
        if x.shape[dim] != self.total:
            raise ValueError(
                f"a tensor of shape {tuple(x.shape)} has {x.shape[dim]} entries along dim {dim}, the row {self.total}"
            )
        return x.index_select(dim, self.index.to(x.device))

    def bind(self, group: Any, attention: str) -> ContextParallelShard:
        """This layout bound to a process group and an attention mode (``"auto"``, ``"ulysses"``, ``"ring"``):
        a new frozen shard sharing this one's tensors and derived values; what the model's layers read."""
        bound = object.__new__(ContextParallelShard)
        for name in self.__slots__:
            if name not in ("group", "attention", "_lock"):
                object.__setattr__(bound, name, getattr(self, name))
        object.__setattr__(bound, "group", group)
        object.__setattr__(bound, "attention", str(attention))
        object.__setattr__(bound, "_lock", self._lock)
        return bound

    # -- derived, once per batch -----------------------------------------------------------------------------
    def memo(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()`` once per ``key`` for this batch, then the kept result (thread-safe; shared by every
        :meth:`bind` of the shard)."""
        with self._lock:
            if key not in self._derived:
                self._derived[key] = build()
            return self._derived[key]

    def inverse(self) -> torch.Tensor:
        """``[T]`` int64 CPU: for every row position, its place in :attr:`order` (``order[inverse] = arange``)."""

        def build() -> torch.Tensor:
            inv = torch.empty_like(self.order)
            inv[self.order] = torch.arange(self.total, dtype=torch.int64)
            return inv

        return self.memo("inverse", build)

    def on(self, name: str, device: torch.device | str) -> torch.Tensor:
        """``index``, ``order`` or ``inverse`` on ``device`` (one copy per batch and device)."""
        device = torch.device(device)
        base = {"index": lambda: self.index, "order": lambda: self.order, "inverse": self.inverse}[name]()
        if base.device == device:
            return base
        return self.memo((name, str(device)), lambda: base.to(device, non_blocking=True))


def _rebuild(parts, rank, split, full_input_ids, order) -> ContextParallelShard:
    return ContextParallelShard(
        parts, rank, split=split, full_input_ids=full_input_ids, _order=order, _check_parts=False
    )
