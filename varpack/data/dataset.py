"""``PackedDataset``: a map-style dataset whose item ``i`` is the list of samples of one pack of a plan.

Stage "data" of the pipeline (docs/ARCHITECTURE.md): encoded samples + a ``PackPlan`` -> packs of sample
dicts, which ``PaddingFreeCollator`` flattens into one row. Pieces of overlong samples (``overflow="split"`` /
``"truncate"``) are cut here, so downstream every item is an ordinary sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from varpack.schema import IGNORE_INDEX, MEDIA_FIELDS, TOKEN_ALIGNED_FIELDS

__all__ = ["PackedDataset", "TOKEN_ALIGNED_FIELDS", "cut_piece", "sample_lengths", "supervised_ranges"]


def _is_hf_dataset(samples: Any) -> bool:
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        return False
    return isinstance(samples, datasets.Dataset)


def sample_lengths(samples: Any) -> np.ndarray:
    """Token length of every sample, ``[N]`` int64: the ``length`` field if present, else ``len(input_ids)``.

    For a HF ``datasets.Dataset`` the column is read through Arrow in one call (no per-row Python work).

    Raises:
        ValueError: a sample has neither ``length`` nor ``input_ids``.
    """
    if _is_hf_dataset(samples):
        import pyarrow.compute as pc

        if "length" in samples.column_names:
            col = samples.with_format("arrow")["length"]
            return np.asarray(col.to_numpy(), dtype=np.int64)
        if "input_ids" in samples.column_names:
            col = samples.with_format("arrow")["input_ids"]
            return np.asarray(pc.list_value_length(col).to_numpy(zero_copy_only=False), dtype=np.int64)
        raise ValueError(f"dataset has neither a 'length' nor an 'input_ids' column: {samples.column_names}")
    out = np.empty(len(samples), dtype=np.int64)
    for i, s in enumerate(samples):
        if "length" in s:
            out[i] = int(s["length"])
        elif "input_ids" in s:
            out[i] = len(s["input_ids"])
        else:
            raise ValueError(f"sample {i} has neither 'length' nor 'input_ids' (fields: {sorted(s)})")
    return out


#: rows of a ``datasets.Dataset`` whose labels :func:`supervised_ranges` reads at once
_LABEL_ROWS = 4096


def supervised_ranges(samples: Any) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """The ``supervised`` argument of :func:`varpack.plan.plan_packs` /
    :meth:`varpack.plan.streaming.StreamingPacker.add` over encoded samples: ``f(sample_ids, starts, stops)``
    answers, for every token range ``[starts[i], stops[i])`` of sample ``sample_ids[i]`` (``[M]`` int64 each),
    whether a label other than -100 follows its first token (a packed item's first label is never a target:
    ``labels[0] == -100`` for a sample, and :func:`cut_piece` sets it for a piece).

    Args:
        samples: a ``datasets.Dataset`` (the ``labels`` column is read through Arrow, a few thousand rows at a
            time, one numpy pass per block) or a sequence / mapping of sample dicts indexed by sample id.

    Returns:
        The function; it returns ``[M]`` bool.

    Raises:
        ValueError (when called): a sample without ``labels`` (naming it).
    """
    if _is_hf_dataset(samples):
        if "labels" not in samples.column_names:
            raise ValueError(f"the samples have no 'labels' column (columns: {samples.column_names})")
        view = samples.select_columns(["labels"]).with_format("arrow")

        def hf(sample_ids: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
            out = np.zeros(sample_ids.shape[0], bool)
            order = np.argsort(sample_ids, kind="stable")
            sid = sample_ids[order]
            for lo in range(0, len(samples), _LABEL_ROWS):
                a, b = np.searchsorted(sid, [lo, lo + _LABEL_ROWS])
                if a == b:
                    continue
                col = view[lo : lo + _LABEL_ROWS]["labels"]
                col = col.chunks[0] if col.num_chunks == 1 else col.combine_chunks()
                offs = col.offsets.to_numpy()
                flat = col.flatten().to_numpy(zero_copy_only=False)  # the rows' values (slice-aware)
                cs = np.zeros(flat.shape[0] + 1, np.int64)
                np.cumsum(flat != IGNORE_INDEX, out=cs[1:])
                sel = order[a:b]
                row_start = offs[sid[a:b] - lo] - offs[0]
                first = row_start + starts[sel] + 1
                last = np.maximum(row_start + stops[sel], first)
                out[sel] = cs[last] > cs[first]
            return out

        return hf

    def rows(sample_ids: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        out = np.zeros(sample_ids.shape[0], bool)
        for i, (sid, a, b) in enumerate(zip(sample_ids.tolist(), starts.tolist(), stops.tolist())):
            labels = samples[sid].get("labels")
            if labels is None:
                raise ValueError(f"sample {sid} has no 'labels'")
            part = labels[a + 1 : b]
            if isinstance(part, torch.Tensor):
                out[i] = bool((part != IGNORE_INDEX).any())
            else:
                out[i] = bool((np.asarray(part) != IGNORE_INDEX).any()) if len(part) else False
        return out

    return rows


def _slice(value: Any, start: int, stop: int) -> Any:
    """``value[..., start:stop]`` for lists, numpy arrays and tensors (a copy, never a view of the source)."""
    if isinstance(value, torch.Tensor):
        return value[..., start:stop].clone()
    if isinstance(value, np.ndarray):
        return value[..., start:stop].copy()
    if value and isinstance(value[0], (list, tuple, np.ndarray, torch.Tensor)):  # [P, L] nested lists
        return [list(row[start:stop]) for row in value]
    return list(value[start:stop])


def _restart_text_plane(value: Any, text_plane: int) -> Any:
    """A piece's positions: the text plane restarts at ``0..L-1``; other (mRoPE) planes keep their values,
    as in ``varpack.data.multimodal.slice_mm_sample``."""
    arr = value.clone() if isinstance(value, torch.Tensor) else np.array(value, dtype=np.int64)
    n = arr.shape[-1]
    if arr.ndim == 1:
        arr[:] = torch.arange(n) if isinstance(arr, torch.Tensor) else np.arange(n)
    elif arr.ndim == 2:
        arr[text_plane] = torch.arange(n) if isinstance(arr, torch.Tensor) else np.arange(n)
    else:
        raise ValueError(f"position_ids must be [L] or [P, L], got shape {tuple(arr.shape)}")
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return arr
    return arr.tolist()


def _set_first_label(labels: Any) -> Any:
    labels[0] = IGNORE_INDEX
    return labels


def cut_piece(
    row: dict[str, Any],
    start: int,
    stop: int,
    *,
    sample_id: int,
    piece_id: int | None = None,
    token_fields: Iterable[str] = TOKEN_ALIGNED_FIELDS,
    text_plane: int = 0,
) -> None:
    """Cut ``row`` (a sample dict, in place) to its token range ``[start, stop)``: a piece of an overlong sample.

    Every token-aligned field (``token_fields``) is sliced, ``labels[0]`` becomes -100 (the token before the
    cut is in another piece), ``length`` is updated, the text plane of ``position_ids`` restarts at
    ``0..L-1`` (mRoPE planes kept), and ``piece_range`` (and ``piece_id`` when given) is added. A sample with
    images or videos is cut by ``varpack.data.multimodal.slice_mm_sample`` (the piece keeps the media wholly
    inside it). Shared by :class:`PackedDataset` and the streaming dataset (:mod:`varpack.data.stream`).

    Raises:
        ValueError: the range is not inside the sample (naming the piece / sample), or it cuts through an
            image / video span.
    """
    token_fields = tuple(token_fields)
    if any(row.get(f) is not None for f in MEDIA_FIELDS):
        # image/video pieces keep only the media wholly inside them; a cut inside an image raises
        from varpack.data import multimodal

        piece = multimodal.slice_mm_sample(row, start, stop, sample_id=sample_id)
        for f in token_fields:  # extra token fields that the multimodal slicer does not know
            if f in row and f not in TOKEN_ALIGNED_FIELDS:
                piece[f] = _slice(row[f], start, stop)
        row.clear()
        row.update(piece)
    else:
        length = len(row["input_ids"])
        if not 0 <= start < stop <= length:
            what = f"piece {piece_id} of sample {sample_id}" if piece_id is not None else f"sample {sample_id}"
            raise ValueError(
                f"{what} covers tokens [{start}, {stop}) but the sample has {length} tokens "
                "(plan made for other data?)"
            )
        for field in token_fields:
            if field in row and row[field] is not None:
                row[field] = _slice(row[field], start, stop)
        if "labels" in row:
            row["labels"] = _set_first_label(row["labels"])
        if "position_ids" in row and row["position_ids"] is not None:
            row["position_ids"] = _restart_text_plane(row["position_ids"], text_plane)
        if "length" in row:
            row["length"] = stop - start
    if piece_id is not None:
        row["piece_id"] = piece_id
    row["piece_range"] = (start, stop)


class PackedDataset(Dataset):
    """Map-style dataset over encoded samples and a ``PackPlan``: item ``i`` is one pack, a list of samples.

    Item ``i`` is pack ``plan.pack_order(epoch)[i]`` (a per-epoch permutation from the plan's seed; with
    ``shuffle=False`` pack ``i``). Each element of the item is a sample dict as stored in ``samples`` (a
    shallow copy) plus ``sample_id`` (its index in ``samples``, what every varpack report uses). A piece of an
    overlong sample (plan id ``>= num_samples``, ``plan.pieces[id] = (sample_id, start, stop)``) is that
    sample's token range ``[start, stop)`` cut on every token-aligned field (:data:`TOKEN_ALIGNED_FIELDS` and
    ``token_fields``), with ``labels[0] = -100`` (the token before the cut is in another piece), ``length``
    updated, the text plane of ``position_ids`` restarted at ``0..L-1`` (mRoPE planes kept as in the whole
    sample), and ``piece_id`` / ``piece_range`` added. A sample with images or videos is cut by
    ``varpack.data.multimodal.slice_mm_sample``: the piece keeps the media wholly inside it, and a cut
    through an image raises.

    From a HF ``datasets.Dataset`` a pack is read with one Arrow call; flat numeric list columns
    (``input_ids``, ``labels``, ``loss_scale``, ...) arrive as read-only numpy arrays (views of the Arrow
    buffers, no per-token Python work), scalars as Python values, and nested or special columns
    (``position_ids`` ``[P, L]``, images) through the dataset's own decoding. A sequence of dicts gives
    shallow copies of its dicts.

    A :class:`varpack.data.sampler.MaskedPack` index gives the pack's samples with every label ``-100`` and
    ``sample_id`` ``None`` (the filler of :class:`varpack.data.sampler.BalancedPackSampler`).

    Every packed id is visited exactly once per epoch, because the plan's packs partition its ids and the
    order is a permutation. Works with ``torch.utils.data.DataLoader`` (any ``num_workers``; the dataset is
    picklable; call :meth:`set_epoch` before each epoch's iterator is created, as workers copy the dataset
    then; ``persistent_workers=True`` keeps the old epoch) and with HF ``Trainer`` given
    ``remove_unused_columns=False`` and ``data_collator=PaddingFreeCollator(...)`` (Trainer draws a random
    permutation of items itself each epoch).

    Args:
        samples: the encoded dataset: a HF ``datasets.Dataset`` or a sequence of dicts with ``input_ids``,
            ``labels``, ``length`` and optional fields (docs/ARCHITECTURE.md "Encoded sample").
        plan: a ``varpack.plan.PackPlan`` made from these samples' lengths.
        epoch: initial epoch for the pack order.
        shuffle: visit packs in ``plan.pack_order(epoch)`` (default) or in plan order.
        token_fields: extra token-aligned field names to cut for pieces.
        text_plane: plane of multi-plane ``position_ids`` that counts tokens (0 for Qwen3-VL).
        check: verify at construction that the plan was made for these samples: same number of samples and,
            when the plan has a fingerprint, the same lengths and settings (``lengths_fingerprint``).

    Raises:
        TypeError: ``samples`` is not a dataset / sequence, or ``plan`` lacks the PackPlan interface.
        ValueError: (``check``) the plan's sample count, fingerprint or packed lengths disagree with the
            samples, naming the first sample that differs; at access time, a piece that cuts through an
            image/video span (``varpack.data.multimodal.validate_cut``) or a piece range beyond the sample.
        IndexError: ``index`` out of range.

    Example:
        >>> from varpack.plan import plan_packs
        >>> samples = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "length": 3},
        ...            {"input_ids": [4, 5], "labels": [-100, 5], "length": 2},
        ...            {"input_ids": [6], "labels": [-100], "length": 1}]
        >>> ds = PackedDataset(samples, plan_packs([3, 2, 1], 4), shuffle=False)
        >>> [[s["sample_id"] for s in pack] for pack in ds]
        [[0, 2], [1]]
    """

    def __init__(
        self,
        samples: Any,
        plan: Any,
        *,
        epoch: int = 0,
        shuffle: bool = True,
        token_fields: Iterable[str] = (),
        text_plane: int = 0,
        check: bool = True,
    ) -> None:
        if not (_is_hf_dataset(samples) or isinstance(samples, Sequence)) or isinstance(
            samples, (str, bytes)
        ):
            raise TypeError(
                f"samples must be a datasets.Dataset or a sequence of dicts, got {type(samples).__name__}"
            )
        for attr in ("num_samples", "pack_order", "pieces"):
            if not hasattr(plan, attr):
                raise TypeError(
                    f"plan must be a varpack PackPlan (missing {attr!r}), got {type(plan).__name__}"
                )
        self.samples = samples
        self.plan = plan
        self.shuffle = bool(shuffle)
        self.token_fields = TOKEN_ALIGNED_FIELDS + tuple(
            f for f in token_fields if f not in TOKEN_ALIGNED_FIELDS
        )
        self.text_plane = int(text_plane)
        self._num_samples = int(plan.num_samples)
        self._is_hf = _is_hf_dataset(samples)
        self._arrow_view: Any = None
        self._slow_view: Any = None
        self._fast_columns: dict[str, bool] = {}
        if check:
            self._check_plan()
        self.epoch = 0
        self._order: np.ndarray | None = None
        self.set_epoch(epoch)

    # ------------------------------------------------------------------ plan check
    def _check_plan(self) -> None:
        n = len(self.samples)
        if n != self._num_samples:
            raise ValueError(
                f"the plan was made for {self._num_samples} samples but the dataset has {n}; re-plan with "
                f"plan_packs(lengths, ...) on this dataset"
            )
        lengths = sample_lengths(self.samples)
        plan = self.plan
        fingerprint = getattr(plan, "fingerprint", None)
        if fingerprint is not None and hasattr(plan, "packing_length") and hasattr(plan, "strategy"):
            from varpack.plan import lengths_fingerprint

            got = lengths_fingerprint(
                lengths,
                plan.packing_length,
                plan.strategy,
                plan.overflow["policy"],
                getattr(plan, "groups", None),
            )
            if got == fingerprint:
                return
            detail = self._first_length_mismatch(lengths)
            raise ValueError(
                f"the plan does not match these samples: its fingerprint is {fingerprint[:16]}... but the "
                f"dataset's lengths give {got[:16]}...{detail}; re-plan with plan_packs() on this dataset"
            )
        detail = self._first_length_mismatch(lengths)
        if detail:
            raise ValueError(f"the plan does not match these samples{detail}")

    def _first_length_mismatch(self, lengths: np.ndarray) -> str:
        items = getattr(self.plan, "items", None)
        item_lengths = getattr(self.plan, "item_lengths", None)
        if items is None or item_lengths is None:
            return ""
        items = np.asarray(items)
        item_lengths = np.asarray(item_lengths)
        whole = items < self._num_samples
        bad = np.flatnonzero(lengths[items[whole]] != item_lengths[whole])
        if bad.size:
            sid = int(items[whole][bad[0]])
            return (
                f" (sample {sid} has {int(lengths[sid])} tokens, the plan packed it as "
                f"{int(item_lengths[whole][bad[0]])}; {bad.size} samples differ)"
            )
        return ""

    # ------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        """Use the pack order of ``epoch`` (``plan.pack_order(epoch)``); call before each epoch.

        Raises:
            ValueError: ``epoch`` is negative (from the plan).
        """
        self.epoch = int(epoch)
        self._order = np.asarray(self.plan.pack_order(self.epoch), dtype=np.int64) if self.shuffle else None

    def __len__(self) -> int:
        return int(self.plan.num_packs)

    def pack_ids(self, index: int) -> np.ndarray:
        """Plan ids (samples, or pieces ``>= num_samples``) of item ``index`` in the current epoch."""
        n = len(self)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"item {index} out of range for {n} packs")
        p = int(self._order[i]) if self._order is not None else i
        if hasattr(self.plan, "pack"):
            return np.asarray(self.plan.pack(p))
        return np.asarray(self.plan.packs[p])

    # ------------------------------------------------------------------ access
    def _fetch(self, sample_ids: list[int]) -> list[dict[str, Any]]:
        if self._is_hf:
            return self._fetch_hf(sample_ids)
        out = []
        for sid in sample_ids:
            sample = self.samples[sid]
            if not isinstance(sample, Mapping):
                raise TypeError(f"sample {sid} is a {type(sample).__name__}, expected a dict")
            out.append(dict(sample))
        return out

    def _fetch_hf(self, sample_ids: list[int]) -> list[dict[str, Any]]:
        """One Arrow read per pack; flat numeric list columns become numpy views (no per-token Python)."""
        if self._arrow_view is None:
            self._setup_arrow()
        rows: list[dict[str, Any]] = [{} for _ in sample_ids]
        if self._fast_columns:
            table = self._arrow_view[sample_ids]
            for name in self._fast_columns:
                chunked = table.column(name)
                col = chunked.chunks[0] if chunked.num_chunks == 1 else chunked.combine_chunks()
                if self._fast_columns[name] and col.null_count == 0:
                    offsets = (col.offsets.to_numpy() - col.offsets[0].as_py()).tolist()
                    values = col.flatten().to_numpy(zero_copy_only=False)
                    parts: Any = [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
                else:
                    parts = col.to_pylist()
                for row, value in zip(rows, parts):
                    row[name] = value
        if self._slow_view is not None:  # nested lists, images, ...: the dataset's own decoding
            cols = self._slow_view[sample_ids]
            for name, values in cols.items():
                for row, value in zip(rows, values):
                    row[name] = value
        return rows

    def _setup_arrow(self) -> None:
        import pyarrow as pa

        fast: dict[str, bool] = {}
        slow: list[str] = []
        scalar = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean, pa.types.is_string)
        for field in self.samples.features.arrow_schema:
            t = field.type
            if (pa.types.is_list(t) or pa.types.is_large_list(t)) and any(
                f(t.value_type) for f in scalar[:3]
            ):
                fast[field.name] = True
            elif any(f(t) for f in scalar) or pa.types.is_large_string(t):
                fast[field.name] = False
            else:
                slow.append(field.name)
        self._fast_columns = fast
        self._arrow_view = self.samples.with_format("arrow")
        self._slow_view = self.samples.select_columns(slow) if slow else None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_arrow_view"] = state["_slow_view"] = None  # rebuilt lazily in each worker
        state["_fast_columns"] = {}
        return state

    def __getitem__(self, index: int) -> list[dict[str, Any]]:
        from varpack.data.sampler import MaskedPack

        if isinstance(index, MaskedPack):  # a rank's filler micro-batch: trains nothing, counts nothing
            rows = self.__getitem__(int(index))
            for row in rows:
                row["labels"] = [IGNORE_INDEX] * len(row["labels"])
                row["sample_id"] = None
            return rows
        ids = self.pack_ids(index)
        n = self._num_samples
        pieces = self.plan.pieces if (ids >= n).any() else {}
        source_ids = [int(i) if i < n else pieces[int(i)][0] for i in ids]
        rows = self._fetch(source_ids)
        for row, pid, sid in zip(rows, ids, source_ids):
            row["sample_id"] = sid
            if pid >= n:
                _, start, stop = pieces[int(pid)]
                self._cut(row, int(pid), sid, start, stop)
        return rows

    def _cut(self, row: dict[str, Any], piece_id: int, sample_id: int, start: int, stop: int) -> None:
        cut_piece(
            row, start, stop, sample_id=sample_id, piece_id=piece_id, token_fields=self.token_fields,
            text_plane=self.text_plane,
        )

    def __repr__(self) -> str:
        return (
            f"PackedDataset(num_samples={self._num_samples}, num_packs={len(self)}, epoch={self.epoch}, "
            f"shuffle={self.shuffle})"
        )
