"""``VarlenMeta``: the boundaries of one packed batch, built once, validated once, read by every consumer.

A padding-free batch is one stream of ``T`` tokens holding ``N`` samples. Its boundaries are born once, in
the collator, from the sample lengths; every consumer -- varlen attention (each backend), the gated delta
rule and its short convolution, the loss, the vision tower's isolation, the packing guard -- reads this one
frozen object instead of re-deriving and re-validating them in every layer:

=========================== ================================ =============================================
attribute                   type                             meaning
=========================== ================================ =============================================
``cu_seqlens_q`` / ``_k``   ``[N+1]`` int32 tensor (CPU, or  ``[0, ..., T]`` segment offsets (one object
                            a device when built from device  for both in self-attention)
                            kwargs: values then unread)
``max_seqlen_q`` / ``_k``   Python int                       longest segment (an upper bound is accepted)
``total_q`` / ``total_k``   Python int                       ``T``
``num_seqs``                Python int                       ``N``
``has_empty``               bool, or None (device-only)      some segment has zero tokens
``cu_seqlens_linear``       ``[N+1]`` int32 tensor, or None  the offsets the linear-attention mixers (the
                            (the offsets' device)            gated delta rule) run on: ``cu_seqlens_q`` with
                                                             its trailing pad segments merged into one
``linear_chunk_rows``       Python int, or None              a bound of the 64-token chunks of
                                                             ``cu_seqlens_linear`` (a static shape's)
=========================== ================================ =============================================

``cu_seqlens_linear`` is set by the collator's static layout (:class:`varpack.collate.StaticShape`), whose pad
segments come after every real sample: for the linear-attention layers the pad tokens form one sequence (the
first pad segment's offset, then ``T`` for every later entry: empty segments) instead of many short ones. A
pad token never reaches a real token (causal, and the pad sequence starts at the last real sample's end), so
real tokens' outputs, the loss and every gradient are the same; what changes is the work of the chunked gated
delta kernels, which is per chunk of :data:`LINEAR_CHUNK_SIZE` tokens and so per segment for short segments.

Derived values are built lazily, once per batch, and kept on the object (never in a module-level cache):
:meth:`cu_seqlens_on` (one host-to-device copy per device), :meth:`seq_idx` / :meth:`seq_idx_on`,
:meth:`host_offsets` (the offsets as Python lists, for the per-segment backends: no device read when the
meta was built on the CPU, one per batch otherwise) and :meth:`memo` (a backend's per-batch derived object:
FlexAttention's block mask, the gated-delta chunk layout). :meth:`flash_attn_kwargs` is the transformers
view (``cu_seq_lens_q/k``, ``max_length_q/k``: ``FlashAttentionKwargs``).

It travels with the batch under the key ``varlen_meta`` (:data:`varpack.schema.VARLEN_META`): Hugging Face
``Trainer`` moves tensors and containers of tensors to the device and leaves other objects alone, and
transformers hands unknown keyword arguments down to every decoder layer and attention function, so the
same object reaches every layer of a step; it pickles (DataLoader workers).

Sources: the ``cu_seqlens`` / ``max_seqlen`` convention of FlashAttention's varlen API
(Dao-AILab/flash-attention, ``flash_attn_varlen_func``) and transformers' ``FlashAttentionKwargs``; the
``seq_idx`` form of Mamba-2 / fla's ``causal_conv1d``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import numpy as np
import torch

from varpack.schema import FLASH_ATTN_KWARGS, SEQ_IDX
from varpack.varlen.boundaries import (
    _validate_values,
    normalize_cu_seqlens,
    normalize_max_seqlen,
    seq_idx_from_cu_seqlens,
    seq_idx_on_device,
)

__all__ = ["LINEAR_CHUNK_SIZE", "VarlenMeta", "linear_chunk_count", "varlen_meta_from_kwargs"]

_INT32_MAX = int(np.iinfo(np.int32).max)

#: tokens per chunk of the chunked linear-attention kernels (fla's gated delta rule: ``varpack.ops._fla.FLA_CHUNK_SIZE``)
LINEAR_CHUNK_SIZE = 64


def linear_chunk_count(lengths: Any, chunk_size: int = LINEAR_CHUNK_SIZE) -> int:
    """``sum(ceil(length / chunk_size))`` over segment lengths ``[N]`` (host integers; empty segments have no
    chunk): the chunks the chunked gated delta kernels run for these segments."""
    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    return int(((arr + chunk_size - 1) // chunk_size).sum())


class VarlenMeta:
    """The boundaries of one packed stream (module docstring); frozen after construction.

    Args:
        cu_seqlens_q: ``[N+1]`` offsets of the query stream: an int32/int64 tensor (CPU or device), or a list
            / NumPy array of integers (converted once, :func:`varpack.varlen.normalize_cu_seqlens`).
        cu_seqlens_k: offsets of the key stream (default: the query offsets, self-attention).
        max_seqlen_q, max_seqlen_k: host integers (:func:`varpack.varlen.normalize_max_seqlen`) at least the
            longest segment; default: the longest segment (read from CPU offsets; required for device ones).
        total_q, total_k: the stream's token count ``T`` (default: the last offset of CPU offsets; required
            for device ones).
        allow_empty: accept zero-length segments.
        cu_seqlens_linear: the linear-attention offsets (module docstring): ``[N+1]``, on the offsets' device,
            equal to ``cu_seqlens_q`` up to an entry ``j >= 1`` and ``T`` from ``j + 1`` on (the segments from
            ``j`` on merged into one, the rest empty; the first segment is never merged); self-attention metas
            only. Default ``None``: the
            linear layers run on ``cu_seqlens_q``.
        linear_chunk_rows: a host integer at least :func:`linear_chunk_count` of ``cu_seqlens_linear``'s
            segments (checked for CPU offsets): the fixed row count of the chunk tables the gated delta rule
            builds on the device (a static shape's bound, :class:`varpack.collate.StaticShape`); needs
            ``cu_seqlens_linear``.

    CPU offsets are validated here, once (:func:`varpack.varlen.validate_cu_seqlens`: starts at 0, ends at
    ``T``, increasing; ``max_seqlen`` not below the longest segment). Offsets on a device are not read (no
    host sync): only their type and shape are checked; they are trusted as produced where the batch was built.

    Raises:
        TypeError: offsets that are not integers, a ``max_seqlen`` / ``total`` / ``linear_chunk_rows`` that is not
            a host integer.
        ValueError: invalid offsets (named ``cu_seqlens_q`` / ``cu_seqlens_k``), q and k offsets of different
            lengths, a device meta without ``max_seqlen`` / ``total``; ``cu_seqlens_linear`` that is not such a
            merge of ``cu_seqlens_q`` (or of another shape or device), more chunks than ``linear_chunk_rows``.

    Example:
        >>> meta = VarlenMeta.from_lengths([3, 1, 3])
        >>> meta.cu_seqlens_q, meta.max_seqlen_q, meta.total_q, meta.num_seqs
        (tensor([0, 3, 4, 7], dtype=torch.int32), 3, 7, 3)
        >>> meta.seq_idx()
        tensor([[0, 0, 0, 1, 2, 2, 2]], dtype=torch.int32)
        >>> sorted(meta.flash_attn_kwargs())
        ['cu_seq_lens_k', 'cu_seq_lens_q', 'max_length_k', 'max_length_q']
    """

    __slots__ = (
        "_derived",
        "_lock",
        "cu_seqlens_k",
        "cu_seqlens_linear",
        "cu_seqlens_q",
        "has_empty",
        "linear_chunk_rows",
        "max_seqlen_k",
        "max_seqlen_q",
        "num_seqs",
        "total_k",
        "total_q",
    )

    def __init__(
        self,
        cu_seqlens_q: Any,
        cu_seqlens_k: Any = None,
        max_seqlen_q: Any = None,
        max_seqlen_k: Any = None,
        *,
        total_q: Any = None,
        total_k: Any = None,
        allow_empty: bool = True,
        cu_seqlens_linear: Any = None,
        linear_chunk_rows: Any = None,
    ) -> None:
        same = cu_seqlens_k is None or cu_seqlens_k is cu_seqlens_q
        cu_q = normalize_cu_seqlens(cu_seqlens_q, "cu_seqlens_q")
        cu_k = cu_q if same else normalize_cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
        if cu_q.shape[0] != cu_k.shape[0]:
            raise ValueError(f"cu_seqlens_q has {cu_q.shape[0]} entries but cu_seqlens_k has {cu_k.shape[0]}")
        if same:  # self-attention: one segmentation, one check
            max_seqlen_k = max_seqlen_q if max_seqlen_k is None else max_seqlen_k
            total_k = total_q if total_k is None else total_k
        cu_q, max_q, tot_q, empty_q, host_q = _checked("q", cu_q, max_seqlen_q, total_q, allow_empty)
        if same and max_seqlen_k == max_seqlen_q and total_k == total_q:
            cu_k, max_k, tot_k, empty_k, host_k = cu_q, max_q, tot_q, empty_q, host_q
        else:
            cu_k, max_k, tot_k, empty_k, host_k = _checked("k", cu_k, max_seqlen_k, total_k, allow_empty)
        setattr_ = object.__setattr__
        setattr_(self, "cu_seqlens_q", cu_q)
        setattr_(self, "cu_seqlens_k", cu_k)
        setattr_(self, "max_seqlen_q", max_q)
        setattr_(self, "max_seqlen_k", max_k)
        setattr_(self, "total_q", tot_q)
        setattr_(self, "total_k", tot_k)
        setattr_(self, "num_seqs", int(cu_q.shape[0]) - 1)
        setattr_(self, "has_empty", None if empty_q is None or empty_k is None else (empty_q or empty_k))
        lin, rows = _checked_linear(cu_q, host_q, tot_q, same, cu_seqlens_linear, linear_chunk_rows)
        setattr_(self, "cu_seqlens_linear", lin)
        setattr_(self, "linear_chunk_rows", rows)
        derived: dict[Hashable, Any] = {}
        if host_q is not None and host_k is not None:  # read once, while validating: no later host read
            derived["host_offsets"] = (host_q, host_q if host_k is host_q else host_k)
        setattr_(self, "_derived", derived)
        setattr_(self, "_lock", threading.RLock())  # re-entrant: a build may read another memo

    # -- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_lengths(
        cls, lengths: Any, *, max_seqlen: Any = None, linear_from: int | None = None, linear_chunk_rows: Any = None
    ) -> VarlenMeta:
        """From the segment lengths ``[N]`` (positive integers; a zero-length segment is allowed), on the CPU.

        Args:
            lengths: ``[N]`` integer token counts, in stream order.
            max_seqlen: the ``max_seqlen`` to carry (a host integer at least the longest segment: a fixed
                bucket, e.g. :class:`varpack.collate.StaticShape`'s); default: the longest segment.
            linear_from: the first of the trailing segments merged into one for the linear-attention layers
                (``cu_seqlens_linear``: the collator's first pad segment; ``N - 1``: the offsets themselves),
                ``>= 1``; ``None``: no ``cu_seqlens_linear``.
            linear_chunk_rows: ``linear_chunk_rows`` to carry (with ``linear_from``).

        Raises:
            ValueError: not 1-D, empty, a negative length, more tokens than int32 offsets can index, or a
                ``max_seqlen`` below the longest segment.
        """
        arr = np.asarray(lengths)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"lengths must be a non-empty 1-D sequence, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"lengths must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
        if (arr < 0).any():
            raise ValueError(f"lengths must be >= 0, got {int(arr.min())} at {int(np.argmin(arr))}")
        cu = np.zeros(arr.size + 1, dtype=np.int64)
        np.cumsum(arr, out=cu[1:])
        if cu[-1] > np.iinfo(np.int32).max:
            raise ValueError(f"the batch has {int(cu[-1])} tokens, more than int32 cu_seqlens can index")
        linear = None
        if linear_from is not None:
            if isinstance(linear_from, bool) or not isinstance(linear_from, (int, np.integer)):
                raise TypeError(f"linear_from must be an integer segment index, got {linear_from!r}")
            j = int(linear_from)
            if not 1 <= j < arr.size and not (j == 0 and arr.size == 1):
                raise ValueError(
                    f"linear_from={linear_from} is not a segment index from 1 to {arr.size - 1} (the first segment "
                    "is never merged)"
                )
            linear = cu.copy()
            linear[j + 1 :] = cu[-1]
            linear = torch.from_numpy(linear.astype(np.int32))
        elif linear_chunk_rows is not None:
            raise ValueError("linear_chunk_rows needs linear_from (the linear-attention offsets it bounds)")
        return cls(
            torch.from_numpy(cu.astype(np.int32)), max_seqlen_q=max_seqlen, cu_seqlens_linear=linear,
            linear_chunk_rows=linear_chunk_rows,
        )  # fmt: skip

    @classmethod
    def from_seq_idx(cls, seq_idx: Any, total: int) -> VarlenMeta:
        """From a ``[1, T]`` / ``[T]`` segment index of every token (a new segment wherever it changes).

        A device tensor is copied to the host once (one sync per batch, where it is called).

        Raises:
            TypeError: a non-integer ``seq_idx``. ValueError: ``seq_idx`` does not have ``total`` entries.
        """
        if not isinstance(seq_idx, torch.Tensor):
            seq_idx = torch.as_tensor(np.asarray(seq_idx))
        if seq_idx.dtype == torch.bool or seq_idx.is_floating_point() or seq_idx.is_complex():
            raise TypeError(f"seq_idx must hold integers (a [1, T] int32 tensor), got dtype {seq_idx.dtype}")
        si = seq_idx.detach().to("cpu", torch.int64).reshape(-1)
        if si.numel() != total:
            raise ValueError(f"seq_idx has {si.numel()} entries (shape {tuple(seq_idx.shape)}) but T={total}")
        starts = torch.nonzero(si[1:] != si[:-1]).flatten() + 1
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), starts, torch.tensor([total])])
        return cls(cu.to(torch.int32))

    # -- immutability -------------------------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"VarlenMeta is frozen (cannot set {name!r})")

    def __reduce__(
        self,
    ):  # pickles as its defining values (DataLoader workers); derived values rebuilt lazily
        return (
            _rebuild,
            (
                self.cu_seqlens_q,
                self.cu_seqlens_k,
                self.max_seqlen_q,
                self.max_seqlen_k,
                self.total_q,
                self.total_k,
                self.cu_seqlens_linear,
                self.linear_chunk_rows,
            ),
        )

    def __repr__(self) -> str:
        where = self.cu_seqlens_q.device
        return (
            f"VarlenMeta(N={self.num_seqs}, T={self.total_q}, max_seqlen={self.max_seqlen_q}"
            + ("" if self.self_attention else f", Tk={self.total_k}, max_seqlen_k={self.max_seqlen_k}")
            + f", {where})"
        )

    # -- views -------------------------------------------------------------------------------------------
    @property
    def self_attention(self) -> bool:
        """Query and key streams share one segmentation (the packed-training case)."""
        return self.cu_seqlens_k is self.cu_seqlens_q

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """The query stream's offsets (the stream's, in self-attention)."""
        return self.cu_seqlens_q

    @property
    def max_seqlen(self) -> int:
        """The query stream's longest segment."""
        return self.max_seqlen_q

    @property
    def total_tokens(self) -> int:
        """``T`` of the query stream."""
        return self.total_q

    def flash_attn_kwargs(self) -> dict[str, Any]:
        """transformers' ``FlashAttentionKwargs``: ``cu_seq_lens_q/k`` (these tensors) and ``max_length_q/k``."""
        q, k, mq, mk = FLASH_ATTN_KWARGS
        return {q: self.cu_seqlens_q, k: self.cu_seqlens_k, mq: self.max_seqlen_q, mk: self.max_seqlen_k}

    # -- derived, once per batch -----------------------------------------------------------------------------
    def memo(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()`` once per ``key`` for this batch, then the kept result (thread-safe; ``build`` may read
        other memoized values, e.g. :meth:`cu_seqlens_cpu` of a device meta: the lock is re-entrant).

        The home of per-batch objects a consumer derives from the boundaries: FlexAttention's block mask,
        the gated-delta chunk layout, device copies. They live and die with this batch.
        """
        with self._lock:
            if key not in self._derived:
                self._derived[key] = build()
            return self._derived[key]

    def cu_seqlens_on(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cu_seqlens_q, cu_seqlens_k)`` as int32 on ``device``: one host-to-device copy per batch."""
        device = torch.device(device)
        if self.cu_seqlens_q.device == device:
            return self.cu_seqlens_q, self.cu_seqlens_k

        def copy() -> tuple[torch.Tensor, torch.Tensor]:
            q = self.cu_seqlens_q.to(device=device, dtype=torch.int32, non_blocking=True)
            k = q if self.self_attention else self.cu_seqlens_k.to(device, torch.int32, non_blocking=True)
            return q, k

        return self.memo(("cu_seqlens", str(device)), copy)

    def on_device(self, device: torch.device | str) -> VarlenMeta:
        """This batch's boundaries with the offsets on ``device``: a new frozen meta, built once per batch and
        device (kept on this one), whose ``cu_seqlens_q/k`` are :meth:`cu_seqlens_on` ``(device)`` (one
        host-to-device copy), whose ``cu_seqlens_linear`` is copied with them, and whose ``max_seqlen`` / ``T`` /
        ``has_empty`` and host offsets are this meta's
        (already read on the host: no consumer of the device meta reads the device offsets back).

        What a captured CUDA graph needs: every tensor a compiled layer reads lives on the device
        (torch.compile's ``mode="reduce-overhead"`` skips CUDA graphs for a graph with CPU tensor inputs, and
        under ``compile_layers(custom_ops=True)`` the layers read ``meta.cu_seqlens_q``). Named ``on_device``,
        not ``to``: Hugging Face ``Trainer`` / accelerate move objects that have a ``.to`` method, and the meta
        stays where the collator built it unless asked. A meta already on ``device`` is returned as is.
        """
        device = torch.device(device)
        if self.cu_seqlens_q.device == device:
            return self
        cu_q, cu_k = self.cu_seqlens_on(device)

        def build() -> VarlenMeta:
            lin = self.cu_seqlens_linear
            moved = VarlenMeta(
                cu_q,
                None if self.self_attention else cu_k,
                self.max_seqlen_q,
                self.max_seqlen_k,
                total_q=self.total_q,
                total_k=self.total_k,
                cu_seqlens_linear=None if lin is None else lin.to(device, non_blocking=True),
                linear_chunk_rows=self.linear_chunk_rows,
            )
            object.__setattr__(moved, "has_empty", self.has_empty)
            known = self._derived.get("host_offsets")
            if known is not None:  # read on the host already: kept, so the device offsets are never read
                moved._derived["host_offsets"] = known
            if self.cu_seqlens_q.device.type == "cpu":  # cu_seqlens_cpu(): this meta's tensor, no copy back
                moved._derived[("cu_seqlens", "cpu")] = self.cu_seqlens_q
                if lin is not None:
                    moved._derived[("cu_seqlens_linear", "cpu")] = lin
            return moved

        return self.memo(("on_device", str(device)), build)

    def chunked(self, chunk_size: int) -> VarlenMeta:
        """These boundaries with every segment cut into consecutive chunks of ``chunk_size`` tokens counted
        from the segment's start (the last chunk of a segment may be shorter): the boundaries of chunked
        attention (Llama 4's ``chunked_attention`` layers: a token sees the keys of its own chunk only, and a
        sample's positions restart at 0, so its chunks start at its first token). Built once per batch and
        size from the host offsets (no device read for a meta built on the CPU) and kept on this meta.

        Raises:
            ValueError: ``chunk_size < 1``, or a meta whose key stream differs from its query stream.
        """
        chunk = int(chunk_size)
        if chunk < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size!r}")
        if not self.self_attention:
            raise ValueError("chunked boundaries need a self-attention meta (one segmentation for q and k)")

        offsets, _ = self.host_offsets()

        def build() -> VarlenMeta:
            cuts = [0]
            for start, stop in zip(offsets, offsets[1:]):
                cuts.extend(range(start + chunk, stop, chunk))
                cuts.append(stop)
            meta = VarlenMeta(
                torch.tensor(cuts, dtype=torch.int32),
                max_seqlen_q=max(1, min(chunk, self.max_seqlen_q)),
                total_q=self.total_q,
            )
            return meta

        return self.memo(("chunked", chunk), build)

    def cu_seqlens_cpu(self) -> torch.Tensor:
        """The query offsets on the CPU (int32): the tensor itself for a CPU meta, else one copy per batch."""
        if self.cu_seqlens_q.device.type == "cpu":
            return self.cu_seqlens_q
        return self.memo(("cu_seqlens", "cpu"), lambda: self.cu_seqlens_q.to("cpu"))

    def cu_seqlens_linear_cpu(self) -> torch.Tensor | None:
        """``cu_seqlens_linear`` on the CPU (int32), or ``None`` without them: the tensor itself for a CPU meta,
        else one copy per batch (none for a meta moved from the CPU by :meth:`on_device`)."""
        lin = self.cu_seqlens_linear
        if lin is None or lin.device.type == "cpu":
            return lin
        return self.memo(("cu_seqlens_linear", "cpu"), lambda: lin.to("cpu"))

    def host_offsets(self) -> tuple[list[int], list[int]]:
        """The offsets as Python lists ``(q, k)``: free for a CPU meta; one device read per batch otherwise."""

        def read() -> tuple[list[int], list[int]]:
            q = [int(x) for x in self.cu_seqlens_q.tolist()]
            k = q if self.self_attention else [int(x) for x in self.cu_seqlens_k.tolist()]
            return q, k

        return self.memo("host_offsets", read)

    def seq_idx(self) -> torch.Tensor:
        """``[1, T]`` int32 segment index of every query token (``0..N-1``), on the offsets' device: the
        collator's ``seq_idx`` (:func:`varpack.varlen.seq_idx_from_cu_seqlens`, varpack's one builder)."""
        return self.memo(SEQ_IDX, self._build_seq_idx)

    def _build_seq_idx(self) -> torch.Tensor:
        cu = self.cu_seqlens_q
        if cu.device.type == "cpu":
            return seq_idx_from_cu_seqlens(cu, self.total_q)
        # device offsets (trusted, never read): the index of the segment holding each token, on the device
        return seq_idx_on_device(cu, self.total_q)

    def seq_idx_on(self, device: torch.device | str) -> torch.Tensor:
        """:meth:`seq_idx` on ``device`` (one copy per batch and device)."""
        device = torch.device(device)
        base = self.seq_idx()
        if base.device == device:
            return base
        return self.memo((SEQ_IDX, str(device)), lambda: base.to(device, non_blocking=True))


def _checked(
    side: str, cu: torch.Tensor, max_len: Any, total: Any, allow_empty: bool
) -> tuple[torch.Tensor, int, int, bool | None, list[int] | None]:
    """One stream's offsets as int32, its max_seqlen and T, whether a segment is empty, and the offsets as a
    list (the last two None for device offsets: unread)."""
    name = f"cu_seqlens_{side}"
    if max_len is not None:
        max_len = normalize_max_seqlen(max_len, f"max_seqlen_{side}")
    if total is not None:
        total = normalize_max_seqlen(total, f"total_{side}")
    if cu.device.type != "cpu":  # trusted as built; reading it would sync with the host
        if max_len is None or total is None:
            raise ValueError(
                f"{name} lives on {cu.device}: give max_seqlen_{side} and total_{side} (host integers); "
                "varpack does not read device boundaries"
            )
        return (cu if cu.dtype == torch.int32 else cu.to(torch.int32)), max_len, total, None, None
    host = np.asarray(cu.tolist(), dtype=np.int64)  # (tolist: also under functionalization, e.g. torch.func)
    if host.size and (host.max() > _INT32_MAX or host.min() < 0):
        raise ValueError(f"{name} has values outside [0, int32 max]: the varlen kernels index with int32")
    if total is None:
        total = int(host[-1])
    cu32 = cu if cu.dtype == torch.int32 else cu.to(torch.int32)
    # validate_cu_seqlens' checks, on the values just read (one host read per batch)
    _validate_values(host, total, allow_empty=allow_empty, max_seqlen=max_len, at_least=True, name=name)
    lengths = np.diff(host)
    if max_len is None:
        max_len = int(lengths.max())
    return cu32, max_len, total, bool((lengths == 0).any()), host.tolist()


def _rebuild(cu_q, cu_k, max_q, max_k, total_q, total_k, cu_lin=None, rows=None) -> VarlenMeta:
    return VarlenMeta(
        cu_q, cu_k, max_q, max_k, total_q=total_q, total_k=total_k, cu_seqlens_linear=cu_lin, linear_chunk_rows=rows
    )


def _checked_linear(
    cu_q: torch.Tensor, host_q: list[int] | None, total: int, same: bool, cu_lin: Any, rows: Any
) -> tuple[torch.Tensor | None, int | None]:
    """``(cu_seqlens_linear as int32, linear_chunk_rows)`` checked against the query offsets (their host values
    when read: a merge of the trailing segments, chunks within ``rows``); device offsets are trusted."""
    if cu_lin is None:
        if rows is not None:
            raise ValueError("linear_chunk_rows needs cu_seqlens_linear (the offsets it bounds)")
        return None, None
    if not same:
        raise ValueError("cu_seqlens_linear needs a self-attention meta (one segmentation for q and k)")
    lin = normalize_cu_seqlens(cu_lin, "cu_seqlens_linear")
    if lin.shape != cu_q.shape or lin.device != cu_q.device:
        raise ValueError(
            f"cu_seqlens_linear must be [N+1]={tuple(cu_q.shape)} on {cu_q.device} like cu_seqlens_q, got "
            f"{tuple(lin.shape)} on {lin.device}"
        )
    if rows is not None:
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1:
            raise (ValueError if isinstance(rows, (int, np.integer)) and not isinstance(rows, bool) else TypeError)(
                f"linear_chunk_rows must be a host integer >= 1 (a count of 64-token chunks), got {rows!r}"
            )
        rows = int(rows)
    lin = lin if lin.dtype == torch.int32 else lin.to(torch.int32)
    if host_q is None:  # device offsets: trusted as built
        return lin, rows
    q = np.asarray(host_q, dtype=np.int64)
    h = np.asarray(lin.tolist(), dtype=np.int64)
    differ = np.flatnonzero(h != q)
    j = int(differ[0]) if differ.size else q.size
    if j < 2 or (h[j:] != total).any():  # the first segment is never merged (offsets 0 and 1 kept)
        raise ValueError(
            "cu_seqlens_linear must equal cu_seqlens_q up to an entry and T after it (trailing segments merged "
            f"into one), got {h[:8].tolist()}... for cu_seqlens_q {q[:8].tolist()}..."
        )
    if rows is not None:
        chunks = linear_chunk_count(np.diff(h))
        if chunks > rows:
            raise ValueError(
                f"cu_seqlens_linear holds {chunks} chunks of {LINEAR_CHUNK_SIZE} tokens, more than "
                f"linear_chunk_rows={rows}"
            )
    return lin, rows


def _check_agrees(meta: VarlenMeta, kwargs: Mapping[str, Any]) -> None:
    """``cu_seq_lens_q/k`` / ``max_length_q/k`` given beside a meta must be its view (the same batch): the same
    tensor, an equal CPU tensor, or a device copy with the same number of entries (values not read); never a
    silent winner between two different sets of boundaries."""
    q, k, mq, mk = FLASH_ATTN_KWARGS
    for key, cu in ((q, meta.cu_seqlens_q), (k, meta.cu_seqlens_k)):
        given = kwargs.get(key)
        if given is None or given is cu:
            continue
        if not isinstance(given, torch.Tensor) or given.shape != cu.shape:
            shape = tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
            raise ValueError(
                f"{key} ({shape}) disagrees with varlen_meta ({meta}); pass the collator's batch unchanged, "
                "or drop varlen_meta when you replace the boundaries"
            )
        if given.device.type == "cpu" and cu.device.type == "cpu" and not torch.equal(given.to(cu.dtype), cu):
            raise ValueError(f"{key} disagrees with varlen_meta's offsets ({meta}); drop one of them")
    for key, value in ((mq, meta.max_seqlen_q), (mk, meta.max_seqlen_k)):
        given = kwargs.get(key)
        if given is not None and normalize_max_seqlen(given, key) != value:
            raise ValueError(f"{key}={given} disagrees with varlen_meta's max_seqlen {value}")


def varlen_meta_from_kwargs(kwargs: Mapping[str, Any], total: int | None, where: str) -> VarlenMeta | None:
    """The batch's :class:`VarlenMeta` from a model call's keyword arguments, or ``None`` (unpacked call).

    ``varlen_meta`` wins (already validated: only its token count is compared with ``total``). Otherwise it
    is built once from transformers' boundary kwargs (``cu_seq_lens_q/k``, ``max_length_q/k``), or from
    ``seq_idx`` alone; this is the single place where a model call's raw boundary kwargs are turned into
    boundaries (the packing guard and the gated-delta text-model hook call it once per forward).

    Raises:
        ValueError: a meta / boundaries that do not cover ``total`` tokens, invalid boundaries, ``max_length_*``
            missing for device boundaries; TypeError: wrong types -- each message starts with ``where``.
    """
    meta = kwargs.get("varlen_meta")
    try:
        if meta is not None:
            if not isinstance(meta, VarlenMeta):
                raise TypeError(f"varlen_meta must be a varpack.varlen.VarlenMeta, got {type(meta).__name__}")
            _check_agrees(meta, kwargs)
        elif kwargs.get("cu_seq_lens_q") is not None:
            q, k, mq, mk = FLASH_ATTN_KWARGS
            cu_q, cu_k = kwargs[q], kwargs.get(k)
            max_q, max_k = kwargs.get(mq), kwargs.get(mk)
            if cu_q is cu_k or cu_k is None:
                cu_k, max_k = None, (max_q if max_k is None else max_k)
            try:
                meta = VarlenMeta(cu_q, cu_k, max_q, max_k, total_q=total, total_k=total)
            except (TypeError, ValueError) as exc:  # name the keys as the caller passed them
                msg = str(exc).replace("cu_seqlens_", "cu_seq_lens_").replace("max_seqlen_", "max_length_")
                raise type(exc)(msg) from None
        elif kwargs.get(SEQ_IDX) is not None and total is not None:
            meta = VarlenMeta.from_seq_idx(kwargs[SEQ_IDX], total)
        else:
            return None
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}: {exc}") from exc
    if total is not None and meta.total_q != total:
        raise ValueError(
            f"{where}: the packed boundaries cover {meta.total_q} tokens but the stream has T={total}"
        )
    return meta
