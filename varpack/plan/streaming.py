"""Online packing of a stream of samples: best-fit decreasing over a bounded buffer (``StreamingPacker``).

When the whole dataset is not at hand (a streamed source, encoded on the fly), the packs are planned over a
buffer of at most ``buffer_size`` items (samples, or pieces of overlong samples) as they arrive:

1. Samples are added in stream order. Empty ones are reported and never packed; overlong ones follow the
   overflow policy of :func:`varpack.plan.plan_packs` (the same :func:`varpack.plan.plan.overlong_pieces`):
   ``error`` raises at the first one, naming its sample id and length (the samples before it are added and
   the packs they complete come with the next call: nothing emitted is lost); ``drop`` / ``truncate`` /
   ``split`` are reported by sample id, as in a plan. Given ``supervised``, a sample or piece without a
   supervised token is left out and reported by id, as in a plan (:func:`varpack.plan.plan.supervised_mask`).
2. Whenever the buffer holds ``buffer_size`` items, they are packed with the planner's own strategy function
   (:data:`varpack.plan.strategies.STRATEGY_TABLE`, ``bfd`` by default: the same code as the global plan,
   here over one window). The packs are emitted, except the least-filled packs that are not exactly full,
   which stay in the buffer (at most ``buffer_size // 2`` items) to be packed again with the next samples:
   the last packs of a BFD window are the ones its small items could not fill, and new samples fill them.
3. At the end of the stream (:meth:`StreamingPacker.finish`) every buffered item is packed and emitted, the
   final partial packs included (counted in the report as ``final_packs``): no sample is left behind.

With ``buffer_size`` at least the number of items, step 2 never runs and step 3 packs everything at once:
the packs are exactly those of ``plan_packs(lengths, packing_length)`` (tested). The packs do not depend
on how the stream is cut into :meth:`~StreamingPacker.add` calls, and the packer's state (buffer, counters,
report) is a small dict (:meth:`~StreamingPacker.state_dict`), so a stream can be resumed exactly.

Each window is packed by the planner's BFD, whose class-wise step runs on Python lists for a window-sized
input (:func:`varpack.plan.bfd.best_fit_decreasing`): a 10k window costs ~2.5 ms, so the packer runs at
over 1M samples/s from a buffer of 1k. Measured (``benchmarks/streaming.py``, real length mix of
../shared/data, packing_length 4096): see benchmarks/RESULTS.md; :data:`DEFAULT_BUFFER_SIZE` comes from that
measurement.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from varpack.plan.plan import OVERFLOW_POLICIES, _as_lengths, overlong_pieces, supervised_mask
from varpack.plan.strategies import STRATEGY_TABLE

__all__ = ["DEFAULT_BUFFER_SIZE", "PackBatch", "StreamingPacker"]

#: Items (samples / pieces) packed together by default: the smallest buffer of ``benchmarks/streaming.py``
#: whose fill is >= 0.999 of the global plan's on all three streams of the real length mix (file order,
#: shuffled, 1M drawn; benchmarks/RESULTS.md#streaming). 10k gives the same fill and ~3x the packer speed (5.0M
#: vs 1.6M samples/s on one core, the 1M stream) but holds 10x more encoded samples in memory per DataLoader worker;
#: at 1k the packer is still ~2,000x faster than encoding chats on the fly (~500 samples/s per core).
DEFAULT_BUFFER_SIZE = 1_000
_FORMAT = "varpack-stream-packer/1"
_NO = np.zeros(0, np.int64)


@dataclass(frozen=True)
class PackBatch:
    """Packs emitted together, in CSR form: pack ``p`` holds items ``offsets[p]:offsets[p+1]``.

    An item is the token range ``[starts[i], stops[i])`` of sample ``sample_ids[i]``: a whole sample is
    ``[0, length)``, a piece of an overlong sample (``truncate`` / ``split``) a part of it.
    """

    offsets: np.ndarray
    """``[P+1]`` int64, ``offsets[0] == 0``."""
    sample_ids: np.ndarray
    """``[I]`` int64 sample id (index in the stream) of every item."""
    starts: np.ndarray
    """``[I]`` int64 first token (inclusive) of the item in its sample."""
    stops: np.ndarray
    """``[I]`` int64 last token (exclusive) of the item in its sample."""

    @staticmethod
    def empty() -> PackBatch:
        return PackBatch(np.zeros(1, np.int64), _NO, _NO, _NO)

    @property
    def num_packs(self) -> int:
        """``P``."""
        return int(self.offsets.shape[0]) - 1

    def __len__(self) -> int:
        return self.num_packs

    @property
    def pack_lengths(self) -> np.ndarray:
        """``[P]`` int64 tokens per pack."""
        cs = np.zeros(self.sample_ids.shape[0] + 1, np.int64)
        np.cumsum(self.stops - self.starts, out=cs[1:])
        return cs[self.offsets[1:]] - cs[self.offsets[:-1]]

    def pack(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(sample_ids, starts, stops)`` of pack ``index`` (int64 views).

        Raises:
            IndexError: ``index`` not in ``-P..P-1``.
        """
        p = operator.index(index)
        if p < 0:
            p += self.num_packs
        if not 0 <= p < self.num_packs:
            raise IndexError(f"pack index {index} out of range for {self.num_packs} packs")
        a, b = int(self.offsets[p]), int(self.offsets[p + 1])
        return self.sample_ids[a:b], self.starts[a:b], self.stops[a:b]

    def __iter__(self):
        for p in range(self.num_packs):
            yield self.pack(p)

    @staticmethod
    def concat(batches: list[PackBatch]) -> PackBatch:
        """The packs of ``batches``, one after the other."""
        batches = [b for b in batches if b.num_packs]
        if not batches:
            return PackBatch.empty()
        if len(batches) == 1:
            return batches[0]
        base = np.cumsum([0] + [b.sample_ids.shape[0] for b in batches[:-1]])
        offsets = np.concatenate(
            [batches[0].offsets[:1]] + [b.offsets[1:] + s for b, s in zip(batches, base)]
        )
        return PackBatch(
            offsets,
            np.concatenate([b.sample_ids for b in batches]),
            np.concatenate([b.starts for b in batches]),
            np.concatenate([b.stops for b in batches]),
        )


