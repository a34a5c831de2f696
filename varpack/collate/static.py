"""Static-shape packed batches: every step has the same tensor shapes, so a step can be a captured CUDA graph.

A CUDA graph replays fixed kernels on fixed buffers: a compiled region captured with
``torch.compile(mode="reduce-overhead")`` is recorded once per distinct input shape (and per distinct Python
int it specialises on), so packs whose token count ``T``, sample count ``N`` or ``max_seqlen`` differ from step
to step record a new graph each time (PyTorch docs, "CUDA Graphs" in the CUDA semantics notes and
``torch.compile``'s ``mode="reduce-overhead"``: "CUDA graphs ... require static input shapes"). A
:class:`StaticShape` fixes the three:

* ``tokens`` (``T_static``): every row is padded to exactly this many tokens;
* ``segments`` (``N_static``): every row has exactly this many segments, so ``cu_seqlens`` is always
  ``[N_static + 1]``: the real samples, then ``N_static - N`` pad segments that share the pad tokens, **each at
  least one token long** by default. With ``empty_pads=True`` pad segments may be zero-length (repeated
  values at the end of ``cu_seqlens``): no row then needs a token per pad segment, so ``tokens`` is the
  longest pack itself (rounded) instead of the longest pack plus its pad segments -- at packing length 8,192 a
  row of 8,192 tokens instead of 8,320, 1.6% fewer tokens run per step. Only for attention backends whose
  :class:`varpack.attn.Capabilities` have ``empty_segments`` (``triton_short`` and the PyTorch backends, not
  FlashAttention-4; :func:`varpack.integrations.cuda_graphs.static_shape_for` decides);
* ``max_seqlen``: a fixed Python int bucket, an upper bound of every segment (real and pad) of every row.
  Every varpack attention backend accepts an upper bound: ``reference``, ``sdpa``, ``flex`` and
  ``triton_short`` read the segments from ``cu_seqlens`` and ignore it; ``flash_attn`` (FA2), ``flash_attn_3``,
  ``torch_varlen`` and ``flash_attn_4`` size their launch grid with it (blocks past a segment's end exit
  early) and FA4's window arithmetic (:func:`varpack.attn.flash_attn4.fa4_window`) only uses it as "larger
  than any segment"; ``auto``'s short-documents class (``max_seqlen <= 128``) is then read from the bucket.

Pad tokens are what :class:`~varpack.collate.PaddingFreeCollator`'s ``pad_to_multiple_of`` pad segment holds:
``input_ids = pad_token_id``, ``labels = -100`` (never supervised, so ``num_items_in_batch`` -- the count of
``labels != -100`` -- counts real supervised tokens only), ``loss_scale = 0``, positions restarting at 0 in
every pad segment, their own ``seq_idx`` values ``N .. N_static - 1`` (a zero-length pad segment's index
never appears). Pad segments come after every real
sample, so ``cu_seqlens[N]`` is the real token count (what ``varpack.train``'s ``batch_stats`` reads). Each
pad segment attends only to itself (it is its own segment), and under causal attention no real token ever
attends to a later one, so real tokens' logits, the loss and every gradient are those of the dynamic-shape
batch (tests/invariant/test_static_shapes.py, with negative controls).

Choosing a shape: :meth:`StaticShape.from_plan` reads a :class:`varpack.plan.PackPlan` (the tightest shape
that holds every pack of the plan); :meth:`StaticShape.for_packing` needs only ``packing_length`` and the most
samples a pack may hold (streaming, or plans not known in advance). The pad cost per step is
``tokens - real tokens`` (reported by ``benchmarks/train.py``); pad tokens cost what any token costs outside
attention, and attention over the pad is kept small by splitting the pad tokens evenly across the pad
segments.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from varpack.varlen.meta import LINEAR_CHUNK_SIZE, linear_chunk_count

__all__ = ["AUTO_MULTIPLE_RANGE", "StaticShape", "auto_multiple_of"]

_INT32_MAX = int(np.iinfo(np.int32).max)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"StaticShape.{name} must be a positive int, got {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise TypeError(
            f"StaticShape.{name} must be a positive int, got {type(value).__name__} {value!r}"
        ) from None
    if out < 1:
        raise ValueError(f"StaticShape.{name} must be >= 1, got {out}")
    return out


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


#: bounds of the automatic rounding of a static row's token count (:func:`auto_multiple_of`)
AUTO_MULTIPLE_RANGE = (8, 64)


def auto_multiple_of(tokens: int) -> int:
    """The rounding of a static row's token count when ``multiple_of`` is not given: the largest power of two
    ``<= tokens / 16``, within :data:`AUTO_MULTIPLE_RANGE` (8 to 64). The rounding then adds less than 1/16 of
    the row in pad tokens at any packing length (400 random samples of 1-63 tokens in 128-token packs need 152
    tokens a row: rows of 152, where a fixed 64 made them 192 and padded 33% of all tokens instead of 16%), while
    rows of 1,024 tokens and more round to 64 as before, so the long packs of the measured CUDA-graph runs keep
    their shapes (benchmarks/RESULTS.md#sft-step: ``T = 8,320`` at packing
    length 8192) and plans of one packing length share few shapes (tests/collate/test_static.py).

    Raises:
        ValueError / TypeError: ``tokens`` not a positive int.
    """
    tokens = _positive_int(tokens, "tokens")
    low, high = AUTO_MULTIPLE_RANGE
    multiple = low
    while multiple * 2 <= min(high, tokens // 16):
        multiple *= 2
    return multiple


@dataclass(frozen=True)
class StaticShape:
    """The fixed shape of every packed row: ``tokens`` (``T``), ``segments`` (``N``: ``cu_seqlens`` has
    ``N + 1`` entries) and the ``max_seqlen`` bucket (module docstring).

    Args:
        tokens: tokens of every row (``T_static``); ``input_ids`` etc. are ``[1, tokens]``.
        segments: segments of every row (``N_static``): real samples plus pad segments. A row of ``n`` samples
            and ``t`` tokens gets ``segments - n`` pad segments sharing ``tokens - t`` pad tokens, at least one
            token each (unless ``empty_pads``), so it needs ``n <= segments`` and ``tokens - t >= segments - n``
            (any ``t <= tokens`` with ``empty_pads``), and ``n < segments`` when ``t < tokens``.
        max_seqlen: the fixed ``max_seqlen`` (``max_length_q/k``) of every row, a bound of every segment.
        linear_chunks: a bound of the 64-token chunks (:data:`varpack.varlen.LINEAR_CHUNK_SIZE`) of every row
            whose pad segments are merged into one sequence, the layout the linear-attention layers run on
            (:class:`varpack.varlen.VarlenMeta`'s ``cu_seqlens_linear``): the fixed row count of the gated
            delta rule's chunk tables on the device. ``None`` (default): those tables take the bound of any
            row of ``tokens`` and ``segments`` (:func:`varpack.ops._fla.max_chunks`).
            :meth:`from_plan` sets it to the plan's largest row.
        empty_pads: pad segments may be zero-length (module docstring); ``False`` (default): at least one token
            each.

    Raises:
        TypeError: a value that is not an integer. ValueError: a value below 1, ``segments`` or
            ``max_seqlen`` above ``tokens``, ``tokens`` beyond int32 offsets, or ``segments * max_seqlen <
            tokens`` (no row could be laid out).

    Example:
        >>> shape = StaticShape.for_packing(16, max_samples=3, multiple_of=8)
        >>> shape
        StaticShape(tokens=24, segments=4, max_seqlen=21, linear_chunks=None, empty_pads=False)
        >>> shape.pad_lengths([5, 7]).tolist()  # 12 real tokens, 2 samples -> 2 pad segments of 12 tokens
        [6, 6]
    """

    tokens: int
    segments: int
    max_seqlen: int
    linear_chunks: int | None = None
    empty_pads: bool = False

    def __post_init__(self) -> None:
        tokens = _positive_int(self.tokens, "tokens")
        segments = _positive_int(self.segments, "segments")
        max_seqlen = _positive_int(self.max_seqlen, "max_seqlen")
        if tokens > _INT32_MAX:
            raise ValueError(f"StaticShape.tokens={tokens} is more than int32 cu_seqlens can index")
        if segments > tokens and not self.empty_pads:
            raise ValueError(
                f"StaticShape.segments={segments} > tokens={tokens}: every segment holds at least one token"
            )
        if max_seqlen > tokens:
            raise ValueError(f"StaticShape.max_seqlen={max_seqlen} > tokens={tokens}")
        if segments * max_seqlen < tokens:
            raise ValueError(
                f"StaticShape(tokens={tokens}, segments={segments}, max_seqlen={max_seqlen}): {segments} "
                f"segments of at most {max_seqlen} tokens cannot hold {tokens} tokens"
            )
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "segments", segments)
        object.__setattr__(self, "max_seqlen", max_seqlen)
        if self.linear_chunks is not None:
            object.__setattr__(self, "linear_chunks", _positive_int(self.linear_chunks, "linear_chunks"))
        if not isinstance(self.empty_pads, (bool, np.bool_)):
            raise TypeError(f"StaticShape.empty_pads must be a bool, got {self.empty_pads!r}")
        object.__setattr__(self, "empty_pads", bool(self.empty_pads))

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def for_packing(
        cls,
        packing_length: int,
        max_samples: int,
        *,
        multiple_of: int | None = None,
        max_seqlen: int | None = None,
        empty_pads: bool = False,
    ) -> StaticShape:
        """The shape that holds every pack of at most ``packing_length`` tokens and ``max_samples`` samples.

        ``segments = max_samples + 1`` (a full pack keeps one pad segment), ``tokens = packing_length +
        max_samples`` rounded up to ``multiple_of`` (default: :func:`auto_multiple_of` of that count) (a pack of
        one ``packing_length``-token sample still has a token for each of its ``max_samples`` pad segments),
        ``max_seqlen = tokens - max_samples`` (at least
        ``packing_length``: a pack of ``max_samples`` one-token samples puts all its pad tokens in its one pad
        segment) unless given. With ``empty_pads``: ``tokens = packing_length`` rounded up and ``max_seqlen =
        max(packing_length, tokens - max_samples)`` (pad segments need no token).

        Raises:
            ValueError / TypeError: non-positive or non-integer arguments; a given ``max_seqlen`` that some
                pack within the bounds could exceed.
        """
        packing_length = _positive_int(packing_length, "packing_length")
        max_samples = _positive_int(max_samples, "max_samples")
        need = packing_length + (0 if empty_pads else max_samples)
        if multiple_of is None:
            multiple_of = auto_multiple_of(need)
        multiple_of = _positive_int(multiple_of, "multiple_of")
        tokens = _round_up(need, multiple_of)
        # a pack of one packing_length sample, or n one-token samples leaving tokens - n pad tokens
        need = max(packing_length, tokens - max_samples)
        if max_seqlen is None:
            max_seqlen = need
        elif _positive_int(max_seqlen, "max_seqlen") < need:
            raise ValueError(
                f"max_seqlen={max_seqlen} is below {need}: a pack of one {packing_length}-token sample, or of "
                f"{max_samples} one-token samples with {tokens - max_samples} pad tokens in one pad segment, has "
                f"a segment of {need} tokens"
            )
        return cls(tokens=tokens, segments=max_samples + 1, max_seqlen=max_seqlen, empty_pads=empty_pads)

    @classmethod
    def from_plan(
        cls, plan: Any, *, multiple_of: int | None = None, segments: int | None = None, empty_pads: bool = False
    ) -> StaticShape:
        """The tightest shape that holds every pack of ``plan`` (a :class:`varpack.plan.PackPlan`, read for
        its CSR ``offsets`` ``[P+1]`` and ``item_lengths`` ``[I]``).

        ``segments``: the most samples of a pack plus one (default), or a given bucket. ``tokens``: the fewest
        that give every pack at least one token per pad segment (``max over packs of its tokens + its pad
        segments``), rounded up to ``multiple_of`` (default: :func:`auto_multiple_of` of that count: less than
        1/16 of the row, 64 from 1,024 tokens on); with ``empty_pads`` the longest pack alone, rounded (pad segments
        need no token). ``max_seqlen``: the longest segment of any pack laid out with
        these, its pad segments included. ``linear_chunks``: the most 64-token chunks of any pack with its pad
        tokens as one sequence.

        Raises:
            ValueError: an empty plan, or a given ``segments`` smaller than a pack's sample count (naming the
                pack) or equal to it where that pack would need pad tokens.
        """
        offsets = np.asarray(plan.offsets, dtype=np.int64)
        lengths = np.asarray(plan.item_lengths, dtype=np.int64)
        if multiple_of is not None:
            multiple_of = _positive_int(multiple_of, "multiple_of")
        if offsets.size < 2:
            raise ValueError("StaticShape.from_plan: the plan has no packs")
        counts = np.diff(offsets)
        cumulative = np.concatenate([[0], np.cumsum(lengths)])
        totals = cumulative[offsets[1:]] - cumulative[offsets[:-1]]
        segments = int(counts.max()) + 1 if segments is None else _positive_int(segments, "segments")
        pads = segments - counts
        if (pads < 0).any():
            p = int(np.flatnonzero(pads < 0)[0])
            raise ValueError(f"pack {p} holds {int(counts[p])} samples, more than segments={segments}")
        need = int(totals.max() if empty_pads else (totals + pads).max())
        tokens = _round_up(need, auto_multiple_of(need) if multiple_of is None else multiple_of)
        short = (pads == 0) & (totals < tokens)
        if short.any():
            p = int(np.flatnonzero(short)[0])
            raise ValueError(
                f"pack {p} holds {int(counts[p])} samples = segments, so its {tokens - int(totals[p])} pad tokens "
                f"have no pad segment; use segments > {int(counts.max())}"
            )
        pad_tokens = tokens - totals
        longest_pad = int((-(-pad_tokens // np.maximum(pads, 1))).max()) if pad_tokens.any() else 0
        longest = max(int(lengths.max()) if lengths.size else 1, longest_pad, 1)
        C = LINEAR_CHUNK_SIZE
        per_item = np.concatenate([[0], np.cumsum((lengths + C - 1) // C)])
        chunks = per_item[offsets[1:]] - per_item[offsets[:-1]] + (pad_tokens + C - 1) // C
        return cls(
            tokens=tokens, segments=segments, max_seqlen=min(longest, tokens), linear_chunks=max(int(chunks.max()), 1),
            empty_pads=empty_pads,
        )  # fmt: skip

    # -- cost ---------------------------------------------------------------------------------------------
    def pad_fraction(self, plan: Any) -> float:
        """Pad tokens / tokens run when every pack of ``plan`` (a :class:`varpack.plan.PackPlan`, read for its
        ``item_lengths`` and pack count) is one row of this shape: ``1 - real tokens / (packs * tokens)``.
        Throughput counts the real tokens only; this is what the fixed shape costs on top."""
        packs = int(np.asarray(plan.offsets).size) - 1
        if packs < 1:
            raise ValueError("StaticShape.pad_fraction: the plan has no packs")
        real = int(np.asarray(plan.item_lengths, dtype=np.int64).sum())
        return 1.0 - real / (packs * self.tokens)

    def describe(self, pad: float | None = None) -> str:
        """``"T=8320 N=92 max_seqlen=1672"`` (what ``varpack sft``'s ``speed`` line shows; with ``empty_pads``
        ``"T=8192 N=92 max_seqlen=1672, pad segments may be empty"``), followed by ``" (pad 0.6%)"`` when
        ``pad`` (a fraction, :meth:`pad_fraction`) is given."""
        text = f"T={self.tokens} N={self.segments} max_seqlen={self.max_seqlen}" + (
            ", pad segments may be empty" if self.empty_pads else ""
        )
        return text if pad is None else f"{text} (pad {100 * pad:.1f}%)"

    # -- layout -------------------------------------------------------------------------------------------
    def check_linear_chunks(self, lengths: Any) -> None:
        """Raise ``ValueError`` when a row of samples ``lengths`` (``[n]``), its pad tokens as one sequence,
        holds more 64-token chunks than ``linear_chunks`` (a row not from the plan the shape was sized on);
        nothing to check without ``linear_chunks``."""
        if self.linear_chunks is None:
            return
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        pad = self.tokens - int(lengths.sum())
        chunks = linear_chunk_count(np.append(lengths, max(pad, 0)))
        if chunks > self.linear_chunks:
            raise ValueError(
                f"a row of {lengths.size} samples and {int(lengths.sum())} tokens does not fit {self}: with its "
                f"pad tokens as one sequence it holds {chunks} chunks of {LINEAR_CHUNK_SIZE} tokens, more than "
                f"linear_chunks={self.linear_chunks} (StaticShape.from_plan sizes it for the plan's packs)"
            )

    def pad_lengths(self, lengths: Any) -> np.ndarray:
        """The pad segments of a row whose real segments have ``lengths`` (``[n]`` positive ints).

        The ``tokens - sum(lengths)`` pad tokens are split as evenly as possible over ``segments - n`` pad
        segments (the larger ones first), which keeps attention over the pad (quadratic in a segment's length)
        small.

        Returns:
            int64 ``[segments - n]``, every entry ``>= 1`` (empty when the row is exactly full); with
            ``empty_pads`` entries may be 0 (all of them when the samples fill ``tokens``).

        Raises:
            ValueError: more samples than ``segments``, more tokens than ``tokens``, a sample longer than
                ``max_seqlen`` (naming its index), fewer pad tokens than pad segments (unless ``empty_pads``),
                pad tokens with no pad segment left, or a pad segment that would exceed ``max_seqlen``.
        """
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        n, total = int(lengths.size), int(lengths.sum())
        where = f"a row of {n} samples and {total} tokens"
        if n > self.segments:
            raise ValueError(f"{where} does not fit {self}: more samples than segments={self.segments}")
        if total > self.tokens:
            raise ValueError(f"{where} does not fit {self}: more tokens than tokens={self.tokens}")
        if n and int(lengths.max()) > self.max_seqlen:
            i = int(np.argmax(lengths))
            raise ValueError(
                f"{where} does not fit {self}: sample #{i} has {int(lengths[i])} tokens, more than "
                f"max_seqlen={self.max_seqlen}"
            )
        pad, k = self.tokens - total, self.segments - n
        if pad == 0 and self.empty_pads:
            return np.zeros(k, dtype=np.int64)
        if pad == 0:
            if k:
                raise ValueError(
                    f"{where} fills tokens={self.tokens} exactly but needs {k} more segments, and segments are "
                    "never empty; raise tokens"
                )
            return np.zeros(0, dtype=np.int64)
        if k == 0:
            raise ValueError(
                f"{where} does not fit {self}: its {pad} pad tokens need a pad segment but all {self.segments} "
                "segments hold samples; raise segments"
            )
        if pad < k and not self.empty_pads:
            raise ValueError(
                f"{where} does not fit {self}: {k} pad segments of at least one token need {k} pad tokens, "
                f"only {pad} are left; raise tokens (StaticShape.for_packing / from_plan size it)"
            )
        base, extra = divmod(pad, k)
        if base + (extra > 0) > self.max_seqlen:
            raise ValueError(
                f"{where} does not fit {self}: its {pad} pad tokens over {k} pad segments make a segment of "
                f"{base + (extra > 0)} tokens, more than max_seqlen={self.max_seqlen}"
            )
        out = np.full(k, base, dtype=np.int64)
        out[:extra] += 1
        return out
