"""``plan_packs``: which samples go together into one row of ``packing_length`` tokens, and ``PackPlan``.

A plan only needs the sample lengths (tokens after chat templating); it never touches token ids, so it is
pure numpy on the CPU, deterministic, and can be saved next to an encoded dataset and re-checked against it
with a fingerprint of the lengths.
"""

from __future__ import annotations

import hashlib
import json
import operator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from varpack.plan.strategies import STRATEGIES, STRATEGY_TABLE

__all__ = [
    "DEFAULT_PACKING_LENGTH",
    "OVERFLOW_POLICIES",
    "PackPlan",
    "STRATEGIES",
    "lengths_fingerprint",
    "overlong_pieces",
    "plan_packs",
    "supervised_mask",
]

OVERFLOW_POLICIES = ("error", "drop", "truncate", "split")
#: Tokens per pack when none is given: the one default of ``varpack plan``, ``varpack sft`` and ``SFTConfig``.
DEFAULT_PACKING_LENGTH = 4096
_FORMAT = "varpack-plan/1"
_MAX_LISTED = 20  # ids spelled out in error messages


def lengths_fingerprint(
    lengths: Any, packing_length: int, strategy: str, overflow: str, groups: Any = None
) -> str:
    """SHA-256 (hex) of the lengths and the planning settings that decide the packs.

    Args:
        lengths: ``[N]`` integer sample lengths (tokens); the values are hashed, whatever their dtype.
        packing_length: tokens per pack.
        strategy: a name in :data:`~varpack.plan.strategies.STRATEGIES`.
        overflow: the overflow policy.
        groups: ``[N]`` group id per sample (:func:`plan_packs` ``groups``), or None; hashed when given (a
            plan with groups never matches the same lengths without them).

    Returns:
        64 hex characters. The seed is not part of it: it only changes ``pack_order``, not the packs.
    """
    arr = np.asarray(lengths)
    if arr.size == 0:
        arr = np.zeros(0, np.int64)
    # hash the values, not the dtype: the narrowest of uint16 / uint32 / int64 that holds them all
    lo, hi = (int(arr.min()), int(arr.max())) if arr.size else (0, 0)
    dtype = "<u2" if 0 <= lo and hi < 2**16 else "<u4" if 0 <= lo and hi < 2**32 else "<i8"
    data = np.ascontiguousarray(arr, dtype=dtype)
    h = hashlib.sha256()
    h.update(
        f"{_FORMAT}|packing_length={int(packing_length)}|strategy={strategy}|overflow={overflow}|".encode()
    )
    h.update(f"n={data.shape[0]}|dtype={dtype}|".encode())
    h.update(memoryview(data).cast("B"))
    if groups is not None:
        g = np.ascontiguousarray(np.asarray(groups), dtype="<i8")
        h.update(f"|groups={g.shape[0]}|".encode())
        h.update(memoryview(g).cast("B"))
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class PackPlan:
    """The packs of one dataset: sample (or piece) ids per pack, with stats and the overflow report.

    Packs are stored in CSR form so that 10M samples cost two int64 arrays, not 10M Python objects:
    the ids of pack ``p`` are ``items[offsets[p]:offsets[p+1]]``. An id ``< num_samples`` is a sample id
    (its index in the encoded dataset); an id ``>= num_samples`` is a piece of an overlong sample
    (``overflow="truncate"`` or ``"split"``), resolved by :attr:`pieces`.

    Build with :func:`plan_packs`; save with :meth:`save`, reload with :meth:`load`.
    """

    packing_length: int
    """Token budget of one pack (``L``)."""
    strategy: str
    """A name in :data:`~varpack.plan.strategies.STRATEGY_TABLE`: ``"bfd"`` (global best-fit decreasing),
    ``"sequential"`` (order-preserving next-fit), ..."""
    seed: int
    """Seed of the per-epoch pack order (:meth:`pack_order`); does not change the packs."""
    num_samples: int
    """``N``: number of input lengths (samples), including empty and overlong ones."""
    offsets: np.ndarray
    """``[P+1]`` int64, ``offsets[0] == 0``, ``offsets[-1] == I`` (number of packed items)."""
    items: np.ndarray
    """``[I]`` int64 sample or piece ids, pack after pack; within a pack in placement order."""
    item_lengths: np.ndarray
    """``[I]`` int64 tokens of each entry of :attr:`items` (a piece's own length)."""
    piece_sample: np.ndarray
    """``[K]`` int64 sample id of piece ``num_samples + k``."""
    piece_start: np.ndarray
    """``[K]`` int64 first token (inclusive) of piece ``num_samples + k`` in its sample."""
    piece_stop: np.ndarray
    """``[K]`` int64 last token (exclusive) of piece ``num_samples + k`` in its sample."""
    overflow: dict[str, Any]
    """Report of everything that was not packed as a whole sample: ``policy``, ``empty_ids``,
    ``overlong_ids`` / ``overlong_lengths``, ``dropped_ids``, ``truncated_ids``, ``split_ids``,
    ``num_pieces`` (pieces packed), ``unsupervised_ids`` / ``unsupervised_pieces`` (whole samples /
    ``[sample_id, start, stop]`` pieces left out for want of a supervised token, :func:`plan_packs`
    ``supervised``), ``tokens_dropped`` (tokens of the input that are in no pack)."""
    fingerprint: str
    """:func:`lengths_fingerprint` of the lengths and settings this plan was made for."""
    groups: np.ndarray | None = None
    """``[N]`` int64 group id per sample when planned with ``groups`` (:func:`plan_packs`), else None."""

    def __repr__(self) -> str:
        return (
            f"PackPlan(strategy={self.strategy!r}, packing_length={self.packing_length}, "
            f"num_samples={self.num_samples}, num_packs={self.num_packs}, total_tokens={self.total_tokens}, "
            f"fill_ratio={self.fill_ratio:.4f}, overflow={self.overflow['policy']!r}, seed={self.seed})"
        )

    # ------------------------------------------------------------------ views
    @property
    def num_packs(self) -> int:
        """``P``: number of packs."""
        return int(self.offsets.shape[0]) - 1

    @property
    def num_items(self) -> int:
        """``I``: number of packed entries (samples + pieces)."""
        return int(self.items.shape[0])

    @cached_property
    def packs(self) -> list[np.ndarray]:
        """``P`` int64 arrays of sample/piece ids (views into :attr:`items`), built on first access."""
        return np.split(self.items, self.offsets[1:-1]) if self.num_packs else []

    def pack(self, index: int) -> np.ndarray:
        """Ids of pack ``index`` (int64 view), without building :attr:`packs`.

        Raises:
            IndexError: if ``index`` is not in ``-P..P-1``.
        """
        p = operator.index(index)
        if p < 0:
            p += self.num_packs
        if not 0 <= p < self.num_packs:
            raise IndexError(f"pack index {index} out of range for a plan with {self.num_packs} packs")
        return self.items[self.offsets[p] : self.offsets[p + 1]]

    @cached_property
    def pack_lengths(self) -> np.ndarray:
        """``[P]`` int64 tokens in each pack (``<= packing_length``)."""
        if self.num_packs == 0:
            return np.zeros(0, np.int64)
        cs = np.zeros(self.num_items + 1, np.int64)
        np.cumsum(self.item_lengths, out=cs[1:])
        return cs[self.offsets[1:]] - cs[self.offsets[:-1]]

    @cached_property
    def pieces(self) -> dict[int, tuple[int, int, int]]:
        """Piece id (``>= num_samples``) -> ``(sample_id, start, stop)`` token range of that sample."""
        base = self.num_samples
        return {
            base + k: (int(s), int(a), int(b))
            for k, (s, a, b) in enumerate(zip(self.piece_sample, self.piece_start, self.piece_stop))
        }

    @property
    def total_tokens(self) -> int:
        """Tokens in all packs (after dropping/truncating)."""
        return int(self.item_lengths.sum())

    @property
    def lower_bound_packs(self) -> int:
        """``ceil(total_tokens / packing_length)``: no plan can use fewer packs."""
        return -(-self.total_tokens // self.packing_length)

    @property
    def fill_ratio(self) -> float:
        """``total_tokens / (num_packs * packing_length)``, in ``[0, 1]``; 0.0 for an empty plan."""
        return self.total_tokens / (self.num_packs * self.packing_length) if self.num_packs else 0.0

    @property
    def stats(self) -> dict[str, Any]:
        """JSON-ready summary: counts, tokens, fill and the per-category overflow counts."""
        pl = self.pack_lengths
        ov = self.overflow
        return {
            "num_samples": self.num_samples,
            "num_items": self.num_items,
            "num_packs": self.num_packs,
            "total_tokens": self.total_tokens,
            "lower_bound_packs": self.lower_bound_packs,
            "fill_ratio": self.fill_ratio,
            "packing_length": self.packing_length,
            "strategy": self.strategy,
            "overflow_policy": ov["policy"],
            "num_empty": len(ov["empty_ids"]),
            "num_overlong": len(ov["overlong_ids"]),
            "num_dropped": len(ov["dropped_ids"]),
            "num_truncated": len(ov["truncated_ids"]),
            "num_split": len(ov["split_ids"]),
            "num_pieces": ov["num_pieces"],
            "num_unsupervised": len(ov.get("unsupervised_ids", ())) + len(ov.get("unsupervised_pieces", ())),
            "tokens_dropped": ov["tokens_dropped"],
            "max_pack_tokens": int(pl.max()) if pl.size else 0,
            "min_pack_tokens": int(pl.min()) if pl.size else 0,
            "max_items_per_pack": int(np.diff(self.offsets).max()) if self.num_packs else 0,
            "fingerprint": self.fingerprint,
        }

    def pack_order(self, epoch: int = 0) -> np.ndarray:
        """Order in which to visit the packs in ``epoch``: a permutation reshuffled every epoch.

        Every epoch, epoch 0 included, is a fresh permutation drawn from ``numpy.random.default_rng`` seeded
        with ``(seed, epoch)``; the same plan, seed and epoch always give the same order. The packs
        themselves never change between epochs, so every sample is seen exactly once per epoch.

        Args:
            epoch: non-negative int.

        Returns:
            ``[P]`` int64 permutation of ``arange(num_packs)``.

        Raises:
            ValueError: if ``epoch`` is negative.
        """
        e = operator.index(epoch)
        if e < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, e]))
        return rng.permutation(self.num_packs).astype(np.int64, copy=False)

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> Path:
        """Write the plan to one ``.npz`` file: the int64 arrays plus a JSON header (settings, fingerprint,
        overflow report, stats). No pickles.

        Args:
            path: target file; ``.npz`` is appended if missing.

        Returns:
            The path written.
        """
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_name(path.name + ".npz")
        meta = {
            "format": _FORMAT,
            "packing_length": self.packing_length,
            "strategy": self.strategy,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "fingerprint": self.fingerprint,
            "overflow": self.overflow,
            "stats": self.stats,
        }
        header = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            np.savez(
                f,
                meta=header,
                offsets=self.offsets,
                items=self.items,
                item_lengths=self.item_lengths,
                piece_sample=self.piece_sample,
                piece_start=self.piece_start,
                piece_stop=self.piece_stop,
                **({} if self.groups is None else {"groups": self.groups}),
            )
        return path

    @classmethod
    def load(cls, path: str | Path, *, lengths: Any = None) -> PackPlan:
        """Read a plan written by :meth:`save`.

        Args:
            path: the ``.npz`` file.
            lengths: optional ``[N]`` sample lengths of the dataset the plan will be used with. When given,
                the plan is refused unless its fingerprint matches these lengths (same lengths in the same
                order, same ``packing_length``, ``strategy`` and overflow policy).

        Raises:
            ValueError: if the file is not a varpack plan, is inconsistent, or the fingerprint does not
                match ``lengths``.
        """
        with np.load(Path(path), allow_pickle=False) as z:
            if "meta" not in z.files:
                raise ValueError(f"{path} is not a varpack plan (no 'meta' entry; entries: {z.files})")
            meta = json.loads(z["meta"].tobytes().decode())
            arrays = {k: z[k].astype(np.int64, copy=False) for k in z.files if k != "meta"}
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{path}: unsupported plan format {meta.get('format')!r}, expected {_FORMAT!r}")
        plan = cls(
            packing_length=int(meta["packing_length"]),
            strategy=meta["strategy"],
            seed=int(meta["seed"]),
            num_samples=int(meta["num_samples"]),
            overflow=meta["overflow"],
            fingerprint=meta["fingerprint"],
            **arrays,
        )
        offsets = plan.offsets
        if (
            offsets.shape[0] < 1
            or offsets[0] != 0
            or offsets[-1] != plan.num_items
            or np.any(np.diff(offsets) < 0)
        ):
            raise ValueError(f"{path}: corrupt plan (offsets do not partition {plan.num_items} items)")
        if lengths is not None:
            got = lengths_fingerprint(
                _as_lengths(lengths), plan.packing_length, plan.strategy, plan.overflow["policy"], plan.groups
            )
            if got != plan.fingerprint:
                n = len(lengths)
                raise ValueError(
                    f"plan {path} was made for other lengths or settings: its fingerprint is "
                    f"{plan.fingerprint[:16]}... (num_samples={plan.num_samples}, "
                    f"packing_length={plan.packing_length}, strategy={plan.strategy!r}, "
                    f"overflow={plan.overflow['policy']!r}) but the given {n} lengths give {got[:16]}...; "
                    "re-plan with plan_packs()"
                )
        return plan


