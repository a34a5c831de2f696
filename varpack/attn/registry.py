"""Backend registry: the ``auto`` priority table, :func:`available_backends` and :func:`resolve_backend`.

``auto`` walks :data:`AUTO_PRIORITY` for the call's device type and takes the first backend whose
:meth:`~varpack.attn._base.Backend.supports` says yes; the answer carries the reason (which backend was
picked, and why each one before it was skipped) so ``varpack check`` can report it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from varpack.varlen.boundaries import normalize_cu_seqlens, normalize_max_seqlen

from ._base import Backend, BackendUnavailableError, CallSpec
from .flash_attn2 import FlashAttn2Backend
from .flash_attn3 import FlashAttn3Backend
from .flash_attn4 import FlashAttn4Backend
from .flex import FlexBackend
from .reference import ReferenceBackend
from .sdpa import SdpaBackend
from .torch_varlen import TorchVarlenBackend
from .triton_short import TritonShortBackend

__all__ = [
    "AUTO_PRIORITY",
    "AUTO_PRIORITY_SHORT",
    "AUTO_SHORT_MAX_SEQLEN",
    "AUTO_TRITON_SHORT",
    "BACKENDS",
    "ResolvedBackend",
    "TritonShortRule",
    "available_backends",
    "get_backend",
    "resolve_backend",
    "triton_short_wanted",
]

#: All backends by name, in no particular order.
BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        ReferenceBackend(),
        SdpaBackend(),
        TorchVarlenBackend(),
        FlexBackend(),
        FlashAttn2Backend(),
        FlashAttn3Backend(),
        FlashAttn4Backend(),
        TritonShortBackend(),  # not in auto yet: it enters AUTO_PRIORITY_SHORT once measured on the H200
    )
}

#: ``auto`` order per device type, fastest first; benchmarks update this one table.
#: CUDA figures (H200, bf16, D=128, causal, T=65536 packed tokens, useful TFLOP/s fwd / fwd+bwd,
#: shared/ASSETS.md 2026-11-29): lognormal(6.5, 1) lengths: torch varlen_attn 284/243, flex 303/283,
#: flash-attn-4 540/458; GQA H=32 Hkv=8: 293/249, 310/293, 550/451. FA3 and FA2 are not installed there;
#: they are placed by their published figures (FA3 > FA2 on Hopper; FA2 >= flex).
#: Measured by benchmarks/attention.py on the H200 (benchmarks/RESULTS.md#attention, H=16 Hkv=4, fwd+bwd
#: useful TFLOP/s): real chat lengths of ../shared/data (median ~150 tokens): flash-attn-4 145.5, torch varlen_attn
#: 99.5, flex 63.6; uniform 512: 182 / 131 / 98; uniform 2048: 430 / 246 / 248. So on SFT-like mixes
#: torch_varlen beats flex for training and comes first; flex only led on long documents (the lognormal(6.5, 1)
#: mix in ASSETS.md) and stays next (it also covers fp32 and softcap, which torch_varlen refuses).
#: ``sdpa`` and ``reference`` read cu_seqlens on the host (a sync per layer on a GPU): last resorts on CUDA.
#: CPU: ``sdpa`` (a per-segment SDPA loop, 2.4x faster than ``reference`` fwd+bwd on a 2,048-token pack of 6
#: samples, H=8, Hkv=4, D=64, same results to 1e-6), then ``reference`` for what SDPA lacks (softcap).
#: FlexAttention is not used on the CPU: checked with torch 2.13 it runs eagerly and matches the reference in
#: the forward (tests/attn/test_attn.py), but torch refuses its backward on the CPU and it materializes the
#: [H, Tq, Tk] score matrix of the whole stream; it stays available by name for CPU inference.
AUTO_PRIORITY: dict[str, tuple[str, ...]] = {
    "cuda": ("flash_attn_4", "flash_attn_3", "flash_attn", "torch_varlen", "flex", "sdpa", "reference"),
    "cpu": ("sdpa", "reference"),
}
#: ``auto`` takes these backends for a call that needs gradients only from this head dim up: the head dims
#: whose backward was verified against ``reference`` on the H200 (tests/attn/test_attn_gpu.py, D = 64 and 128).
#: Smaller heads (the tiny test models use D = 16 / 32) go to ``flex``, whose gradients `varpack check`
#: verified there at D = 16 and 32. FA4 refuses D < 64 itself (its sm90 backward was wrong at D = 16).
AUTO_MIN_HEAD_DIM_FOR_GRAD: dict[str, int] = {"torch_varlen": 64}
#: Device types not listed above.
AUTO_PRIORITY_DEFAULT: tuple[str, ...] = ("sdpa", "reference")
#: The "short documents" shape class: calls whose ``max_seqlen`` (the longest segment, a Python int: no sync)
#: is at most this many tokens.
AUTO_SHORT_MAX_SEQLEN: int = 128
#: ``auto`` order for the short-documents class, per device type (absent: :data:`AUTO_PRIORITY`), after the
#: :data:`AUTO_TRITON_SHORT` rows. Measured on the H200 (benchmarks/attention.py --mixes short,
#: benchmarks/RESULTS.md#attention: T = 65,536 of 886 documents of 16..128 tokens, H = 16/4, D = 128, bf16,
#: fwd+bwd): torch_varlen 2.674 ms, flash_attn_4 3.059, flex 4.685. Every kernel is launch/memory bound there.
AUTO_PRIORITY_SHORT: dict[str, tuple[str, ...]] = {
    "cuda": ("torch_varlen", "flash_attn_4", "flex", "flash_attn_3", "flash_attn", "sdpa", "reference"),
}


class TritonShortRule(NamedTuple):
    """One shape class where ``auto`` puts ``triton_short`` first (a row of :data:`AUTO_TRITON_SHORT`).

    A call matches when its longest segment ``max_seqlen <= max_seqlen`` and (if ``max_mean_seqlen`` is not
    None) its mean segment length ``Tq / number of segments <= max_mean_seqlen``; ``training`` True / False
    restricts the row to calls that need / do not need gradients (None: both); the head dim must be in
    ``head_dims`` (the dims measured). Lengths in tokens.
    """

    max_seqlen: int
    max_mean_seqlen: float | None = None
    training: bool | None = None
    head_dims: tuple[int, ...] = (64, 128)


#: Where ``auto`` uses ``triton_short`` on CUDA, filled from benchmarks/attention_tune.py and
#: benchmarks/attention.py on the H200: a row is added only for a shape class where triton_short measured
#: faster than what ``auto`` picks today (empty: never, ``auto`` as before). The compiled custom-op path
#: (:mod:`varpack.attn.custom_op`, ``_traced_call``) passes only the short class of ``max_seqlen`` and no mean,
#: so rows that need more (a mean bound, a ``max_seqlen`` above :data:`AUTO_SHORT_MAX_SEQLEN`) match eagerly
#: only until that path passes the row's class too.
#:
#: Row 1, measured on the H200 (benchmarks/attention.py, benchmarks/RESULTS.md#attention; T = 65,536 of 886
#: documents of 16..128 tokens, mean 74, H = 16/4, D = 128, bf16, one VarlenMeta per batch): fwd+bwd
#: triton_short 1.143 ms (72.8 TFLOP/s) vs torch_varlen 2.674 ms (auto's other pick: 31.1), flash_attn_4 3.059 ms,
#: flex 4.685 ms; the forward alone was no faster than torch_varlen's, so the row is for training only.
#: On the real-lengths mix (max 1,633, mean 207) triton_short is 1.31x FA4 in the attention call but 0.95x in the
#: eager SFT step (benchmarks/RESULTS.md#sft-step): no row there.
#: Its mean bound is the SFT step's: on packs of the real data's samples of at most 128 tokens (mean 87.4, 94 per
#: 8,192-token pack; Qwen3-0.6B shape, benchmarks/train.py --max-sample-length 128, RESULTS.md#sft-step) the step
#: under CUDA graphs takes 69.8 ms with triton_short vs 80.0 with FA4, eagerly the two tie with torch_varlen;
#: no mix with a mean above 88 was measured.
AUTO_TRITON_SHORT: tuple[TritonShortRule, ...] = (
    TritonShortRule(max_seqlen=128, max_mean_seqlen=88.0, training=True, head_dims=(128,)),
)


def triton_short_wanted(spec: CallSpec, rules: tuple[TritonShortRule, ...] | None = None) -> tuple[bool, str]:
    """Whether ``auto`` should try ``triton_short`` first for ``spec`` (CUDA only), from Python numbers only
    (``spec.max_seqlen``, ``spec.mean_seqlen``, ``spec.head_dim``, ``spec.needs_grad``: no host sync).

    Args:
        spec: the call's facts; an unknown ``max_seqlen`` (or an unknown ``mean_seqlen`` for a row that bounds
            it) never matches.
        rules: default :data:`AUTO_TRITON_SHORT`.

    Returns:
        ``(wanted, why)``: ``why`` names the matching row (or says why none matched).
    """
    rules = AUTO_TRITON_SHORT if rules is None else rules
    if not rules:
        return False, "AUTO_TRITON_SHORT is empty"
    if spec.device.type != "cuda":
        return False, f"triton_short is used by auto on CUDA only, not {spec.device.type}"
    if spec.max_seqlen is None:
        return False, "max_seqlen unknown"
    for rule in rules:
        if spec.max_seqlen > rule.max_seqlen or spec.head_dim not in rule.head_dims:
            continue
        if rule.training is not None and rule.training != spec.needs_grad:
            continue
        if rule.max_mean_seqlen is not None and (
            spec.mean_seqlen is None or spec.mean_seqlen > rule.max_mean_seqlen
        ):
            continue
        mean = "?" if spec.mean_seqlen is None else f"{spec.mean_seqlen:.1f}"
        return True, f"AUTO_TRITON_SHORT row {rule} matches max_seqlen {spec.max_seqlen}, mean {mean}"
    return False, "no AUTO_TRITON_SHORT row matches"


class ResolvedBackend(str):
    """The chosen backend's name (a ``str``) with ``.reason``: why it was chosen (and what was skipped)."""

    reason: str

    def __new__(cls, name: str, reason: str) -> ResolvedBackend:
        obj = super().__new__(cls, name)
        obj.reason = reason
        return obj


