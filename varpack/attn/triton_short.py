"""``triton_short`` backend: a Triton varlen attention whose tiles span several documents.

Every varlen kernel of flash-attn's design schedules at least one query tile per document, so a row of short
documents (the median SFT sample is ~150 tokens) leaves most of each tile empty. Here a query tile of
``BLOCK_M`` tokens and the key tiles it visits run over the packed row irrespective of document boundaries;
the block-diagonal (causal / window) mask is applied inside the tile from per-token document ids, so one
128-token tile serves four 32-token documents. A query tile visits only the keys its documents can see: the
per-tile key range (and, for the backward, the per-key-tile query range) is computed on the device from
``cu_seqlens`` once per batch and kept on the batch's :class:`varpack.varlen.VarlenMeta` (``meta.memo``);
nothing is read on the host (no sync per layer). Tiles that lie wholly inside one document's visible band (the
off-diagonal tiles of a long document) skip the per-element mask, as FlashAttention-2's and Triton's
fused-attention tutorial's off-diagonal blocks do: the per-tile mask-free runs come from the same tables
(:meth:`TritonShortTables.query_tiles_full`, :meth:`TritonShortTables.key_tiles_full`), switchable with
:attr:`TritonShortConfig.mask_free`.

Semantics are :func:`varpack.attn.varlen_attention`'s (flash-attn's ``flash_attn_varlen_func``): GQA / MQA
(``H % Hkv == 0``), causal and non-causal with the bottom-right alignment when a document has different query
and key lengths, sliding window (two comparisons per score in the tile mask), zero-length documents, any
``softmax_scale``; a query that sees no key outputs 0 with ``lse = +inf``. Softcap is refused (the backward
would need the tanh derivative; not written). fp16 / bf16 / fp32 (fp32 matmuls in IEEE fp32, not TF32); head
dims up to 256 (padded to a power of two >= 16 inside the kernel).

Forward and backward are Triton kernels (:mod:`varpack.attn._triton_short_kernels`: FlashAttention-2's online
softmax forward storing ``lse`` ``[H, Tq]`` fp32; backward with ``delta = rowsum(dO * O)``, computed by the dQ
kernel on the way (:attr:`TritonShortConfig.delta_in_dq`), then one dK/dV kernel per key tile and KV head that
loops over its GQA group), wrapped in a ``torch.autograd.Function`` (:func:`triton_short_attention`).

Devices: CUDA; on the CPU only under Triton's interpreter (``TRITON_INTERPRET=1`` set before ``import triton``:
Triton decides then, for the whole process), which is how the tests run it (small shapes: NumPy speed). ``auto`` puts it first for the shape classes of
:data:`varpack.attn.registry.AUTO_TRITON_SHORT`, the rows where benchmarks/attention.py and benchmarks/train.py
measured it fastest on the H200 beside FA4 / torch_varlen / flex (benchmarks/RESULTS.md).

Sources: FlashAttention-2 (Dao, 2023, arXiv:2307.08691); Triton's fused-attention tutorial
(triton-lang/triton, python/tutorials/06-fused-attention.py); the document-mask idea of FlexAttention's
document masking (PyTorch blog, 2024), here with tiles that cross documents instead of a block mask.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import json
import operator
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .._triton import import_kernels, triton_interpreted
from ._base import Backend, BackendUnavailableError, Capabilities

if TYPE_CHECKING:
    from varpack.varlen.meta import VarlenMeta

__all__ = [
    "BLOCKS",
    "CONFIG_ENV",
    "PACK_GQA_MIN_GROUP",
    "PACK_GQA_SHORT_MEAN",
    "BLOCKS_UNPACKED",
    "MAXNREG",
    "TritonShortBackend",
    "TritonShortConfig",
    "TritonShortTables",
    "active_config",
    "triton_short_attention",
]

_LOG2E = 1.4426950408889634
_BIG = 2**31 - 1  # tile-range sentinel: an empty range is [_BIG, 0)

#: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the forward, the dK/dV and the dQ kernels by head-dim
#: bucket (the first bucket >= D). Placeholders until the H200 measurements of benchmarks/attention_tune.py
#: tune them; a run can override them without editing code (:class:`TritonShortConfig`,
#: :data:`CONFIG_ENV`).
#: D = 128: the overall pick of benchmarks/attention_tune.py on the H200 (2026-12-01; short, real-length and
#: uniform-2048 mixes, T = 65,536, H = 16/4, bf16): forward 1.06-1.14x and dQ 1.00-1.08x the earlier
#: (64, 64, 4, 2) / (64, 32, 4, 1), errors vs torch_varlen unchanged. D = 64 / 256: not tuned yet.
#: With delta in the dQ kernel (``delta_in_dq``; benchmarks/RESULTS.md#attention): with PackGQA (every
#: kernel at 16/4, and at 16/8 on short documents) dK/dV (32, 64, 4, 3) and dQ (64, 16, 4, 3), measured in one
#: bake-off beside the earlier (32, 64, 4, 1) / (64, 32, 4, 2): 2.15 vs 2.43 ms fwd+bwd on the real-lengths mix and
#: 1.18 vs 1.29 ms on the short mix (16/4); unpacked kernels keep those earlier ones (:data:`BLOCKS_UNPACKED`).
BLOCKS: dict[str, dict[int, tuple[int, int, int, int]]] = {
    "fwd": {64: (64, 64, 4, 2), 128: (64, 32, 4, 2), 256: (64, 32, 8, 1)},
    "bwd_dkdv": {64: (32, 64, 4, 1), 128: (32, 64, 4, 3), 256: (16, 32, 8, 1)},
    "bwd_dq": {64: (64, 32, 4, 1), 128: (64, 16, 4, 3), 256: (32, 16, 8, 1)},
}
#: Entries that replace :data:`BLOCKS` (same head-dim buckets) where a kernel runs without PackGQA
#: (:attr:`TritonShortConfig.pack_gqa` off, or by default a group below :data:`PACK_GQA_MIN_GROUP` on documents of
#: mean length above :data:`PACK_GQA_SHORT_MEAN`): the PackGQA picks lose there. Measured on the H200 (benchmarks/attention.py
#: --ts-variant, 16/8, real-lengths mix, unpacked, one bake-off): dK/dV (32, 64, 4, 1) + dQ (64, 32, 4, 2) 2.45 ms
#: fwd+bwd; with the PackGQA picks 3.42 ms, with their dQ only 2.55 ms. Kinds and buckets left out keep :data:`BLOCKS`.
BLOCKS_UNPACKED: dict[str, dict[int, tuple[int, int, int, int]]] = {
    "bwd_dkdv": {128: (32, 64, 4, 1)},
    "bwd_dq": {128: (64, 32, 4, 2)},
}
#: Default register caps per thread (:attr:`TritonShortConfig.maxnreg`) by kernel and head-dim bucket; kernels and
#: buckets left out are uncapped. D = 128 forward: 128. Uncapped it takes 187 registers (ptxas ``-v`` on the kernel
#: a launch compiles; benchmarks/triton_short_registers.py), so 2 of its 4-warp programs share an SM; at 128 (4-16
#: bytes of spills) 4 do, which the 48 KB of shared memory of (64, 32, 4, 2) allows. Measured on the H200
#: (benchmarks/RESULTS.md#attention; benchmarks/attention.py --ts-variant, same-run variants, T = 65,536, bf16): forward 0.518 vs 0.566 ms on the real-lengths
#: mix at 16/4, 0.621 vs 0.667 ms at 16/8. Caps of 168 on the forward or the dQ kernel changed nothing; 128 on the dQ
#: kernel and 168 on dK/dV (at 2 stages) were slower.
MAXNREG: dict[str, dict[int, int]] = {"fwd": {128: 128}}
_HEAD_DIM_BUCKETS = (64, 128, 256)  # the head-dim buckets of BLOCKS and MAXNREG
#: :attr:`TritonShortConfig.pack_gqa` ``None`` (the default) packs the query heads of a GQA group into one
#: program's tile from this group size ``G = H / Hkv`` on. Measured on the H200 (benchmarks/attention.py,
#: benchmarks/RESULTS.md#attention; T = 65,536, D = 128, bf16, fwd+bwd, ``BLOCKS``): at G = 4 (H = 16/4) packed 1.65 vs
#: 1.83 ms on the short mix and 2.76 vs 2.89 ms on the real-lengths mix; at G = 2 (16/8) 1.81 vs 1.86 ms short
#: but 2.85 vs 2.78 ms real (slower): so not below 4. G = 8: tested for exactness, not timed. Larger BLOCK_M
#: with packing was slower at G = 4 (1.88-2.34 ms short).
PACK_GQA_MIN_GROUP = 4
#: ... and at a smaller group (2, 3) when the call's documents are short: mean query-document length
#: (:attr:`TritonShortTables.mean_q`, tokens) at most this, the short-document class of
#: :data:`varpack.attn.registry.AUTO_PRIORITY_SHORT`. Measured on the H200 at G = 2 (16/8): packed 1.81 vs 1.86 ms
#: on the short mix (mean 74), 2.85 vs 2.78 ms (slower) on the real-lengths mix (mean 207); short mix at 16/8,
#: queued: 1.41 ms packed by this rule (2.10x torch_varlen in that run) vs 1.49 ms unpacked in another run (1.98x
#: its torch_varlen) (benchmarks/attention.py, benchmarks/RESULTS.md#attention). Means between 74 and 128 are not
#: measured separately.
PACK_GQA_SHORT_MEAN = 128.0
#: the three kernels whose launch configuration is chosen (keys of :data:`BLOCKS`)
KERNEL_KINDS: tuple[str, ...] = ("fwd", "bwd_dkdv", "bwd_dq")
#: environment variable read at every call (parsed once per distinct value): a JSON object overriding
#: :data:`BLOCKS` for every head dim, e.g. ``{"fwd": [128, 64, 8, 2], "bwd_dq": [128, 32, 4, 2]}``; each value
#: is ``[BLOCK_M, BLOCK_N, num_warps, num_stages]`` or ``{"BLOCK_M": .., "BLOCK_N": .., "num_warps": ..,
#: "num_stages": ..}``; kinds left out keep :data:`BLOCKS`. ``"mask_free": true / false`` sets
#: :attr:`TritonShortConfig.mask_free` (default true); ``"pack_gqa": true / false / null`` sets
#: :attr:`TritonShortConfig.pack_gqa` (default null: by group size); ``"delta_in_dq": true / false`` sets
#: :attr:`TritonShortConfig.delta_in_dq` (default true); ``"lpt": true / false`` sets :attr:`TritonShortConfig.lpt`
#: (default false); ``"maxnreg": {"fwd": 168, ..}`` sets :attr:`TritonShortConfig.maxnreg` (register caps per kernel);
#: ``"dp_first": true / false`` sets :attr:`TritonShortConfig.dp_first` (default true).
#: Empty or unset: no override.
CONFIG_ENV = "VARPACK_TRITON_SHORT_CONFIG"

_FIELDS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


def _checked_blocks(kind: str, value: Any) -> tuple[int, int, int, int]:
    """``value`` (4 ints, or a mapping of :data:`_FIELDS`) as a checked ``(BLOCK_M, BLOCK_N, warps, stages)``.

    Raises:
        ValueError: unknown kind, wrong shape, a value not an integer (``16.5``, ``true``), a block not a power
            of two >= 16 (``tl.dot``'s minimum), warps not in 1/2/4/8/16, stages < 1.
    """
    if kind not in KERNEL_KINDS:
        raise ValueError(f"triton_short config: unknown kernel {kind!r}; choose from {KERNEL_KINDS}")
    if isinstance(value, dict):
        unknown = set(value) - set(_FIELDS)
        if unknown or len(value) != 4:
            raise ValueError(
                f"triton_short config {kind}: need exactly the keys {_FIELDS}, got {sorted(value)}"
            )
        value = [value[f] for f in _FIELDS]
    try:  # integers only (int() would truncate 16.9 and read true as 1 silently)
        if any(isinstance(x, bool) for x in value):
            raise TypeError("a bool is not a block size")
        bm, bn, warps, stages = (operator.index(x) for x in value)
    except (TypeError, ValueError):
        raise ValueError(
            f"triton_short config {kind}: need [BLOCK_M, BLOCK_N, num_warps, num_stages] (integers), got {value!r}"
        ) from None
    for name, b in (("BLOCK_M", bm), ("BLOCK_N", bn)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"triton_short config {kind}: {name}={b} is not a power of two >= 16")
    if warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"triton_short config {kind}: num_warps={warps} not in 1, 2, 4, 8, 16")
    if stages < 1:
        raise ValueError(f"triton_short config {kind}: num_stages={stages} < 1")
    return bm, bn, warps, stages


def _checked_maxnreg(value: Any) -> tuple[tuple[str, int], ...]:
    """``value`` (``(kind, registers)`` pairs or a mapping) as sorted checked pairs.

    Raises:
        ValueError: unknown kind, a kind twice, a cap not an integer in 32..255.
    """
    pairs = list(value.items()) if isinstance(value, dict) else list(value)
    out: dict[str, int] = {}
    for pair in pairs:
        try:
            kind, n = pair
        except (TypeError, ValueError):
            raise ValueError(
                f"triton_short config maxnreg: need (kernel, registers) pairs, got {pair!r}"
            ) from None
        if kind not in KERNEL_KINDS:
            raise ValueError(
                f"triton_short config maxnreg: unknown kernel {kind!r}; choose from {KERNEL_KINDS}"
            )
        if kind in out:
            raise ValueError(f"triton_short config maxnreg: {kind} given twice")
        if isinstance(n, bool) or not isinstance(n, int) or not 32 <= n <= 255:
            raise ValueError(
                f"triton_short config maxnreg {kind}: need an integer in 32..255 registers, got {n!r}"
            )
        out[kind] = n
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class TritonShortConfig:
    """Launch configurations of the three kernels, overriding :data:`BLOCKS` for every head dim.

    Each kernel field is ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` or None (keep :data:`BLOCKS`). For
    ``bwd_dkdv``, ``BLOCK_N`` is the key tile a program owns and ``BLOCK_M`` the query tile it loops over; for
    ``fwd`` and ``bwd_dq`` the reverse. ``mask_free`` (all three kernels): tiles wholly inside one document's
    visible band skip the per-element mask (module docstring of :mod:`varpack.attn._triton_short_kernels`);
    False runs every tile masked (the same arithmetic: equal results; kept to measure the gain on the GPU).
    ``pack_gqa`` (all three kernels; FlashAttention-3's PackGQA): a program owns one KV head and its query
    tile's rows are the ``G = H / Hkv`` query heads of ``BLOCK_M / G`` tokens, so every K / V tile is loaded once
    per group instead of once per query head and a tile spans ``G`` times fewer tokens (fewer documents, less
    masked work on short documents); ``BLOCK_M`` counts rows either way. True / False force it; None (default)
    packs when ``G >= PACK_GQA_MIN_GROUP``, or at a smaller group when the call's mean document length
    (:attr:`TritonShortTables.mean_q`) is at most :data:`PACK_GQA_SHORT_MEAN`: where it measured faster. It runs only where ``G > 1``
    divides ``BLOCK_M`` (otherwise unpacked; forced True there: ValueError). The same sums in another order: results equal up to rounding.
    ``delta_in_dq`` (backward): the dQ kernel runs first and computes ``delta = rowsum(dO * O)`` of its own rows
    on the way, stored for the dK / dV kernel (default True), instead of a separate preprocessing pass over O and
    dO (False; kept to measure the gain on the GPU). The same products and fp32 row sums: results equal up to
    rounding. ``lpt`` (all three kernels): programs take their tiles longest first -- a 1-D grid over the tiles
    sorted by descending loop length (:meth:`TritonShortTables.tile_order`, built once per batch on the device),
    the longest-processing-time-first rule of list scheduling (Graham, 1969; FlashAttention-2/3 launch causal query
    tiles in reverse for the same reason) -- so a long document's heavy tiles do not start in the kernel's last
    wave. Default False (row order, the 2-D grid ``(tiles, heads)``): on the H200 (benchmarks/attention.py
    --ts-variant, 16/4, one bake-off) longest-first was slower, 1.40 vs 1.30 ms fwd+bwd on the short mix and 2.50 vs 2.44 ms on the
    real-lengths mix (neighbouring tiles of one document, launched together in row order, share their K / V
    loads; sorted, they scatter). Every tile computes the same thing either way: results are bitwise equal.
    ``maxnreg`` (per kernel, CUDA only): ``(kind, registers)`` pairs capping the registers per thread of that kernel
    (ptxas ``.maxnreg``; Triton's ``maxnreg`` launch option), e.g. ``(("fwd", 168),)``. Above 168 registers (uncapped
    at D = 128 the forward takes 187, dQ 149 and dK/dV 255) a 4-warp program leaves room for 2 per SM; a cap of 168
    lets 3 share an SM, 128 four (more latency hidden) at the price of spills to local memory -- a trade only a
    measurement decides. Kernels
    left out take :data:`MAXNREG`'s default cap (uncapped where it has no entry). The same instructions in another register
    allocation: results are bitwise equal. A kernel given its own launch config here gets no default cap.
    ``dp_first`` (backward kernels): each loop step issues the ``dP = dO V^T`` matmul right after the scores'
    matmul, before the softmax of the scores (default True), instead of after the ``dV`` update (False, the order of
    FlashAttention-2's algorithm 2 and of Triton's fused-attention tutorial, kept to measure). Measured on the H200
    (benchmarks/attention.py --rounds 3, benchmarks/RESULTS.md#attention; same run, 3 rotated rounds, T = 65,536, 16/4, real lengths): 2.081 vs
    2.094 ms fwd+bwd. The same operations on the same values: results are bitwise equal.
    Checked on construction (:func:`_checked_blocks`; ``mask_free``, ``delta_in_dq``,
    ``lpt`` and ``dp_first`` bools, ``pack_gqa`` a bool or None, ``maxnreg`` kinds of :data:`KERNEL_KINDS` with integers in
    32..255: ValueError).
    """

    fwd: tuple[int, int, int, int] | None = None
    bwd_dkdv: tuple[int, int, int, int] | None = None
    bwd_dq: tuple[int, int, int, int] | None = None
    mask_free: bool = True
    pack_gqa: bool | None = None
    delta_in_dq: bool = True
    lpt: bool = False
    maxnreg: tuple[tuple[str, int], ...] = ()
    dp_first: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "maxnreg", _checked_maxnreg(self.maxnreg))
        for kind in KERNEL_KINDS:
            value = getattr(self, kind)
            if value is not None:
                object.__setattr__(self, kind, _checked_blocks(kind, value))
        for flag in ("mask_free", "delta_in_dq", "lpt", "dp_first"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(
                    f"triton_short config: {flag} must be true or false, got {getattr(self, flag)!r}"
                )
        if self.pack_gqa is not None and not isinstance(self.pack_gqa, bool):
            raise ValueError(
                f"triton_short config: pack_gqa must be true, false or null (by group), got {self.pack_gqa!r}"
            )

    @classmethod
    def from_json(cls, text: str) -> TritonShortConfig:
        """From :data:`CONFIG_ENV`'s JSON format (empty text: no override).

        Raises:
            ValueError: not JSON, not an object, unknown kernel or a bad value.
        """
        if not text.strip():
            return cls()
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"triton_short config: {CONFIG_ENV} is not JSON ({exc}): {text!r}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"triton_short config: need a JSON object of kernels, got {text!r}")
        kwargs: dict[str, Any] = {}
        for kind, value in obj.items():
            if kind in ("mask_free", "pack_gqa", "delta_in_dq", "lpt", "dp_first"):
                kwargs[kind] = value  # checked by __post_init__ (a JSON bool)
            elif kind == "maxnreg":
                if not isinstance(value, dict):
                    raise ValueError(
                        f'triton_short config: maxnreg must be an object like {{"fwd": 168}}, got {value!r}'
                    )
                kwargs[kind] = tuple(value.items())
            elif kind in KERNEL_KINDS:
                kwargs[kind] = _checked_blocks(kind, value)
            else:
                raise ValueError(
                    f"triton_short config: unknown kernel {kind!r}; choose from {KERNEL_KINDS} (or mask_free, "
                    "pack_gqa, delta_in_dq, lpt, maxnreg, dp_first)"
                )
        return cls(**kwargs)

    def to_json(self) -> str:
        """The :data:`CONFIG_ENV` text of this config (kinds left None are omitted; the flags always in)."""
        obj: dict[str, Any] = {k: list(v) for k in KERNEL_KINDS if (v := getattr(self, k)) is not None}
        obj["mask_free"] = self.mask_free
        obj["pack_gqa"] = self.pack_gqa
        obj["delta_in_dq"] = self.delta_in_dq
        obj["lpt"] = self.lpt
        obj["dp_first"] = self.dp_first
        if self.maxnreg:
            obj["maxnreg"] = dict(self.maxnreg)
        return json.dumps(obj)

    def registers(self, kind: str, head_dim: int) -> int | None:
        """The register cap of kernel ``kind``: this config's own; else, where the kernel keeps its default launch
        config, :data:`MAXNREG`'s for the head-dim bucket of ``head_dim`` (64, 128, 256: the first one >=
        ``head_dim``). A kernel given its own launch config and no cap is uncapped (None): a default cap was
        measured with the default tile sizes only."""
        own = dict(self.maxnreg)
        if kind in own:
            return own[kind]
        if getattr(self, kind) is not None:
            return None
        bucket = next((b for b in _HEAD_DIM_BUCKETS if head_dim <= b), None)
        return MAXNREG.get(kind, {}).get(bucket)

    def blocks(self, kind: str, head_dim: int, packed: bool = True) -> tuple[int, int, int, int]:
        """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of kernel ``kind`` at head dim ``head_dim``: this config's
        own value, else :data:`BLOCKS` -- or, for a kernel that runs without PackGQA (``packed`` False),
        :data:`BLOCKS_UNPACKED` where it has the entry."""
        value = getattr(self, kind)
        if value is not None:
            if head_dim > 256:
                raise ValueError(f"triton_short: head dim D={head_dim} > 256")
            return value
        return _blocks(kind, head_dim, packed)


@functools.lru_cache(maxsize=8)
def _env_config(text: str) -> TritonShortConfig:
    try:
        return TritonShortConfig.from_json(text)
    except ValueError as exc:  # name the variable the user set, whichever field is wrong
        if CONFIG_ENV in str(exc):
            raise
        raise ValueError(f"{CONFIG_ENV}={text!r}: {exc}") from None


def active_config(config: TritonShortConfig | None = None) -> TritonShortConfig:
    """``config`` if given, else the :data:`CONFIG_ENV` override (an empty config when unset).

    Raises:
        ValueError: a malformed :data:`CONFIG_ENV` (never ignored silently).
    """
    if config is not None:
        return config
    return _env_config(os.environ.get(CONFIG_ENV, ""))


def _blocks(kind: str, head_dim: int, packed: bool = True) -> tuple[int, int, int, int]:
    table = BLOCKS[kind]
    for bound in sorted(table):
        if head_dim <= bound:
            if not packed:
                return BLOCKS_UNPACKED.get(kind, {}).get(bound, table[bound])
            return table[bound]
    raise ValueError(f"triton_short: head dim D={head_dim} > {max(table)}")


def _triton_interpreted() -> bool:
    """Whether Triton runs interpreted in this process (:func:`varpack._triton.triton_interpreted`)."""
    return triton_interpreted()


def _kernels():
    """The kernel module in Triton's mode: compiled kernels for a GPU, or interpreted ones (NumPy, CPU
    tensors) when Triton itself was imported with ``TRITON_INTERPRET=1`` (:func:`varpack._triton.import_kernels`)."""
    return import_kernels("varpack.attn._triton_short_kernels")


def _platform_reason(device_type: str) -> str | None:
    """Why this process cannot run the kernels on ``device_type`` (None: it can)."""
    interpreted = _triton_interpreted()
    if device_type == "cpu" and not interpreted:
        return (
            "runs on the CPU only under Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported: "
            "a test path, NumPy speed)"
        )
    if device_type == "cuda" and interpreted:
        return "Triton runs interpreted in this process (TRITON_INTERPRET=1 when triton was imported)"
    return None


# -- per-batch tables --------------------------------------------------------------------------------------


@dataclass
class TritonShortTables:
    """Per-token and per-tile tables of one batch and mask, on one device (built by :meth:`build`).

    Attributes:
        doc_q: ``[Tq]`` int32 document of every query token; doc_k: ``[Tk]`` of every key token.
        lim: ``[Tq]`` int32 key-stream position of each query's diagonal ``i + end_k[d] - end_q[d]``
            (bottom-right alignment; ``i`` in self-attention).
        key_lo, key_hi: ``[Tq]`` int64 visible key range ``[key_lo, key_hi)`` of every query (empty: ``[BIG, 0)``);
            every key of it is visible (one document, inside the band), which the mask-free tiles rely on.
        query_lo, query_hi: ``[Tk]`` int64 range of the queries that see each key (the same, transposed).

    Per-tile tables (cached per tile size, device ops only): :meth:`query_tiles` / :meth:`key_tiles` (the
    union range a tile visits), :meth:`query_tiles_shared` / :meth:`key_tiles_shared` (the range every row of
    the tile sees) and :meth:`query_tiles_full` / :meth:`key_tiles_full` (the mask-free run of loop tiles);
    :meth:`launch_tables`: what one kernel launch reads.

    ``fused`` (where the kernels run: CUDA, or the CPU under Triton's interpreter): the per-token tables come
    from one Triton launch (``build_token_tables``) and each kernel's tile tables from one more
    (``build_tile_tables``), the same integers as the PyTorch ops of the unfused path (about 40 ops per build
    and 25 per tile size: on the custom-op path, where no batch meta reaches the call, every layer's forward and
    backward rebuilt them, thousands of small kernels per step).
    """

    doc_q: torch.Tensor
    doc_k: torch.Tensor
    lim: torch.Tensor
    key_lo: torch.Tensor
    key_hi: torch.Tensor
    query_lo: torch.Tensor
    query_hi: torch.Tensor
    _tiles: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    _full_tiles: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    #: :meth:`tile_order`'s permutations by (side, tile size); not an init field: a copy (``dataclasses.replace``)
    #: starts without them
    _orders: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    fused: bool = field(default=False, repr=False)
    #: mean query-document length ``Tq / N`` (a Python float from shapes: no host read; None if unknown), for
    #: :attr:`TritonShortConfig.pack_gqa`'s default at a group of 2 or 3 (:data:`PACK_GQA_SHORT_MEAN`)
    mean_q: float | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        total_q: int,
        total_k: int,
        *,
        causal: bool,
        window_size: tuple[int, int],
        doc_q: torch.Tensor | None = None,
        doc_k: torch.Tensor | None = None,
        fused: bool | None = None,
    ) -> TritonShortTables:
        """From the ``[N+1]`` offsets on the kernel's device (device ops only: values never read on the host).

        ``doc_q`` / ``doc_k`` may pass the streams' ``seq_idx`` when they already exist (the batch meta's);
        otherwise they are built by :class:`varpack.varlen.VarlenMeta` (varpack's one ``seq_idx`` builder), or
        by the fused launch's binary search of the offsets (the same ``searchsorted(cu[1:], i, right=True)``).
        ``fused``: one Triton launch (class docstring); default where this process runs the kernels on the
        offsets' device, else the PyTorch ops.
        """
        device = cu_seqlens_q.device
        if fused is None:
            fused = _platform_reason(device.type) is None
        mean_q = total_q / max(int(cu_seqlens_q.numel()) - 1, 1)
        if fused:
            return cls._build_fused(
                cu_seqlens_q, cu_seqlens_k, total_q, total_k, causal, window_size, doc_q, mean_q
            )
        cu_q = cu_seqlens_q.to(torch.int64)
        cu_k = cu_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.to(torch.int64)
        pos_q = torch.arange(total_q, device=device, dtype=torch.int64)
        pos_k = torch.arange(total_k, device=device, dtype=torch.int64)
        if doc_q is None:
            doc_q = _seq_idx(cu_seqlens_q, total_q)
        doc_q = doc_q.reshape(-1).to(torch.int64)
        if doc_k is None:
            same = cu_seqlens_k is cu_seqlens_q and total_k == total_q
            doc_k = doc_q if same else _seq_idx(cu_seqlens_k, total_k)
        doc_k = doc_k.reshape(-1).to(torch.int64)
        shift = cu_k[1:] - cu_q[1:]  # [N]: key position of a query's diagonal = its position + shift
        lim = pos_q + shift[doc_q] if total_q else pos_q
        left, right = int(window_size[0]), 0 if causal else int(window_size[1])
        key_lo, key_hi = cu_k[doc_q], cu_k[doc_q + 1]
        if left >= 0:
            key_lo = torch.maximum(key_lo, lim - left)
        if right >= 0:
            key_hi = torch.minimum(key_hi, lim + right + 1)
        query_lo, query_hi = cu_q[doc_k], cu_q[doc_k + 1]
        if total_k:
            shift_k = shift[doc_k]
            if right >= 0:
                query_lo = torch.maximum(query_lo, pos_k - right - shift_k)
            if left >= 0:
                query_hi = torch.minimum(query_hi, pos_k + left - shift_k + 1)
        key_lo, key_hi = _empty_as_sentinel(key_lo, key_hi)
        query_lo, query_hi = _empty_as_sentinel(query_lo, query_hi)
        return cls(
            doc_q=doc_q.to(torch.int32).contiguous(),
            doc_k=doc_k.to(torch.int32).contiguous(),
            lim=lim.to(torch.int32).contiguous(),
            key_lo=key_lo,
            key_hi=key_hi,
            query_lo=query_lo,
            query_hi=query_hi,
            mean_q=mean_q,
        )

    @classmethod
    def _build_fused(cls, cu_seqlens_q, cu_seqlens_k, total_q, total_k, causal, window_size, doc_q, mean_q):
        kern = _kernels()
        device = cu_seqlens_q.device
        cu_q = cu_seqlens_q.to(torch.int32).contiguous()
        cu_k = cu_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.to(torch.int32).contiguous()
        same = cu_seqlens_k is cu_seqlens_q and total_k == total_q
        n = cu_q.numel() - 1
        left, right = int(window_size[0]), 0 if causal else int(window_size[1])
        i32, i64 = dict(device=device, dtype=torch.int32), dict(device=device, dtype=torch.int64)
        out = cls(
            doc_q=torch.empty(total_q, **i32),
            doc_k=torch.empty(total_k, **i32),
            lim=torch.empty(total_q, **i32),
            key_lo=torch.empty(total_q, **i64),
            key_hi=torch.empty(total_q, **i64),
            query_lo=torch.empty(total_k, **i64),
            query_hi=torch.empty(total_k, **i64),
            fused=True,
            mean_q=mean_q,
        )
        given = doc_q is not None and doc_q.numel() == total_q
        block = 64 if kern.INTERPRETED else 1024
        kern.build_token_tables[(triton_cdiv(max(total_q, total_k, 1), block),)](
            cu_q, cu_k, doc_q.reshape(-1) if given else cu_q, out.doc_q, out.lim, out.key_lo, out.key_hi,
            out.doc_k, out.query_lo, out.query_hi, n, total_q, total_k, max(left, 0), max(right, 0),
            HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, GIVEN_DOC=given, SELF=same,
            STEPS=max(n, 1).bit_length(), BLOCK=block,
        )  # fmt: skip
        return out

    def launch_tables(
        self, side: str, block: int, step: int, mask_free: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(lo, hi, full_lo, full_hi)`` int32 ``[tiles]`` of one kernel launch: ``side="q"`` for the forward /
        dQ kernels (query tiles of ``block`` tokens, key loop step ``step``), ``"k"`` for dK/dV (key tiles,
        query loop step). Without ``mask_free`` the full run is not read: ``(lo, hi, lo, hi)``. Fused tables
        compute all four in one launch (``build_tile_tables``; a power-of-two ``block``), else
        :meth:`query_tiles` / :meth:`query_tiles_full` (or the key ones)."""
        if side not in ("q", "k"):
            raise ValueError(f"side must be 'q' or 'k', got {side!r}")
        if self.fused and block & (block - 1) == 0:
            key = (side + "_launch", block, step)
            if key not in self._full_tiles:
                src_lo, src_hi = (self.key_lo, self.key_hi) if side == "q" else (self.query_lo, self.query_hi)
                total = src_lo.shape[0]
                tiles = triton_cdiv(total, block)
                lo, hi, full_lo, full_hi = (
                    torch.empty(tiles, device=src_lo.device, dtype=torch.int32) for _ in range(4)
                )
                if tiles:
                    _kernels().build_tile_tables[(tiles,)](
                        src_lo, src_hi, lo, hi, full_lo, full_hi, total, step, TILE=block
                    )
                self._tiles.setdefault((side, block), (lo, hi))
                self._full_tiles[key] = (full_lo, full_hi)
            lo, hi = self._tiles[(side, block)]
            full_lo, full_hi = self._full_tiles[key]
        else:
            tiles, full = (
                (self.query_tiles, self.query_tiles_full)
                if side == "q"
                else (self.key_tiles, self.key_tiles_full)
            )
            lo, hi = tiles(block)
            full_lo, full_hi = full(block, step) if mask_free else (lo, hi)
        return (lo, hi, full_lo, full_hi) if mask_free else (lo, hi, lo, hi)

    def tile_order(self, side: str, block: int) -> torch.Tensor:
        """``[tiles]`` int32 permutation of the tiles of ``block`` rows (``side="q"``: query tiles, their key
        ranges; ``"k"``: key tiles, their query ranges), longest loop first: sorted by descending ``hi - lo`` of
        :meth:`query_tiles` / :meth:`key_tiles` (a tile's loop runs ``ceil((hi - lo) / step)`` iterations, the same
        order at every step), ties in row order (a stable sort: the same order on every call); tiles that see
        nothing (the ``[BIG, 0)`` sentinel) last. Read by the kernels under :attr:`TritonShortConfig.lpt`;
        cached; device ops only (no host read)."""
        if side not in ("q", "k"):
            raise ValueError(f"side must be 'q' or 'k', got {side!r}")
        key = (side, block)
        if key not in self._orders:
            tiles = self.query_tiles if side == "q" else self.key_tiles
            lo, hi = self._tiles.get(key) or tiles(block)
            work = hi.to(torch.int64) - lo.to(torch.int64)
            self._orders[key] = torch.argsort(work, descending=True, stable=True).to(torch.int32).contiguous()
        return self._orders[key]

    def query_tiles(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[cdiv(Tq, block_m)]`` int32 key range ``[lo, hi)`` of every query tile (union of its queries')."""
        return self._tile("q", block_m, self.key_lo, self.key_hi)

    def key_tiles(self, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[cdiv(Tk, block_n)]`` int32 query range of every key tile (the queries that see any of its keys)."""
        return self._tile("k", block_n, self.query_lo, self.query_hi)

    def query_tiles_shared(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[cdiv(Tq, block_m)]`` int64 key range ``[max key_lo, min key_hi)`` that every query of each tile
        sees (intersection; padded rows past ``Tq`` left out). Empty -- queries of two documents, or a query
        that sees nothing -- as the sentinel ``[BIG, 0)``."""
        return self._shared("q", block_m, self.key_lo, self.key_hi)

    def key_tiles_shared(self, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[cdiv(Tk, block_n)]`` int64 query range that sees every key of each key tile (as
        :meth:`query_tiles_shared`)."""
        return self._shared("k", block_n, self.query_lo, self.query_hi)

    def query_tiles_full(self, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[cdiv(Tq, block_m)]`` int32 ``[full_lo, full_hi)``: the key tiles of the forward / dQ loop (grid
        ``lo + k * block_n`` from :meth:`query_tiles`) that lie wholly inside :meth:`query_tiles_shared`, so
        skip the mask. No such tile: ``full_lo = full_hi = hi`` (the whole loop masked)."""
        return self._full("q", block_m, block_n, self.query_tiles, self.query_tiles_shared)

    def key_tiles_full(self, block_n: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[cdiv(Tk, block_n)]`` int32 mask-free run of query tiles (grid ``lo + k * block_m``) of every key
        tile in the dK / dV loop (as :meth:`query_tiles_full`)."""
        return self._full("k", block_n, block_m, self.key_tiles, self.key_tiles_shared)

    def _tile(self, side: str, block: int, lo: torch.Tensor, hi: torch.Tensor):
        key = (side, block)
        if key not in self._tiles:
            pad = -lo.shape[0] % block
            lo_p = torch.nn.functional.pad(lo, (0, pad), value=_BIG).view(-1, block).amin(1)
            hi_p = torch.nn.functional.pad(hi, (0, pad), value=0).view(-1, block).amax(1)
            self._tiles[key] = (lo_p.to(torch.int32).contiguous(), hi_p.to(torch.int32).contiguous())
        return self._tiles[key]

    def _shared(self, side: str, block: int, lo: torch.Tensor, hi: torch.Tensor):
        key = (side + "_shared", block)
        if key not in self._full_tiles:
            pad = -lo.shape[0] % block  # padded rows neutral: lo 0 for the max, hi BIG for the min
            lo_p = torch.nn.functional.pad(lo, (0, pad), value=0).view(-1, block).amax(1)
            hi_p = torch.nn.functional.pad(hi, (0, pad), value=_BIG).view(-1, block).amin(1)
            self._full_tiles[key] = _empty_as_sentinel(lo_p, hi_p)
        return self._full_tiles[key]

    def _full(self, side: str, block: int, step: int, tiles, shared):
        key = (side + "_full", block, step)
        if key not in self._full_tiles:
            lo, hi = (t.to(torch.int64) for t in tiles(block))
            s_lo, s_hi = shared(block)
            # first grid start >= s_lo, then as many whole steps as end <= s_hi (int64: sentinels don't overflow)
            start = lo + torch.div(s_lo - lo + step - 1, step, rounding_mode="floor") * step
            end = start + torch.div(s_hi - start, step, rounding_mode="floor") * step
            some = (s_hi > s_lo) & (end > start)
            start, end = torch.where(some, start, hi), torch.where(some, end, hi)
            self._full_tiles[key] = (start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous())
        return self._full_tiles[key]


def _seq_idx(cu: torch.Tensor, total: int) -> torch.Tensor:
    """``[T]`` document of every token, on ``cu``'s device, from :meth:`VarlenMeta.seq_idx` (no host read for
    device offsets; ``T`` is an accepted upper bound of the longest document)."""
    from varpack.varlen.meta import VarlenMeta

    return VarlenMeta(cu, None, total, total_q=total).seq_idx().reshape(-1)


def _empty_as_sentinel(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    empty = hi <= lo
    return torch.where(empty, _BIG, lo), torch.where(empty, 0, hi)


def _tables(
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    total_q: int,
    total_k: int,
    causal: bool,
    window_size: tuple[int, int],
    meta: VarlenMeta | None,
) -> TritonShortTables:
    """The batch's tables: built once per batch, device and mask and kept on ``meta`` (every layer reuses
    them); without a meta, built for this call."""
    window = (int(window_size[0]), 0 if causal else int(window_size[1]))
    if meta is None:
        return TritonShortTables.build(cu_q, cu_k, total_q, total_k, causal=causal, window_size=window)

    key = ("triton_short_tables", str(cu_q.device), total_q, total_k, bool(causal), window)
    # seq_idx first: meta.memo's lock is not re-entrant, so no memo call may run inside a build
    doc_q = meta.seq_idx_on(cu_q.device) if meta.total_q == total_q else None
    doc_k = doc_q if meta.self_attention else None

    def build() -> TritonShortTables:
        return TritonShortTables.build(
            cu_q, cu_k, total_q, total_k, causal=causal, window_size=window, doc_q=doc_q, doc_k=doc_k
        )

    return meta.memo(key, build)


# -- kernels launch ----------------------------------------------------------------------------------------


def _mask_args(causal: bool, window_size: tuple[int, int]) -> tuple[int, int, bool, bool]:
    left, right = int(window_size[0]), 0 if causal else int(window_size[1])
    return max(left, 0), max(right, 0), left >= 0, right >= 0


def _head_block(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(kern, dtype: torch.dtype) -> bool:
    return bool(kern.INTERPRETED) and dtype == torch.bfloat16


def _launch_opts(
    num_warps: int, num_stages: int, device: torch.device, maxnreg: int | None = None
) -> dict[str, int]:
    """Triton launch options of a compiled kernel (none under the CPU interpreter): warps, stages and, where set,
    the register cap ``maxnreg``."""
    if device.type == "cpu":
        return {}
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        opts["maxnreg"] = maxnreg
    return opts


def _packing(
    config: TritonShortConfig, group: int, block_m: int, mean: float | None = None
) -> tuple[bool, int]:
    """``(pack_gqa, query tile in tokens)`` of a kernel whose query tile has ``block_m`` rows: packed when the
    config asks for it (``None``: when ``group >= PACK_GQA_MIN_GROUP``, or when the mean query-document length
    ``mean`` (tokens, a Python number) is at most :data:`PACK_GQA_SHORT_MEAN`) and the group ``G > 1`` divides
    ``block_m`` (then ``block_m / G`` tokens per tile).

    Raises:
        ValueError: ``pack_gqa=True`` forced with a group ``G > 1`` that does not divide ``block_m`` (a forced
            setting is never ignored silently; a group of 1 is the unpacked layout itself).
    """
    if config.pack_gqa and group > 1 and block_m % group:
        raise ValueError(
            f"triton_short config: pack_gqa=true needs the GQA group G = H / Hkv = {group} to divide the query "
            f"tile's BLOCK_M = {block_m} rows; use pack_gqa null (packed by group size where it can) or a BLOCK_M "
            f"that G divides"
        )
    pack = _wants_pack(config, group, mean) and block_m % group == 0
    return pack, block_m // group if pack else block_m


def _wants_pack(config: TritonShortConfig, group: int, mean: float | None) -> bool:
    """Whether PackGQA is asked for (before the divisibility check of :func:`_packing`): never for a group of 1
    (nothing to pack); else the config's setting, or by default ``group >= PACK_GQA_MIN_GROUP`` or a mean
    document length ``mean`` at most :data:`PACK_GQA_SHORT_MEAN`."""
    if group <= 1:
        return False
    if config.pack_gqa is None:
        return group >= PACK_GQA_MIN_GROUP or (mean is not None and mean <= PACK_GQA_SHORT_MEAN)
    return config.pack_gqa


def _launch_blocks(
    config: TritonShortConfig, kind: str, head_dim: int, group: int, mean: float | None
) -> tuple[tuple[int, int, int, int], bool, int]:
    """``(blocks, pack_gqa, query tile in tokens)`` of one launch: the launch configuration of the layout the call
    asks for (:meth:`TritonShortConfig.blocks`, packed or not by :func:`_wants_pack`), then :func:`_packing`."""
    blocks = config.blocks(kind, head_dim, packed=_wants_pack(config, group, mean))
    pack, tile_m = _packing(config, group, blocks[0], mean)
    return blocks, pack, tile_m


def _grid(
    tables: TritonShortTables, config: TritonShortConfig, side: str, block: int, tiles: int, heads: int
) -> tuple[tuple[int, ...], torch.Tensor]:
    """``(grid, order)`` of one launch over ``tiles`` tiles of ``block`` rows and ``heads`` heads: with
    :attr:`TritonShortConfig.lpt` a 1-D grid and the tile order (:meth:`TritonShortTables.tile_order`), else the
    2-D ``(tiles, heads)`` grid (the order is then not read: ``doc_q`` stands in as the pointer)."""
    if config.lpt:
        return (tiles * heads,), tables.tile_order(side, block)
    return (tiles, heads), tables.doc_q


def _forward(q, k, v, tables, causal, window_size, scale, config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [Tq, H, D], lse [H, Tq] fp32)``; ``config``: :func:`active_config`'s."""
    kern = _kernels()
    total_q, h, d = q.shape
    group = h // k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty((h, total_q), device=q.device, dtype=torch.float32)
    config = active_config(config)
    (block_m, block_n, warps, stages), pack, tile_m = _launch_blocks(config, "fwd", d, group, tables.mean_q)
    lo, hi, full_lo, full_hi = tables.launch_tables("q", tile_m, block_n, config.mask_free)
    left, right, has_left, has_right = _mask_args(causal, window_size)
    heads = k.shape[1] if pack else h
    grid, order = _grid(tables, config, "q", tile_m, triton_cdiv(total_q, tile_m), heads)
    kern.attn_fwd[grid](
        q, k, v, out, lse, tables.doc_q, tables.doc_k, tables.lim, lo, hi, full_lo, full_hi, order,
        scale * _LOG2E, total_q, left, right, heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        GROUP=group, HEAD_DIM=d, BLOCK_D=_head_block(d), BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_LEFT=has_left, HAS_RIGHT=has_right, PRECISION=_precision(q.dtype), UPCAST=_upcast(kern, q.dtype),
        MASK_FREE=config.mask_free, PACK_GQA=pack, LPT=config.lpt,
        **_launch_opts(warps, stages, q.device, config.registers("fwd", d)),
    )  # fmt: skip
    return out, lse


def _backward_delta(dout, out, lse) -> torch.Tensor:
    """``delta = rowsum(dO * O)`` ``[H, Tq]`` fp32 (the backward's preprocessing kernel)."""
    kern = _kernels()
    total_q, h, d = out.shape
    delta = torch.empty_like(lse)
    pre_m = 64
    kern.attn_bwd_preprocess[(triton_cdiv(total_q, pre_m), h)](
        out, dout, delta, total_q, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), delta.stride(0),
        HEAD_DIM=d, BLOCK_D=_head_block(d), BLOCK_M=pre_m,
    )  # fmt: skip
    return delta


def _backward_dkdv(dout, q, k, v, lse, delta, tables, causal, window_size, scale, config=None):
    """``(dk, dv)`` ``[Tk, Hkv, D]`` (one program per key tile and KV head)."""
    kern = _kernels()
    total_q, h, d = q.shape
    total_k, hkv, _ = k.shape
    left, right, has_left, has_right = _mask_args(causal, window_size)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    config = active_config(config)
    (block_m, block_n, warps, stages), pack, tile_m = _launch_blocks(
        config, "bwd_dkdv", d, h // hkv, tables.mean_q
    )
    lo, hi, full_lo, full_hi = tables.launch_tables("k", block_n, tile_m, config.mask_free)
    grid, order = _grid(tables, config, "k", block_n, triton_cdiv(total_k, block_n), hkv)
    kern.attn_bwd_dkdv[grid](
        q, k, v, dout, lse, delta, dk, dv, tables.doc_q, tables.doc_k, tables.lim, lo, hi, full_lo, full_hi,
        order, scale * _LOG2E, scale, total_q, total_k, left, right, hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0),
        GROUP=h // hkv, HEAD_DIM=d, BLOCK_D=_head_block(d), BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_LEFT=has_left, HAS_RIGHT=has_right, PRECISION=_precision(q.dtype), UPCAST=_upcast(kern, q.dtype),
        MASK_FREE=config.mask_free, PACK_GQA=pack, LPT=config.lpt,
        DP_FIRST=config.dp_first,
        **_launch_opts(warps, stages, q.device, config.registers("bwd_dkdv", d)),
    )  # fmt: skip
    return dk, dv


def _backward_dq(dout, q, k, v, lse, delta, tables, causal, window_size, scale, config=None, out=None):
    """``dq`` ``[Tq, H, D]`` (one program per query tile and head). With ``out`` (the forward's output) the kernel
    computes ``delta`` of its rows and writes it into ``delta`` (``[H, Tq]`` fp32, may be uninitialised) for the
    dK / dV kernel (:attr:`TritonShortConfig.delta_in_dq`); without it, ``delta`` is read."""
    kern = _kernels()
    total_q, h, d = q.shape
    hkv = k.shape[1]
    left, right, has_left, has_right = _mask_args(causal, window_size)
    dq = torch.empty_like(q)
    config = active_config(config)
    (block_m, block_n, warps, stages), pack, tile_m = _launch_blocks(
        config, "bwd_dq", d, h // hkv, tables.mean_q
    )
    lo, hi, full_lo, full_hi = tables.launch_tables("q", tile_m, block_n, config.mask_free)
    o = dout if out is None else out  # not read without DELTA_IN_DQ
    heads = hkv if pack else h
    grid, order = _grid(tables, config, "q", tile_m, triton_cdiv(total_q, tile_m), heads)
    kern.attn_bwd_dq[grid](
        q, k, v, dout, lse, delta, dq, tables.doc_q, tables.doc_k, tables.lim, lo, hi, full_lo, full_hi, o,
        order, scale * _LOG2E, scale, total_q, left, right, heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), lse.stride(0), o.stride(0), o.stride(1),
        GROUP=h // hkv, HEAD_DIM=d, BLOCK_D=_head_block(d), BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_LEFT=has_left, HAS_RIGHT=has_right, PRECISION=_precision(q.dtype), UPCAST=_upcast(kern, q.dtype),
        MASK_FREE=config.mask_free, PACK_GQA=pack, DELTA_IN_DQ=out is not None, LPT=config.lpt,
        DP_FIRST=config.dp_first,
        **_launch_opts(warps, stages, q.device, config.registers("bwd_dq", d)),
    )  # fmt: skip
    return dq


def _backward(dout, q, k, v, out, lse, tables, causal, window_size, scale, config=None):
    """``(dq, dk, dv)`` (:func:`active_config`'s launch configs): the dQ kernel computing ``delta`` on the way,
    then the dK/dV kernel (:attr:`TritonShortConfig.delta_in_dq`); or delta's own pass, dK/dV, then dQ."""
    config = active_config(config)
    if config.delta_in_dq:
        delta = torch.empty_like(lse)
        dq = _backward_dq(dout, q, k, v, lse, delta, tables, causal, window_size, scale, config, out=out)
        dk, dv = _backward_dkdv(dout, q, k, v, lse, delta, tables, causal, window_size, scale, config)
        return dq, dk, dv
    delta = _backward_delta(dout, out, lse)
    dk, dv = _backward_dkdv(dout, q, k, v, lse, delta, tables, causal, window_size, scale, config)
    dq = _backward_dq(dout, q, k, v, lse, delta, tables, causal, window_size, scale, config)
    return dq, dk, dv


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _TritonShortFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tables, causal, window_size, scale, config=None):
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        out, lse = _forward(q, k, v, tables, causal, window_size, scale, config)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.tables, ctx.causal, ctx.window_size, ctx.scale = tables, causal, window_size, scale
        ctx.config = config
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for lse (never read) at every backward
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # the output took no part in the loss
            return None, None, None, None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        dq, dk, dv = _backward(
            dout, q, k, v, out, lse, ctx.tables, ctx.causal, ctx.window_size, ctx.scale, ctx.config
        )
        return dq, dk, dv, None, None, None, None, None


def triton_short_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    meta: VarlenMeta | None = None,
    config: TritonShortConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention with tiles that span documents; differentiable in q, k, v.

    Args:
        q: ``[Tq, H, D]``; k, v: ``[Tk, Hkv, D]`` (``H % Hkv == 0``), one dtype (fp16 / bf16 / fp32), on CUDA
            (or the CPU under ``TRITON_INTERPRET=1``). Last dim contiguous (copied otherwise).
        cu_seqlens_q, cu_seqlens_k: ``[N+1]`` integer offsets on q's device (values never read on the host).
        causal, window_size: :func:`varpack.attn.varlen_attention`'s (normalized: causal forces right = 0).
        softmax_scale: default ``1 / sqrt(D)``.
        meta: the batch's :class:`varpack.varlen.VarlenMeta`: the per-batch tables are kept on it.
        config: the kernels' launch configurations (:class:`TritonShortConfig`); default :func:`active_config`
            (the :data:`CONFIG_ENV` override, else :data:`BLOCKS`), read at this call and kept for its backward.

    Returns:
        ``(out, lse)``: ``[Tq, H, D]`` in q's dtype, and the natural-log log-sum-exp of the scaled scores
        ``[H, Tq]`` fp32 (``+inf`` for a query that sees no key, whose output is 0). ``lse`` is not
        differentiable.

    Raises:
        BackendUnavailableError: CPU tensors while Triton is not interpreted, CUDA tensors while it is.
        ValueError: a malformed :data:`CONFIG_ENV`.
    """
    _checked_device(q)
    config = active_config(config)
    total_q, total_k = q.shape[0], k.shape[0]
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    if total_q == 0:
        return q.new_zeros(0, q.shape[1], v.shape[-1]), q.new_zeros(q.shape[1], 0, dtype=torch.float32)
    if total_k == 0:  # no key anywhere: every query outputs 0 (lse +inf)
        out = q.new_zeros(total_q, q.shape[1], v.shape[-1]) + 0 * q.sum()  # keeps the graph for autograd
        return out, torch.full((q.shape[1], total_q), float("inf"), device=q.device)
    with torch.no_grad():
        tables = _tables(cu_seqlens_q, cu_seqlens_k, total_q, total_k, causal, window_size, meta)
    window = (int(window_size[0]), 0 if causal else int(window_size[1]))
    return _TritonShortFunction.apply(q, k, v, tables, bool(causal), window, scale, config)


def _checked_device(q: torch.Tensor) -> None:
    reason = _platform_reason(q.device.type)
    if reason is not None:
        raise BackendUnavailableError(f"triton_short: {reason}")


def op_forward(q, k, v, cu_q, cu_k, causal, window_size, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """The custom op's forward (:mod:`varpack.attn.custom_op`): ``(out, lse)`` without autograd, tables built
    for this call."""
    _checked_device(q)
    window = (int(window_size[0]), 0 if causal else int(window_size[1]))
    if q.shape[0] == 0 or k.shape[0] == 0:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1]), torch.full(
            (q.shape[1], q.shape[0]), float("inf"), device=q.device
        )
    tables = _tables(cu_q, cu_k, q.shape[0], k.shape[0], causal, window, None)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return _forward(q, k, v, tables, causal, window, scale)


def op_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, window_size, scale):
    """The custom op's backward: ``(dq, dk, dv)`` from the forward's ``out`` and ``lse``."""
    _checked_device(q)
    window = (int(window_size[0]), 0 if causal else int(window_size[1]))
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    tables = _tables(cu_q, cu_k, q.shape[0], k.shape[0], causal, window, None)
    q, k, v, out, dout = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, out, dout))
    return _backward(dout, q, k, v, out, lse.contiguous(), tables, causal, window, scale)


class TritonShortBackend(Backend):
    """The ``triton_short`` backend (module docstring); ``auto`` takes it where a row of
    :data:`varpack.attn.registry.AUTO_TRITON_SHORT` matches."""

    name = "triton_short"
    capabilities = Capabilities(
        devices=frozenset({"cuda", "cpu"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        max_head_dim=256,
        softcap=False,
        notes=(
            "Triton kernel whose tiles span several documents (short-document rows); per-batch tile tables on "
            "the VarlenMeta; CPU only under TRITON_INTERPRET=1 (tests); no softcap (its backward is not written)"
        ),
    )

    def _probe(self) -> tuple[bool, str]:
        # the installed version, without importing triton (its import fixes the interpreter mode)
        if importlib.util.find_spec("triton") is None:
            return False, "triton is not installed (pip install triton)"
        return True, f"triton {importlib.metadata.version('triton')}"

    def supports_platform(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> tuple[bool, str]:
        """As :meth:`Backend.supports_platform`, plus: the CPU only when Triton runs interpreted in this process,
        CUDA only when it does not (:func:`_triton_interpreted`)."""
        ok, reason = super().supports_platform(device, dtype)
        if ok and device is not None:
            why = _platform_reason(torch.device(device).type)
            if why is not None:
                return False, why
        return ok, reason

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        causal: bool,
        window_size: tuple[int, int],
        softmax_scale: float,
        softcap: float,
        meta: VarlenMeta | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if softcap > 0:
            raise BackendUnavailableError("triton_short: softcap is not supported")
        out, _ = triton_short_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k,
            causal=causal, window_size=window_size, softmax_scale=softmax_scale, meta=meta,
        )  # fmt: skip
        return out