def _as_lengths(lengths: Any) -> np.ndarray:
    """``lengths`` as a 1-D int64 array, checked (TypeError / ValueError naming the sample id)."""
    if hasattr(lengths, "detach") and hasattr(lengths, "cpu"):  # torch tensor, without importing torch
        lengths = lengths.detach().cpu().numpy()
    arr = np.asarray(lengths)
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D (one length per sample), got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"lengths must be integers (tokens per sample), got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"lengths exceed int64: max {int(arr.max())}")
    arr = arr.astype(np.int64, copy=False)
    if int(arr.min()) < 0:
        bad = np.flatnonzero(arr < 0)
        listed = ", ".join(f"{int(i)}: {int(arr[i])}" for i in bad[:_MAX_LISTED])
        raise ValueError(f"{bad.size} sample(s) have a negative length (sample_id: length): {listed}")
    return arr


def _listing(ids: np.ndarray, lengths: np.ndarray, locate: Any = None) -> str:
    """``"3: 912, 7: 1030"`` (sample id: length) of the first ids; with ``locate``, ``"3: 912 (FILE:LINE)"``."""
    where = locate(ids[:_MAX_LISTED].tolist()) if locate is not None else {}
    shown = ", ".join(
        f"{int(i)}: {int(lengths[i])}" + (f" ({where[int(i)]})" if int(i) in where else "")
        for i in ids[:_MAX_LISTED]
    )
    more = f", ... and {ids.size - _MAX_LISTED} more" if ids.size > _MAX_LISTED else ""
    return shown + more