def get_backend(name: str) -> Backend:
    """The backend object registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose 'auto' or one of {sorted(BACKENDS)}"
        ) from None


def _device_type(device: torch.device | str | None) -> str | None:
    if device is None:
        return None
    return torch.device(device).type


def available_backends(
    device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> dict[str, tuple[bool, str]]:
    """Every backend's ``(ok, reason)``: installed, and (if given) able to run on ``device`` / ``dtype``.

    Args:
        device: a device (``"cuda"``, ``"cpu"``, ``torch.device``) or None to check installation only.
        dtype: a q/k/v dtype or None.

    Returns:
        ``{name: (ok, reason)}`` in ``auto`` order for the device first, then the rest.
    """
    dev_type = _device_type(device)
    order = list(AUTO_PRIORITY.get(dev_type or "cuda", AUTO_PRIORITY_DEFAULT))
    order += [n for n in BACKENDS if n not in order]
    no_cuda = dev_type == "cuda" and not torch.cuda.is_available()
    result: dict[str, tuple[bool, str]] = {}
    for name in order:
        ok, reason = BACKENDS[name].supports_platform(device, dtype)
        if ok and no_cuda:
            ok, reason = False, f"CUDA is not available here (torch {torch.__version__})"
        result[name] = (ok, reason)
    return result


def resolve_spec(name: str, spec: CallSpec, *, exclude: Mapping[str, str] | None = None) -> ResolvedBackend:
    """Resolve ``name`` (``"auto"`` or a backend name) for the call ``spec``.

    ``exclude`` (``auto`` only): backends ``auto`` passes over, each with the reason reported among the skipped
    ones (the custom op's training path, :mod:`varpack.attn.custom_op`, passes those with no backward through
    the op). A forced name is never excluded.

    Raises:
        ValueError: unknown backend name.
        BackendUnavailableError: the forced backend cannot run the call, or (``auto``) none can.
    """
    if name != "auto":
        backend = get_backend(name)
        ok, reason = backend.supports(spec)
        if not ok:
            raise BackendUnavailableError(f"attention backend {name!r} cannot run this call: {reason}")
        return ResolvedBackend(name, f"{name}: forced by the caller")
    order = AUTO_PRIORITY.get(spec.device.type, AUTO_PRIORITY_DEFAULT)
    table = "AUTO_PRIORITY"
    short = spec.max_seqlen is not None and spec.max_seqlen <= AUTO_SHORT_MAX_SEQLEN
    if short and spec.device.type in AUTO_PRIORITY_SHORT:
        order, table = AUTO_PRIORITY_SHORT[spec.device.type], "AUTO_PRIORITY_SHORT"
    wanted, why_short = triton_short_wanted(spec)
    if wanted:  # measured fastest for this shape class: tried first, then the table as before
        order = ("triton_short", *(n for n in order if n != "triton_short"))
    skipped: list[str] = []
    for candidate in order:
        if exclude and candidate in exclude:
            skipped.append(f"{candidate}: {exclude[candidate]}")
            continue
        ok, reason = BACKENDS[candidate].supports(spec)
        min_d = AUTO_MIN_HEAD_DIM_FOR_GRAD.get(candidate)
        if ok and min_d is not None and spec.needs_grad and spec.head_dim < min_d:
            ok, reason = (
                False,
                f"auto uses it for training only at verified head dims D >= {min_d}, got D={spec.head_dim}",
            )
        if ok:
            why = (
                f"auto on {spec.device.type}: {candidate} is the first backend in {table} that runs this call"
            )
            if wanted and candidate == "triton_short":
                why = f"auto on {spec.device.type}: triton_short first because {why_short}"
            elif table == "AUTO_PRIORITY_SHORT":
                why += f" (short documents: max_seqlen {spec.max_seqlen} <= {AUTO_SHORT_MAX_SEQLEN})"
            if skipped:
                why += " (skipped " + "; ".join(skipped) + ")"
            if spec.device.type != "cpu" and BACKENDS[candidate].capabilities.host_sync:
                why += f"; note: {candidate} reads cu_seqlens on the host, one device sync per call"
            return ResolvedBackend(candidate, why)
        skipped.append(f"{candidate}: {reason}")
    raise BackendUnavailableError(
        f"no attention backend can run this call on {spec.device.type}: " + "; ".join(skipped)
    )


def resolve_backend(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    sinks: torch.Tensor | None = None,
) -> ResolvedBackend:
    """Which backend ``name`` (``"auto"`` or a backend name) runs a call with these tensors, and why.

    Args:
        name: ``"auto"`` or one of :data:`BACKENDS`.
        q: ``[Tq, H, D]`` (only its device, dtype, shape and ``requires_grad`` are used); k: ``[Tk, Hkv, D]``,
            v: ``[Tk, Hkv, Dv]`` (default: same head count as q).
        causal, window_size, softcap: as in :func:`varpack.attn.varlen_attention`.
        cu_seqlens_q, cu_seqlens_k: optional; when on the CPU they are checked for zero-length segments and
            give the longest segment if ``max_seqlen`` is not given.
        max_seqlen: the longest segment (a host integer, :func:`varpack.varlen.normalize_max_seqlen`) or
            None: decides the short-documents shape class (:data:`AUTO_SHORT_MAX_SEQLEN`,
            :data:`AUTO_PRIORITY_SHORT`) and, with the mean segment length ``Tq / (len(cu_seqlens_q) - 1)``,
            whether ``triton_short`` is tried first (:data:`AUTO_TRITON_SHORT`).
        sinks: the call's attention-sink logits ``[H]`` (only its presence is used) or None.

    Returns:
        A :class:`ResolvedBackend`: the chosen name (a ``str``) with ``.reason``.

    Raises:
        ValueError: unknown backend name.
        TypeError / ValueError: cu_seqlens or max_seqlen refused by :func:`varpack.varlen.normalize_cu_seqlens`
            / :func:`varpack.varlen.normalize_max_seqlen`.
        BackendUnavailableError: the forced backend cannot run the call, or (``auto``) none can.
    """
    causal, window_size = normalize_mask_args(causal, window_size)
    has_empty = None
    cus = [
        normalize_cu_seqlens(c, n, min_entries=1)
        for n, c in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
        if c is not None
    ]
    if max_seqlen is not None:
        max_seqlen = normalize_max_seqlen(max_seqlen, "max_seqlen")
    if cus and all(c.device.type == "cpu" for c in cus):
        has_empty = any(bool((c[1:] == c[:-1]).any()) for c in cus)
        if max_seqlen is None:
            max_seqlen = max(int((c[1:] - c[:-1]).max()) if c.numel() > 1 else 0 for c in cus)
    num_segments = cus[0].shape[0] - 1 if cus else 0  # a shape: no sync
    spec = CallSpec.from_tensors(
        q,
        k,
        v,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        has_empty_segments=has_empty,
        max_seqlen=max_seqlen,
        mean_seqlen=q.shape[0] / num_segments if num_segments > 0 else None,
        sinks=sinks,
    )
    return resolve_spec(name, spec)


def normalize_mask_args(causal: bool, window_size: tuple[int, int]) -> tuple[bool, tuple[int, int]]:
    """flash-attn's normalization: causal forces ``right = 0``; ``(left, 0)`` without causal is causal."""
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    elif right == 0:
        causal = True
    return bool(causal), (left, right)