class StreamingPacker:
    """Best-fit decreasing over a bounded buffer: packs a stream of sample lengths as it flows (module
    docstring for the rule).

    Args:
        packing_length: ``L``, the token budget of one pack, ``>= 1``.
        buffer_size: ``k``, items packed together (``>= 2``); memory and latency grow with it, the fill
            approaches the global plan's (``benchmarks/streaming.py``).
        strategy: a name in :data:`~varpack.plan.strategies.STRATEGY_TABLE` (``"bfd"``: best-fit decreasing
            within the buffer; ``"sequential"``: next-fit in stream order within the buffer).
        overflow: ``"error"``, ``"drop"``, ``"truncate"`` or ``"split"`` for samples longer than
            ``packing_length``, as in :func:`varpack.plan.plan_packs`.

    Raises:
        TypeError / ValueError: a bad setting (named).

    Example:
        >>> packer = StreamingPacker(8, buffer_size=4)
        >>> first = packer.add([3, 5, 2, 4])         # the buffer is full: packed, full packs emitted
        >>> [ids.tolist() for ids, _, _ in first]
        [[1, 0]]
        >>> [ids.tolist() for ids, _, _ in packer.finish()]   # the rest at the end of the stream
        [[3, 2]]
    """

    def __init__(
        self,
        packing_length: int,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        *,
        strategy: str = "bfd",
        overflow: str = "error",
    ) -> None:
        for name, value, least in (("packing_length", packing_length, 1), ("buffer_size", buffer_size, 2)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if int(value) < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")
        if strategy not in STRATEGY_TABLE:
            raise ValueError(f"packing_strategy must be one of {tuple(STRATEGY_TABLE)}, got {strategy!r}")
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
        self.packing_length = int(packing_length)
        self.buffer_size = int(buffer_size)
        self.strategy = strategy
        self.overflow = overflow
        self._pack = STRATEGY_TABLE[strategy].pack
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget everything: an empty buffer and report (a new epoch of the stream)."""
        self._ids, self._starts, self._stops = _NO, _NO, _NO  # the buffer, in arrival order
        self._ready = PackBatch.empty()  # packs emitted by a call that raised: the next call returns them
        self.next_id = 0  # id given to the next sample added without an explicit id
        self.num_samples = 0
        self.input_tokens = 0
        self.num_packs = 0
        self.num_items = 0
        self.total_tokens = 0
        self.max_pack_tokens = 0
        self.min_pack_tokens = 0
        self.max_items_per_pack = 0
        self.final_packs = 0
        self.final_tokens = 0
        self.finished = False
        self.report: dict[str, Any] = {
            "policy": self.overflow,
            "empty_ids": [],
            "overlong_ids": [],
            "overlong_lengths": [],
            "dropped_ids": [],
            "truncated_ids": [],
            "split_ids": [],
            "num_pieces": 0,
            "tokens_dropped": 0,
            "unsupervised_ids": [],
            "unsupervised_pieces": [],
        }

    @property
    def buffered(self) -> int:
        """Items waiting in the buffer."""
        return int(self._ids.shape[0])

    @property
    def buffered_sample_ids(self) -> np.ndarray:
        """``[B]`` int64 sample ids of the buffered items (a sample split into pieces appears once per
        piece), in buffer order."""
        return self._ids.copy()

    def state_dict(self) -> dict[str, Any]:
        """The packer's whole state as plain Python values (JSON-ready): settings, buffer, counters, report.

        :meth:`load_state_dict` on a packer with the same settings continues exactly where this one is."""
        return {
            "format": _FORMAT,
            "settings": self._settings(),
            "buffer": {
                "sample_ids": self._ids.tolist(),
                "starts": self._starts.tolist(),
                "stops": self._stops.tolist(),
            },
            "ready": {
                "offsets": self._ready.offsets.tolist(),
                "sample_ids": self._ready.sample_ids.tolist(),
                "starts": self._ready.starts.tolist(),
                "stops": self._ready.stops.tolist(),
            },
            "counters": {
                name: getattr(self, name)
                for name in (
                    "next_id",
                    "num_samples",
                    "input_tokens",
                    "num_packs",
                    "num_items",
                    "total_tokens",
                    "max_pack_tokens",
                    "min_pack_tokens",
                    "max_items_per_pack",
                    "final_packs",
                    "final_tokens",
                    "finished",
                )
            },
            "report": {k: (list(v) if isinstance(v, list) else v) for k, v in self.report.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Raises:
            ValueError: not a packer state, or made with other settings (naming them).
        """
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"not a StreamingPacker state (expected format {_FORMAT!r})")
        if state["settings"] != self._settings():
            raise ValueError(
                f"the state was saved by a packer with settings {state['settings']}, this one has "
                f"{self._settings()}"
            )
        buf = state["buffer"]
        self._ids = np.asarray(buf["sample_ids"], np.int64).reshape(-1)
        self._starts = np.asarray(buf["starts"], np.int64).reshape(-1)
        self._stops = np.asarray(buf["stops"], np.int64).reshape(-1)
        ready = state.get("ready")
        self._ready = (
            PackBatch(*(np.asarray(ready[k], np.int64) for k in ("offsets", "sample_ids", "starts", "stops")))
            if ready
            else PackBatch.empty()
        )
        for name, value in state["counters"].items():
            setattr(self, name, value)
        self.report = {k: (list(v) if isinstance(v, list) else v) for k, v in state["report"].items()}
        self.report.setdefault("unsupervised_ids", [])
        self.report.setdefault("unsupervised_pieces", [])

    def _settings(self) -> dict[str, Any]:
        return {
            "packing_length": self.packing_length,
            "buffer_size": self.buffer_size,
            "strategy": self.strategy,
            "overflow": self.overflow,
        }

    # ------------------------------------------------------------------ packing
    def add(self, lengths: Any, sample_ids: Any = None, *, supervised: Any = None) -> PackBatch:
        """Add samples (in stream order) and return the packs that became ready.

        Args:
            lengths: ``[n]`` non-negative integer token lengths (or one int).
            sample_ids: ``[n]`` int ids (the samples' indices in the stream, named in every report); default
                ``next_id, next_id + 1, ...``.
            supervised: optional ``supervised(sample_ids, starts, stops) -> [M] bool``, whether each token
                range (a whole sample or a piece of an overlong one) holds a supervised token, as in
                :func:`varpack.plan.plan_packs`: the ranges without one are dropped and reported by id
                (``unsupervised_ids`` / ``unsupervised_pieces``).

        Returns:
            The packs emitted by this call (often none), a :class:`PackBatch`; first the packs of an earlier
            call that raised (they are never lost).

        Raises:
            ValueError: a negative length (naming the sample), or with ``overflow="error"`` a sample longer
                than ``packing_length`` (its id and length). The samples before it in this call are added,
                and the packs they complete come with the next :meth:`add` or :meth:`finish`.
            RuntimeError: after :meth:`finish` (call :meth:`reset` for a new pass).
        """
        if self.finished:
            raise RuntimeError("the stream was finished; call reset() to start a new pass")
        arr = _as_lengths(np.atleast_1d(lengths))
        n = int(arr.shape[0])
        if sample_ids is None:
            ids = np.arange(self.next_id, self.next_id + n, dtype=np.int64)
        else:
            ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
            if ids.shape[0] != n:
                raise ValueError(f"{ids.shape[0]} sample_ids for {n} lengths")
        ready, self._ready = self._ready, PackBatch.empty()
        L = self.packing_length
        if n and self.overflow == "error" and int(arr.max()) > L:
            i = int(np.flatnonzero(arr > L)[0])
            # the samples before the overlong one are added; what they complete waits for the next call
            self._ready = PackBatch.concat([ready, self._add(arr[:i], ids[:i], supervised)])
            raise ValueError(
                f"sample {int(ids[i])} is longer than packing_length={L} ({int(arr[i])} tokens); raise "
                "packing_length or choose overflow='drop', overflow='truncate' or overflow='split'"
                + (
                    f" (the {i} sample(s) before it in this call were added: their packs come with the next "
                    "add() or finish())"
                    if i
                    else ""
                )
            )
        return PackBatch.concat([ready, self._add(arr, ids, supervised)])

    def _add(self, arr: np.ndarray, ids: np.ndarray, supervised: Any) -> PackBatch:
        """Add checked lengths with their ids (no sample longer than ``packing_length`` under ``error``)."""
        n = int(arr.shape[0])
        if n == 0:
            return PackBatch.empty()
        L = self.packing_length
        rep = self.report
        self.num_samples += n
        self.input_tokens += int(arr.sum())
        self.next_id = max(self.next_id, int(ids.max()) + 1)
        is_piece = None
        starts = np.zeros(n, np.int64)
        stops = arr
        if int(arr.min()) < 1 or int(arr.max()) > L:
            over = np.flatnonzero(arr > L)
            empty = arr == 0
            rep["empty_ids"].extend(ids[empty].tolist())
            keep = ~empty & (arr <= L)
            if over.size:
                rep["overlong_ids"].extend(ids[over].tolist())
                rep["overlong_lengths"].extend(arr[over].tolist())
                key = {"drop": "dropped_ids", "truncate": "truncated_ids", "split": "split_ids"}[
                    self.overflow
                ]
                rep[key].extend(ids[over].tolist())
                psample, pstart, pstop, dropped = overlong_pieces(over, arr[over], L, self.overflow)
                rep["num_pieces"] += int(psample.size)
                rep["tokens_dropped"] += dropped
                # items in stream order: whole samples and pieces (a piece sits where its sample was)
                pos = np.concatenate([np.flatnonzero(keep), psample])
                order = np.argsort(pos, kind="stable")
                item_ids = np.concatenate([ids[keep], ids[psample]])[order]
                starts = np.concatenate([np.zeros(int(keep.sum()), np.int64), pstart])[order]
                stops = np.concatenate([arr[keep], pstop])[order]
                is_piece = np.r_[np.zeros(int(keep.sum()), bool), np.ones(psample.size, bool)][order]
                ids = item_ids
            else:
                ids, starts, stops = ids[keep], starts[keep], arr[keep]
        if supervised is not None and ids.size:
            has = supervised_mask(supervised, ids, starts, stops)
            if not has.all():
                gone = ~has
                whole = gone if is_piece is None else gone & ~is_piece
                rep["unsupervised_ids"].extend(ids[whole].tolist())
                if is_piece is not None:
                    part = gone & is_piece
                    cut = zip(ids[part].tolist(), starts[part].tolist(), stops[part].tolist())
                    rep["unsupervised_pieces"].extend([s, a, b] for s, a, b in cut)
                    rep["num_pieces"] -= int(part.sum())
                rep["tokens_dropped"] += int((stops[gone] - starts[gone]).sum())
                ids, starts, stops = ids[has], starts[has], stops[has]
        return self._feed(ids, starts, stops)

    def _feed(self, ids: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> PackBatch:
        """Append items; pack every full buffer (windows of ``buffer_size`` items, the carried items first)."""
        k = self.buffer_size
        out: list[PackBatch] = []
        pos = 0
        n = int(ids.shape[0])
        bi, bs, be = self._ids, self._starts, self._stops
        while n - pos >= k - bi.shape[0]:
            need = k - int(bi.shape[0])
            wi = np.concatenate([bi, ids[pos : pos + need]])
            ws = np.concatenate([bs, starts[pos : pos + need]])
            we = np.concatenate([be, stops[pos : pos + need]])
            pos += need
            emitted, (bi, bs, be) = self._pack_window(wi, ws, we, carry=True)
            out.append(emitted)
        self._ids = np.concatenate([bi, ids[pos:]])
        self._starts = np.concatenate([bs, starts[pos:]])
        self._stops = np.concatenate([be, stops[pos:]])
        return PackBatch.concat(out)

    def _pack_window(
        self, ids: np.ndarray, starts: np.ndarray, stops: np.ndarray, *, carry: bool
    ) -> tuple[PackBatch, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Pack one window with the strategy; emit its packs, less the carried ones (``carry``)."""
        L = self.packing_length
        lens = stops - starts
        offsets, idx = self._pack(lens, L)
        sizes = np.diff(offsets)
        cs = np.zeros(idx.shape[0] + 1, np.int64)
        np.cumsum(lens[idx], out=cs[1:])
        pack_len = cs[offsets[1:]] - cs[offsets[:-1]]
        keep = np.ones(sizes.shape[0], bool)
        if carry:
            # the least-filled packs that are not full stay, up to half the buffer in items
            cand = np.flatnonzero(pack_len < L)
            cand = cand[np.argsort(pack_len[cand], kind="stable")]
            fits = np.cumsum(sizes[cand]) <= self.buffer_size // 2
            keep[cand[fits]] = False
        item_keep = np.repeat(keep, sizes)
        e_idx, c_idx = idx[item_keep], idx[~item_keep]
        e_off = np.zeros(int(keep.sum()) + 1, np.int64)
        np.cumsum(sizes[keep], out=e_off[1:])
        batch = PackBatch(e_off, ids[e_idx], starts[e_idx], stops[e_idx])
        self._count(pack_len[keep], sizes[keep])
        c_idx = np.sort(c_idx)  # carried items keep their arrival order
        return batch, (ids[c_idx], starts[c_idx], stops[c_idx])

    def _count(self, pack_len: np.ndarray, sizes: np.ndarray) -> None:
        if not pack_len.size:
            return
        first = self.num_packs == 0
        self.num_packs += int(pack_len.size)
        self.num_items += int(sizes.sum())
        self.total_tokens += int(pack_len.sum())
        self.max_pack_tokens = max(self.max_pack_tokens, int(pack_len.max()))
        lo = int(pack_len.min())
        self.min_pack_tokens = lo if first else min(self.min_pack_tokens, lo)
        self.max_items_per_pack = max(self.max_items_per_pack, int(sizes.max()))

    def finish(self) -> PackBatch:
        """End of the stream: pack and emit every buffered item (the final, partial packs included).

        Returns:
            The last packs (:class:`PackBatch`): first those of an :meth:`add` that raised, if not returned
            yet, then the final ones, which ``final_packs`` / ``final_tokens`` in the report count.
        """
        ready, self._ready = self._ready, PackBatch.empty()
        if self.finished:
            return ready
        self.finished = True
        if not self.buffered:
            return ready
        batch, _ = self._pack_window(self._ids, self._starts, self._stops, carry=False)
        self._ids, self._starts, self._stops = _NO, _NO, _NO
        self.final_packs = batch.num_packs
        self.final_tokens = int(batch.pack_lengths.sum())
        return PackBatch.concat([ready, batch])

    # ------------------------------------------------------------------ report
    @property
    def fill_ratio(self) -> float:
        """``total_tokens / (num_packs * packing_length)`` of the packs emitted so far (0.0 before any)."""
        return self.total_tokens / (self.num_packs * self.packing_length) if self.num_packs else 0.0

    def summary(self, **context: Any) -> dict[str, Any]:
        """The packing report so far, in the format of :func:`varpack.plan.report.plan_summary` (so
        :func:`~varpack.plan.report.summary_text` / :func:`~varpack.plan.report.summary_table` render it),
        plus ``buffer_size``, ``buffered`` (items not packed yet), ``finished``, ``final_packs`` and
        ``final_tokens`` (the packs emitted at the end of the stream). ``context`` is added last
        (``data``: the label the renderers show)."""
        ov = self.report
        out: dict[str, Any] = {
            "num_samples": self.num_samples,
            "num_items": self.num_items,
            "num_packs": self.num_packs,
            "total_tokens": self.total_tokens,
            "lower_bound_packs": -(-self.total_tokens // self.packing_length),
            "fill_ratio": self.fill_ratio,
            "packing_length": self.packing_length,
            "strategy": self.strategy,
            "overflow_policy": self.overflow,
            "num_empty": len(ov["empty_ids"]),
            "num_overlong": len(ov["overlong_ids"]),
            "num_dropped": len(ov["dropped_ids"]),
            "num_truncated": len(ov["truncated_ids"]),
            "num_split": len(ov["split_ids"]),
            "num_pieces": ov["num_pieces"],
            "num_unsupervised": len(ov["unsupervised_ids"]) + len(ov["unsupervised_pieces"]),
            "tokens_dropped": ov["tokens_dropped"],
            "max_pack_tokens": self.max_pack_tokens,
            "min_pack_tokens": self.min_pack_tokens,
            "max_items_per_pack": self.max_items_per_pack,
            "input_tokens": self.input_tokens,
            "overflow": {k: (list(v) if isinstance(v, list) else v) for k, v in ov.items()},
            "buffer_size": self.buffer_size,
            "buffered": self.buffered,
            "finished": self.finished,
            "final_packs": self.final_packs,
            "final_tokens": self.final_tokens,
        }
        out.update(context)
        return out

    def __repr__(self) -> str:
        return (
            f"StreamingPacker(strategy={self.strategy!r}, packing_length={self.packing_length}, "
            f"buffer_size={self.buffer_size}, samples={self.num_samples}, packs={self.num_packs}, "
            f"buffered={self.buffered}, fill_ratio={self.fill_ratio:.4f})"
        )