def overlong_pieces(
    sample_ids: np.ndarray, lengths: np.ndarray, packing_length: int, overflow: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The pieces that the overflow policy makes of overlong samples (the one rule of :func:`plan_packs` and
    the streaming packer :mod:`varpack.plan.streaming`).

    Args:
        sample_ids: ``[M]`` int64 ids of the overlong samples, increasing.
        lengths: ``[M]`` int64 their lengths in tokens (each ``> packing_length``).
        packing_length: ``L``.
        overflow: ``"drop"`` (no pieces), ``"truncate"`` (one piece ``[0, L)``) or ``"split"`` (pieces
            ``[0, L), [L, 2L), ...``); ``"error"`` is the caller's to raise before.

    Returns:
        ``(piece_sample, piece_start, piece_stop, tokens_dropped)``: ``[K]`` int64 arrays ordered by (sample
        id, start), and the tokens that are in no piece.
    """
    no = np.zeros(0, np.int64)
    L = int(packing_length)
    if not sample_ids.size or overflow == "drop":
        return no, no, no, int(lengths.sum()) if sample_ids.size else 0
    if overflow == "truncate":
        n = sample_ids.size
        start, stop = np.zeros(n, np.int64), np.full(n, L, np.int64)
        return sample_ids.astype(np.int64), start, stop, int((lengths - L).sum())
    if overflow != "split":
        raise ValueError(f"overlong_pieces: overflow must be 'drop', 'truncate' or 'split', got {overflow!r}")
    per = -(-lengths // L)  # pieces per sample
    piece_sample = np.repeat(sample_ids, per).astype(np.int64)
    first = np.cumsum(per) - per
    k = np.arange(piece_sample.size, dtype=np.int64) - np.repeat(first, per)
    piece_start = k * L
    piece_stop = np.minimum(piece_start + L, np.repeat(lengths, per))
    return piece_sample, piece_start, piece_stop, 0


def supervised_mask(
    supervised: Any, sample_ids: np.ndarray, starts: np.ndarray, stops: np.ndarray
) -> np.ndarray:
    """Ask ``supervised`` which token ranges hold a supervised token: the one question that
    :func:`plan_packs` and the streaming packer (:mod:`varpack.plan.streaming`) ask about labels (the plan
    never reads tokens itself).

    Args:
        supervised: ``supervised(sample_ids, starts, stops) -> [M] bool``: True where sample
            ``sample_ids[i]``'s tokens ``[starts[i], stops[i])`` hold a label other than -100 after their
            first token (a packed item's first label is never a target); e.g.
            :func:`varpack.data.dataset.supervised_ranges` over the encoded samples.
        sample_ids, starts, stops: ``[M]`` int64 items (whole samples ``[0, length)`` and pieces).

    Returns:
        ``[M]`` bool.

    Raises:
        TypeError / ValueError: ``supervised`` is not callable or answers with another shape.
    """
    if not callable(supervised):
        raise TypeError(f"supervised must be a function (sample_ids, starts, stops) -> bool array, got "
                        f"{type(supervised).__name__}")
    has = np.asarray(supervised(sample_ids, starts, stops))
    if has.shape != sample_ids.shape or has.dtype != np.bool_:
        raise ValueError(
            f"supervised answered {has.dtype} of shape {has.shape} for {sample_ids.shape[0]} token ranges; "
            "expected one bool per range"
        )
    return has


def plan_packs(
    lengths: Any,
    packing_length: int,
    *,
    strategy: str = "bfd",
    overflow: str = "error",
    seed: int = 0,
    groups: Any = None,
    supervised: Any = None,
    group_noun: str = "group",
    locate: Any = None,
) -> PackPlan:
    """Group samples into packs of at most ``packing_length`` tokens.

    Strategies (the table :data:`varpack.plan.strategies.STRATEGY_TABLE`; every strategy sees the same items,
    the overflow policy below being applied first, once for all):

    - ``"bfd"``: global best-fit decreasing over *all* samples (not per window of ~1000 samples like
      ms-swift / LLaMA-Factory): longest first (ties: lower id first), each into the fullest pack it fits
      (ties: lowest pack index), a new pack when none fits. Exact BFD semantics (Johnson 1973; Coffman,
      Garey, Johnson 1996; TRL's ``pack_dataset`` BFD is the per-sample segment-tree version of the same
      rule), computed per (distinct length, capacity class) in O(N) numpy work; see
      :mod:`varpack.plan.bfd`. Uses at most 11/9 OPT + 6/9 packs.
    - ``"sequential"``: order-preserving next-fit: samples stay in dataset order, a new pack starts when
      the next sample does not fit.

    Samples longer than ``packing_length`` follow ``overflow``:

    - ``"error"`` (default): raise, listing the sample ids and lengths.
    - ``"drop"``: leave them out (reported in ``overflow["dropped_ids"]``).
    - ``"truncate"``: keep tokens ``[0, packing_length)`` as one piece.
    - ``"split"``: cut into pieces ``[0, L), [L, 2L), ...`` that are packed as separate items.

    Pieces get ids ``num_samples, num_samples + 1, ...`` in order of (sample id, start) and
    ``plan.pieces[piece_id] == (sample_id, start, stop)``; a split/truncated sample's own id appears in
    no pack. Empty (length 0) samples are never packed and are listed in ``overflow["empty_ids"]``.

    With ``supervised``, an item (a whole sample, or a piece of ``truncate`` / ``split``) without a supervised
    token trains nothing (a long prompt truncated away from its answer, a split piece of prompt only, an
    encoded sample whose labels are all -100): it is not packed, and is listed in
    ``overflow["unsupervised_ids"]`` (whole samples) or ``overflow["unsupervised_pieces"]`` (``[sample_id,
    start, stop]``), its tokens counted in ``tokens_dropped``; the pieces kept are numbered as above. So every
    sample id is in exactly one pack, or its pieces are, or it is in the overflow report; and with
    ``supervised`` every pack has a supervised token.

    Args:
        lengths: ``[N]`` non-negative integer sample lengths in tokens (list, numpy or torch).
        packing_length: ``L``, the token budget of one pack (one padding-free row), ``>= 1``.
        strategy: a name in :data:`~varpack.plan.strategies.STRATEGIES` (``"bfd"``, ``"sequential"``).
        overflow: ``"error"``, ``"drop"``, ``"truncate"`` or ``"split"``.
        seed: non-negative int for :meth:`PackPlan.pack_order` (the packs themselves do not depend on it).
        groups: optional ``[N]`` integer group id per sample: samples that must share one pack, in order
            (a preference pair: its chosen and rejected sequences). The members of a group are adjacent in
            the dataset (one run of equal ids; an id may not come back later) and none is empty. The
            strategy then packs *groups* (a group's length is the sum of its members'); in the plan a
            group's members are consecutive, in dataset order. An overlong group (sum ``> packing_length``)
            follows ``overflow`` as a unit: ``"error"`` lists the group ids, ``"drop"`` drops all its members
            (``overflow["dropped_ids"]``); ``"truncate"`` / ``"split"`` are refused (cutting a group would
            cut a member out of it). ``overflow`` then also holds ``overlong_group_ids`` /
            ``overlong_group_lengths`` and ``group_noun``.
        supervised: optional ``supervised(sample_ids, starts, stops) -> [M] bool`` (:func:`supervised_mask`;
            :func:`varpack.data.dataset.supervised_ranges` over the encoded samples), asked once about every
            item after the overflow policy; not with ``groups``.
        group_noun: what a group is, in the errors and the report (``"pair"`` for preference pairs: ``"2
            pair(s) are longer than packing_length=..."``).
        locate: optional ``locate(sample_ids: list[int]) -> {sample_id: str}`` saying where samples came from
            (:func:`varpack.data.chat.locate_samples`: ``"FILE:LINE"``), asked only on the error path about the
            overlong samples listed, each then named with it (``"2: 412 (chats.jsonl:4)"``); not with ``groups``.

    Returns:
        A deterministic :class:`PackPlan` (for the same lengths, settings and answers of ``supervised``; the
        fingerprint covers the lengths and settings).

    Raises:
        TypeError: if ``lengths`` is not integer or ``packing_length`` / ``seed`` is not an int.
        ValueError: for an unknown ``strategy`` / ``overflow``, ``packing_length < 1``, a negative length
            (naming the sample ids), a negative seed, or overlong samples with ``overflow="error"`` (listing
            the first 20 ids with their lengths, their ``locate`` answers, and the count).

    Example:
        >>> plan = plan_packs([3, 5, 2, 6, 1], 8)
        >>> [p.tolist() for p in plan.packs], plan.num_packs, plan.lower_bound_packs
        ([[3, 2], [1, 0], [4]], 3, 3)
        >>> [p.tolist() for p in plan_packs([3, 5, 2, 6, 1], 8, strategy="sequential").packs]
        [[0, 1], [2, 3], [4]]
    """
    if isinstance(packing_length, bool) or not isinstance(packing_length, (int, np.integer)):
        raise TypeError(f"packing_length must be an int (tokens), got {type(packing_length).__name__}")
    L = int(packing_length)
    if L < 1:
        raise ValueError(f"packing_length must be >= 1 token, got {L}")
    if strategy not in STRATEGY_TABLE:
        raise ValueError(f"packing_strategy must be one of {tuple(STRATEGY_TABLE)}, got {strategy!r}")
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if int(seed) < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")

    arr = _as_lengths(lengths)
    if groups is not None:
        if supervised is not None:
            raise ValueError(
                "supervised= is not used with groups: a group's members are packed or dropped together "
                "(preference pairs are encoded with a supervised completion each)"
            )
        return _plan_groups(
            arr, groups, L, strategy=strategy, overflow=overflow, seed=int(seed), noun=group_noun
        )
    n = int(arr.shape[0])
    fingerprint = lengths_fingerprint(arr, L, strategy, overflow)
    no = np.zeros(0, np.int64)
    piece_sample, piece_start, piece_stop = no, no, no
    tokens_dropped = 0

    if n == 0 or (int(arr.min()) >= 1 and int(arr.max()) <= L):
        # common case: every sample is packed whole; item k is sample k
        empty_ids, over_ids = no, no
        item_ids, item_len = None, arr
    else:
        empty_ids = np.flatnonzero(arr == 0)
        over_ids = np.flatnonzero(arr > L)
        if over_ids.size and overflow == "error":
            raise ValueError(
                f"{over_ids.size} sample(s) are longer than packing_length={L} (sample_id: length): "
                f"{_listing(over_ids, arr, locate)}; raise packing_length or choose overflow='drop', "
                "overflow='truncate' or overflow='split'"
            )
        whole = np.flatnonzero((arr > 0) & (arr <= L))
        piece_sample, piece_start, piece_stop, tokens_dropped = overlong_pieces(
            over_ids, arr[over_ids], L, overflow
        )
        # the items to pack, in dataset order: whole samples and pieces (a piece sits where its sample was)
        num_pieces = int(piece_sample.size)
        item_ids = np.concatenate([whole, n + np.arange(num_pieces, dtype=np.int64)])
        item_len = np.concatenate([arr[whole], piece_stop - piece_start])
        if num_pieces and whole.size:
            order = np.argsort(np.concatenate([whole, piece_sample]), kind="stable")
            item_ids, item_len = item_ids[order], item_len[order]
    unsup_ids: list[int] = []
    unsup_pieces: list[list[int]] = []
    if supervised is not None and item_len.size:
        if item_ids is None:
            item_ids = np.arange(n, dtype=np.int64)
        is_piece = item_ids >= n
        k = np.where(is_piece, item_ids - n, 0)
        sids = np.where(is_piece, piece_sample[k] if piece_sample.size else 0, item_ids)
        starts = np.where(is_piece, piece_start[k] if piece_sample.size else 0, 0)
        has = supervised_mask(supervised, sids, starts, starts + item_len)
        if not has.all():
            gone = ~has
            unsup_ids = sids[gone & ~is_piece].tolist()
            gp = k[gone & is_piece]
            unsup_pieces = [[int(piece_sample[j]), int(piece_start[j]), int(piece_stop[j])] for j in gp]
            tokens_dropped += int(item_len[gone].sum())
            # the pieces kept are renumbered n, n + 1, ... (still in order of sample id, start)
            kept = np.ones(piece_sample.size, bool)
            kept[gp] = False
            renum = np.cumsum(kept) - 1
            item_ids = np.where(is_piece, n + renum[k] if piece_sample.size else 0, item_ids)[has]
            item_len = item_len[has]
            piece_sample, piece_start, piece_stop = piece_sample[kept], piece_start[kept], piece_stop[kept]
    num_pieces = int(piece_sample.size)

    offsets, idx = STRATEGY_TABLE[strategy].pack(item_len, L)

    report = {
        "policy": overflow,
        "empty_ids": empty_ids.tolist(),
        "overlong_ids": over_ids.tolist(),
        "overlong_lengths": arr[over_ids].tolist(),
        "dropped_ids": over_ids.tolist() if overflow == "drop" else [],
        "truncated_ids": over_ids.tolist() if overflow == "truncate" else [],
        "split_ids": over_ids.tolist() if overflow == "split" else [],
        "num_pieces": num_pieces,
        "tokens_dropped": tokens_dropped,
        "unsupervised_ids": unsup_ids,
        "unsupervised_pieces": unsup_pieces,
    }
    return PackPlan(
        packing_length=L,
        strategy=strategy,
        seed=int(seed),
        num_samples=n,
        offsets=offsets,
        items=idx if item_ids is None else item_ids[idx],
        item_lengths=item_len[idx],
        piece_sample=piece_sample,
        piece_start=piece_start,
        piece_stop=piece_stop,
        overflow=report,
        fingerprint=fingerprint,
    )


def _group_runs(groups: Any, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(starts [G], group_ids [G], groups [N] int64)``: the runs of equal ids in ``groups``, checked."""
    if hasattr(groups, "detach") and hasattr(groups, "cpu"):
        groups = groups.detach().cpu().numpy()
    g = np.asarray(groups)
    if g.ndim != 1 or g.shape[0] != n:
        raise ValueError(f"groups must be 1-D with one group id per sample ({n}), got shape {g.shape}")
    if n and g.dtype.kind not in "iu":
        raise TypeError(f"groups must be integers (a group id per sample), got dtype {g.dtype}")
    g = g.astype(np.int64, copy=False)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), g
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    ids = g[starts]
    uniq, first = np.unique(ids, return_index=True)
    if uniq.size != ids.size:
        again = np.setdiff1d(np.arange(ids.size), first)[0]
        sid = int(starts[again])
        raise ValueError(
            f"groups: the members of a group must be adjacent samples, but group {int(ids[again])} comes back "
            f"at sample {sid} after other groups"
        )
    return starts.astype(np.int64), ids, g


def _plan_groups(
    arr: np.ndarray, groups: Any, L: int, *, strategy: str, overflow: str, seed: int, noun: str = "group"
) -> PackPlan:
    """:func:`plan_packs` with ``groups``: pack the groups as items, then lay out their members; ``noun`` names
    a group in the errors."""
    n = int(arr.shape[0])
    if overflow in ("truncate", "split"):
        raise ValueError(
            f"overflow={overflow!r} cannot be used with groups: cutting an overlong {noun} would cut a member "
            "out of it; use overflow='drop' or overflow='error', or raise packing_length"
        )
    starts, gids, group_of = _group_runs(groups, n)
    if n and int(arr.min()) == 0:
        sid = int(np.flatnonzero(arr == 0)[0])
        gid = int(gids[np.searchsorted(starts, sid, side="right") - 1])
        raise ValueError(
            f"sample {sid} ({noun} {gid}) is empty (0 tokens); a {noun}'s members must not be empty"
        )
    sizes = np.diff(np.r_[starts, n]).astype(np.int64)
    glen = np.add.reduceat(arr, starts) if n else np.zeros(0, np.int64)
    over = np.flatnonzero(glen > L)
    if over.size and overflow == "error":
        shown = ", ".join(f"{int(gids[g])}: {int(glen[g])}" for g in over[:_MAX_LISTED])
        more = f", ... and {over.size - _MAX_LISTED} more" if over.size > _MAX_LISTED else ""
        raise ValueError(
            f"{over.size} {noun}(s) are longer than packing_length={L} together ({noun} id: tokens): "
            f"{shown}{more}; raise packing_length or choose overflow='drop'"
        )
    gplan = plan_packs(glen, L, strategy=strategy, overflow=overflow, seed=seed)
    # expand each packed group into its members, consecutive and in dataset order
    gitems = gplan.items
    counts = sizes[gitems]
    first = np.repeat(starts[gitems], counts)
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    items = first + within
    per_pack = np.add.reduceat(counts, gplan.offsets[:-1]) if gplan.num_packs else np.zeros(0, np.int64)
    offsets = np.zeros(gplan.num_packs + 1, np.int64)
    np.cumsum(per_pack, out=offsets[1:])
    over_members = np.flatnonzero(np.repeat(glen > L, sizes)).astype(np.int64)
    report = {
        "policy": overflow,
        "empty_ids": [],
        "overlong_ids": over_members.tolist(),
        "overlong_lengths": arr[over_members].tolist(),
        "dropped_ids": over_members.tolist(),
        "truncated_ids": [],
        "split_ids": [],
        "num_pieces": 0,
        "tokens_dropped": int(glen[over].sum()),
        "unsupervised_ids": [],
        "unsupervised_pieces": [],
        "num_groups": int(gids.size),
        "overlong_group_ids": gids[over].tolist(),
        "overlong_group_lengths": glen[over].tolist(),
        "group_noun": noun,
    }
    no = np.zeros(0, np.int64)
    return PackPlan(
        packing_length=L,
        strategy=strategy,
        seed=seed,
        num_samples=n,
        offsets=offsets,
        items=items,
        item_lengths=arr[items],
        piece_sample=no,
        piece_start=no,
        piece_stop=no,
        overflow=report,
        fingerprint=lengths_fingerprint(arr, L, strategy, overflow, groups=group_of),
        groups=group_of,
    )
