"""Decoder layers replayed as CUDA graphs on static-shape packs: the pieces ``varpack sft --cuda-graphs`` and
``benchmarks/train.py``'s ``varpack_lce_static_graphs`` share (one implementation).

A step runs as CUDA graphs when (PyTorch docs: ``torch.compile`` ``mode="reduce-overhead"``, "CUDA Graphs" in
the CUDA semantics notes, and ``torch.compiler.cudagraph_mark_step_begin``):

* every pack has the same shapes: :class:`varpack.collate.StaticShape` (``T``, ``N``, the ``max_seqlen``
  bucket; ``StaticShape.from_plan`` over the run's whole plan) given to
  :class:`varpack.collate.PaddingFreeCollator` (``static_shape=``);
* each decoder layer is compiled whole for that one shape with attention inside its graph
  (:func:`compile_layers_as_graphs`: :func:`varpack.integrations.kernels.compile_layers` with
  :data:`GRAPH_COMPILE_KW`);
* every tensor a layer reads is on the device, the boundaries included (:func:`boundaries_on_device`:
  :meth:`varpack.varlen.VarlenMeta.on_device`; inductor captures no graph with a CPU input);
* each step begins with :func:`begin_step` (``torch.compiler.cudagraph_mark_step_begin()``: the previous
  step's graph outputs may be overwritten from here on);
* the passes run inside :func:`capture_or_error` (inductor's ``triton.cudagraph_or_error``, where this torch
  has it): a graph inductor would run eagerly instead of capturing it raises, never a silent eager fallback;
  :func:`cudagraph_skips` counts the skipped ones where the option is missing.

The attention backend must launch without host reads of the offsets (``flash_attn_4``, ``triton_short``;
tests/invariant/test_static_shapes.py's GPU test); one that reads them fails the capture (an error, above).
Gated DeltaNet layers (Qwen3.5, Qwen3-Next) run captured on the ``fla_hybrid`` rule only, with fla's chunk
indices and varpack's dq/dk chunk table built on the device at a size fixed by the static shape
(:data:`GATED_DELTA_GRAPHS_REFUSAL`; tests/ops/test_fla_hybrid.py's graph-replay GPU test).
Embedding, final norm, the loss and the optimizer stay eager.
"""

from __future__ import annotations

import contextlib
import types
import typing
from collections.abc import Iterator
from typing import Any

import torch

from varpack.schema import FLASH_ATTN_KWARGS, VARLEN_META

__all__ = [
    "EMPTY_PADS_BY_DEFAULT",
    "GATED_DELTA_GRAPHS_REFUSAL",
    "GRAPH_BACKENDS",
    "GRAPH_COMPILE_KW",
    "MAMBA2_GRAPHS_REFUSAL",
    "TRITON_SHORT_GRAPH_HEAD_DIMS",
    "attention_refusal",
    "begin_step",
    "boundaries_on_device",
    "capture_or_error",
    "compile_layers_as_graphs",
    "cudagraph_skips",
    "empty_pads_ok",
    "graph_attention",
    "graph_compile_kw",
    "model_refusal",
    "static_shape_for",
]

#: What CUDA-graph layers need of a model's Gated DeltaNet layers. Replaying a captured graph re-runs its
#: kernel launches with the grids, loop counts and index tensors of the pack it was captured on, so every launch
#: must be sized by the static shape alone and every index built on the device. ``fla_hybrid`` does that in a
#: captured layer (:func:`varpack.ops.gated_delta_rule.fla_hybrid.device_fla_hybrid_boundaries`: fla's chunk
#: indices and the dq/dk chunk table built from the device offsets with :func:`varpack.ops._fla.max_chunks`
#: rows, padding rows masked by every kernel; the short convolution on the PyTorch path with the segment index
#: computed in the graph). ``chunk`` (a Python loop over a CPU chunk layout), ``naive`` (a loop over host
#: offsets) and ``fla`` (no backward through varpack's op) do not.
GATED_DELTA_GRAPHS_REFUSAL = (
    "its recurrent mixers (Gated DeltaNet) replay as CUDA graphs only on the fla_hybrid backend (fla-core's "
    "kernels with chunk tables built on the device, fixed-size for the static shape); the others size their "
    "launches from offsets read on the host, so a replay would compute the next pack with the captured pack's "
    "segmentation"
)
#: Why CUDA-graph layers are refused for a model with Mamba-2 mixers.
MAMBA2_GRAPHS_REFUSAL = (
    "its recurrent mixers (Mamba-2) are graph breaks in a compiled layer (the SSD chunk layout is built on the "
    "host per pack), and CUDA-graph layers are compiled whole (fullgraph)"
)


def _gated_delta_refusal(
    model: torch.nn.Module, device: torch.device | str | None, backend: str | None
) -> str | None:
    """Why ``model``'s Gated DeltaNet layers cannot run captured on ``device`` (default: CUDA when available),
    or ``None``: each layer's gated delta rule backend (``backend``, else the layer's own, else ``"auto"``)
    must resolve to ``fla_hybrid`` there at the layer's head dims, with gradients
    (:func:`varpack.ops.gated_delta_rule.resolve_backend`: fla's probes run on the device)."""
    from varpack.integrations.gated_delta import layer_head_dims
    from varpack.models.registry import is_gated_delta_layer
    from varpack.ops.gated_delta_rule import resolve_backend

    layers = [m for m in model.modules() if is_gated_delta_layer(m)]
    if not layers:
        return None
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type != "cuda":
        return f"{GATED_DELTA_GRAPHS_REFUSAL}, which needs a CUDA device (here: {dev})"
    resolved: dict[tuple, str] = {}
    for layer in layers:
        name = backend or getattr(layer, "_varpack_gdn_backend", "auto")
        key = (name, layer_head_dims(layer))
        if key not in resolved:
            try:
                resolved[key] = resolve_backend(name, dev, needs_grad=True, dims=key[1])
            except Exception as exc:  # noqa: BLE001 - the reason goes on the speed line / into the error
                return f"{GATED_DELTA_GRAPHS_REFUSAL}: {type(exc).__name__}: {exc}"
        if resolved[key] != "fla_hybrid":
            return (
                f"{GATED_DELTA_GRAPHS_REFUSAL}; gated delta rule backend {name!r} resolves to "
                f"{resolved[key]!r} here"
            )
    return None


def _recurrent_refusal(
    model: torch.nn.Module, device: torch.device | str | None = None, backend: str | None = None
) -> str | None:
    """:data:`MAMBA2_GRAPHS_REFUSAL` for a model with Mamba-2 mixers; for Gated DeltaNet layers, why they
    cannot run captured on ``device`` (:func:`_gated_delta_refusal`); else ``None``."""
    from varpack.models.mamba2 import is_mamba2_mixer

    if any(is_mamba2_mixer(m) for m in model.modules()):
        return MAMBA2_GRAPHS_REFUSAL
    return _gated_delta_refusal(model, device, backend)


#: :func:`varpack.integrations.kernels.compile_layers` keywords of CUDA-graph layers: attention as the custom op
#: inside the layer's graph (``custom_ops``), no graph break allowed (``fullgraph``), one static shape
#: (``dynamic=False``), CUDA-graph trees (``mode="reduce-overhead"``).
GRAPH_COMPILE_KW: dict[str, Any] = {
    "custom_ops": True,
    "fullgraph": True,
    "dynamic": False,
    "mode": "reduce-overhead",
}


def graph_compile_kw(inductor_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The :func:`varpack.integrations.kernels.compile_layers` keywords of CUDA-graph layers:
    :data:`GRAPH_COMPILE_KW`, or with ``inductor_options`` (e.g. ``{"max_autotune": True,
    "coordinate_descent_tuning": True}``, what ``mode="max-autotune"`` sets) those options plus
    ``"triton.cudagraphs": True`` in place of ``mode`` (``torch.compile`` takes ``mode`` or ``options``, not
    both). A new dict each call.

    Raises:
        ValueError: an option inductor does not have (``torch._inductor.list_options()``), named; a value of
            another type than the option's (``torch._inductor.config.get_type``, where this torch has it:
            otherwise ``torch.compile`` raises it only when a layer compiles); or ``"triton.cudagraphs"`` set
            false (these layers are replayed as CUDA graphs).
    """
    kw = dict(GRAPH_COMPILE_KW)
    if not inductor_options:
        return kw
    from torch._inductor import config as inductor_config
    from torch._inductor import list_options

    unknown = sorted(set(inductor_options) - set(list_options()))
    if unknown:
        raise ValueError(
            f"CUDA-graph layers: unknown inductor option(s) {unknown} (torch._inductor.list_options())"
        )
    get_type = getattr(inductor_config, "get_type", None)
    wrong = []
    for key, value in inductor_options.items():
        want = get_type(key) if get_type is not None else None
        union = typing.get_origin(want) in (typing.Union, types.UnionType)  # ``int | None`` -> (int, NoneType)
        kinds = typing.get_args(want) if union else (want,)
        if not all(isinstance(k, type) and k is not typing.Any and typing.get_origin(k) is None for k in kinds):
            continue  # a generic, a callable, Any: torch checks it when a layer compiles
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds and int in kinds):
            wrong.append(f"{key}={value!r} (expects {' | '.join(k.__name__ for k in kinds)})")
    if wrong:
        raise ValueError(f"CUDA-graph layers: inductor option(s) of the wrong type: {', '.join(wrong)}")
    if not inductor_options.get("triton.cudagraphs", True):
        raise ValueError("CUDA-graph layers: inductor option triton.cudagraphs=False would not capture them")
    del kw["mode"]
    kw["options"] = {**inductor_options, "triton.cudagraphs": True}
    return kw


#: the attention backends a captured layer runs: they launch without reading ``cu_seqlens`` on the host and have a
#: backward through varpack's custom op (tests/invariant/test_static_shapes.py's GPU test captures both)
GRAPH_BACKENDS: tuple[str, ...] = ("flash_attn_4", "triton_short")


#: the head dims at which ``auto`` hands captured layers to ``triton_short`` when it resolves to a backend outside
#: :data:`GRAPH_BACKENDS` (FlashAttention-4 not installed, or not for this head dim): the dims at which
#: triton_short's forward and backward are checked against the reference on the GPU (tests/attn/test_attn_gpu.py
#: at 64 and 128, tests/attn/test_triton_short_gpu.py at 256, Qwen3.5's full-attention layers).
TRITON_SHORT_GRAPH_HEAD_DIMS: tuple[int, ...] = (64, 128, 256)


def _attention_spec(model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype, max_seqlen: int):
    from varpack.attn._base import CallSpec
    from varpack.models.registry import family_of

    config = family_of(model).text_config(model)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    head_dim = getattr(config, "head_dim", None) or (int(config.hidden_size) // heads if heads else 0)
    softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
    return CallSpec(
        device=torch.device(device), dtype=dtype, head_dim=int(head_dim), num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads), softcap=softcap,
        needs_grad=True, max_seqlen=int(max_seqlen),
    )  # fmt: skip


def attention_refusal(
    model: torch.nn.Module,
    *,
    backend: str,
    device: torch.device | str,
    dtype: torch.dtype,
    max_seqlen: int,
) -> str | None:
    """Why ``model``'s attention, resolved as a captured training layer resolves it, is not one of
    :data:`GRAPH_BACKENDS`, or ``None`` when it is.

    ``backend`` (``"auto"`` or a name) is resolved for the model's head sizes and logit softcap on ``device`` in
    ``dtype`` (the autocast dtype under mixed precision), causal, with gradients, for the static shape's
    ``max_seqlen`` bucket, skipping the backends without a backward through the custom op: what
    :func:`varpack.attn.custom_op.varlen_attention_op` resolves at trace time from the same facts (its head-dim,
    architecture and install checks included: ``auto`` on an H200 takes ``flex`` for a head dim below 64, which
    FA4's sm90 backward is not verified for). Sliding-window layers are not asked separately.

    Returns:
        ``None``, or the reason in words, naming the backend it resolved to (or why none resolved).
    """
    from varpack.attn._base import BackendUnavailableError
    from varpack.attn.custom_op import _no_op_backward
    from varpack.attn.registry import resolve_spec

    spec = _attention_spec(model, device, dtype, max_seqlen)
    try:
        resolved = resolve_spec(backend, spec, exclude=_no_op_backward(True, spec.softcap))
    except (BackendUnavailableError, ValueError) as exc:
        return f"attention {backend!r}: {exc}"
    name = str(resolved)
    if name in GRAPH_BACKENDS:
        return None
    return (
        f"attention {backend!r} resolves to {name} here (head dim {spec.head_dim}, {str(dtype).split('.')[-1]}): "
        f"captured layers need {' or '.join(GRAPH_BACKENDS)}"
    )


def graph_attention(
    model: torch.nn.Module,
    *,
    backend: str,
    device: torch.device | str,
    dtype: torch.dtype,
    max_seqlen: int,
) -> tuple[str, str | None, str | None]:
    """The attention backend ``model``'s captured layers run: ``backend`` itself when it resolves to one of
    :data:`GRAPH_BACKENDS` (:func:`attention_refusal`), else, for ``backend="auto"`` only, ``"triton_short"``
    when it runs this call and the head dim is one of :data:`TRITON_SHORT_GRAPH_HEAD_DIMS` (an H200 without
    FlashAttention-4: ``auto`` would take ``torch_varlen`` / ``sdpa``, which a captured layer cannot run). A
    backend named by the user is never replaced.

    Args:
        model, backend, device, dtype, max_seqlen: as :func:`attention_refusal`.

    Returns:
        ``(name, refusal, note)``: the backend for the captured layers; ``None`` or why no captured layer can run
        (:func:`attention_refusal`'s reason for ``backend``); ``None`` or, when ``"triton_short"`` stands in for
        ``auto``'s choice, the reason in words (for the ``speed`` line).
    """
    refusal = attention_refusal(model, backend=backend, device=device, dtype=dtype, max_seqlen=max_seqlen)
    if refusal is None or backend != "auto":
        return backend, refusal, None
    spec = _attention_spec(model, device, dtype, max_seqlen)
    if spec.head_dim not in TRITON_SHORT_GRAPH_HEAD_DIMS:
        return backend, refusal, None
    short = attention_refusal(model, backend="triton_short", device=device, dtype=dtype, max_seqlen=max_seqlen)
    if short is not None:
        return backend, refusal, None
    return "triton_short", None, f"attention triton_short in the captured layers ({refusal})"


#: Whether :func:`static_shape_for` (``varpack sft``, the TRL drop-in, ``benchmarks/train.py
#: --static-empty-pads auto``) gives static shapes zero-length pad segments where :func:`empty_pads_ok` allows
#: them: the row is then the longest pack itself (``T = 8,192`` at packing length 8,192, not ``8,320``). Exact on
#: the CPU backends (triton_short's kernels through Triton's interpreter) and in the captured step on a GPU
#: (tests/invariant/test_static_shapes.py
#: ``test_gpu_cuda_graph_layers_equal_eager[triton_short-fp32-empty_pads]``); the 8K step runs 67.7-67.8 ms
#: with them against 68.1-68.2 with pad segments of one token or more (benchmarks/RESULTS.md#sft-step).
EMPTY_PADS_BY_DEFAULT = True


def empty_pads_ok(model: torch.nn.Module, attn_backend: str) -> bool:
    """Whether a :class:`varpack.collate.StaticShape` for ``model`` may have zero-length pad segments
    (``empty_pads``): ``attn_backend`` is a named backend whose :class:`varpack.attn.Capabilities` have
    ``empty_segments`` (``triton_short``, the PyTorch backends; not FlashAttention-4, and not ``"auto"``, which
    chooses per call), and ``model`` has no recurrent (linear-attention or state-space) layer, whose kernels are
    not verified on such rows.

    Returns:
        ``True`` or ``False``; an unknown backend name or a model varpack cannot patch gives ``False``.
    """
    from varpack.attn.registry import get_backend
    from varpack.integrations.transformers import UnsupportedModelError, _linear_attention_layers

    try:
        if not get_backend(attn_backend).capabilities.empty_segments:
            return False
        return _linear_attention_layers(model) == 0
    except (ValueError, UnsupportedModelError):
        return False


def static_shape_for(
    plan: Any,
    model: torch.nn.Module,
    attn_backend: str,
    *,
    multiple_of: int | None = None,
    segments: int | None = None,
    empty_pads: bool | None = None,
) -> Any:
    """The :class:`varpack.collate.StaticShape` every pack of ``plan`` is padded to for ``model`` whose layers run
    ``attn_backend``: :meth:`StaticShape.from_plan` with ``empty_pads`` where wanted (``empty_pads``; ``None``:
    :data:`EMPTY_PADS_BY_DEFAULT`) and :func:`empty_pads_ok` allows it (then the row is the longest pack itself,
    rounded: ``T = 8,192`` instead of ``8,320`` at packing length 8,192), else pad segments of at least one token.

    Raises:
        ValueError: as :meth:`StaticShape.from_plan`. TypeError: ``empty_pads`` not a bool or None.
    """
    from varpack.collate import StaticShape

    if empty_pads is not None and not isinstance(empty_pads, bool):
        raise TypeError(f"empty_pads must be True, False or None, got {empty_pads!r}")
    want = EMPTY_PADS_BY_DEFAULT if empty_pads is None else empty_pads
    empty = want and empty_pads_ok(model, attn_backend)
    return StaticShape.from_plan(plan, multiple_of=multiple_of, segments=segments, empty_pads=empty)


def model_refusal(
    model: torch.nn.Module,
    *,
    autocast: bool = False,
    device: torch.device | str | None = None,
    gated_delta_backend: str | None = None,
) -> str | None:
    """Why ``model``'s decoder layers cannot run as CUDA graphs exactly, or ``None`` when they can.

    Args:
        model: a transformers model (before or after :func:`varpack.integrations.transformers.enable_varpack`).
        autocast: the step runs under bf16 / fp16 autocast (``--bf16``), so float32 weights are fine.
        device: the training device (default: CUDA when available); Gated DeltaNet layers' backend is resolved
            there.
        gated_delta_backend: the run's gated delta rule backend (``--gated-delta-backend``); default: each
            layer's own (set by ``enable_varpack``), else ``"auto"``.

    Returns:
        ``None``, or the reason in words, naming the model class: a vision-language model (the vision tower and
        mRoPE positions are not tested with static packs and captured layers); Mamba-2 mixers (host-built chunk
        layouts, a replayed graph would reuse the previous pack's); Gated DeltaNet layers whose rule does not
        resolve to ``fla_hybrid`` on ``device`` (:data:`GATED_DELTA_GRAPHS_REFUSAL`, with the backend it
        resolved to or why it cannot run); float32 training without autocast (no capturable varlen kernel has
        a float32 backward through varpack's op).
    """
    from varpack.models import is_vl_model

    name = type(model).__name__
    if is_vl_model(model):
        return f"a vision-language model ({name}): the vision tower and mRoPE positions are not tested with graphs"
    recurrent = _recurrent_refusal(model, device, gated_delta_backend)
    if recurrent is not None:
        return f"{name}: {recurrent}"
    dtype = next(model.parameters()).dtype
    if dtype == torch.float32 and not autocast:
        return (
            "float32 training: the captured layers need bf16 / fp16 attention (FlashAttention-4); "
            "--bf16 (mixed precision) or --dtype bfloat16 gets them"
        )
    return None


def compile_layers_as_graphs(
    model: torch.nn.Module,
    *,
    device: torch.device | str | None = None,
    what: str = "CUDA graphs",
    inductor_options: dict[str, Any] | None = None,
) -> int:
    """Compile every decoder layer of ``model`` (on varpack attention) for CUDA-graph replay
    (:func:`graph_compile_kw`; compiled lazily, at the first call). Returns the number of layers compiled.

    Args:
        model: the model.
        device: the device it will train on (a Trainer moves it there after this); default: its parameters'.
        what: the setting named in the error.
        inductor_options: inductor options in place of ``mode="reduce-overhead"`` (:func:`graph_compile_kw`;
            ``benchmarks/train.py --graphs-inductor-options``).

    Raises:
        ValueError: an unknown inductor option (:func:`graph_compile_kw`), or ``device`` is not CUDA
            (``"{what}: CUDA graphs need a CUDA device, the model is on cpu"``), or the model has Mamba-2 mixers,
            or Gated DeltaNet layers whose rule does not resolve to ``fla_hybrid`` on ``device``
            (:func:`model_refusal`'s reasons), nothing compiled;
            :func:`varpack.integrations.kernels.compile_layers`' refusals. Gated DeltaNet layers that pass are
            marked to trace without CPU offsets (``fla_hybrid`` builds its chunk tables on the device).
    """
    from varpack.integrations.kernels import compile_layers

    compile_kw = graph_compile_kw(inductor_options)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"{what}: CUDA graphs need a CUDA device, the model is on {device}")
    recurrent = _recurrent_refusal(model, device)
    if recurrent is not None:
        raise ValueError(f"{what} with {type(model).__name__}: {recurrent}")
    from varpack.models.registry import is_gated_delta_layer

    for module in model.modules():  # read by the traced Gated DeltaNet forward: no CPU offsets in the graph
        if is_gated_delta_layer(module):
            module._varpack_static_boundaries = True
    return compile_layers(model, **compile_kw)


def boundaries_on_device(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """``batch`` (a model input dict) with its ``varlen_meta`` on ``device`` (:meth:`VarlenMeta.on_device`: one
    copy of the offsets per batch, kept by the batch's meta) and ``cu_seq_lens_q/k`` / ``max_length_q/k`` as
    that meta's views. A batch without a meta is returned unchanged; other tensors are left where they are.
    Returns a new dict (``batch`` is not changed)."""
    meta = batch.get(VARLEN_META)
    if meta is None:
        return batch
    moved = meta.on_device(device)
    out = {k: v for k, v in batch.items() if k not in FLASH_ATTN_KWARGS}
    out[VARLEN_META] = moved
    out.update(moved.flash_attn_kwargs())
    return out


def begin_step() -> None:
    """A new step of the CUDA-graph trees begins (``torch.compiler.cudagraph_mark_step_begin()``): call it
    before every training forward; the previous step's graph outputs may be overwritten after it."""
    torch.compiler.cudagraph_mark_step_begin()


@contextlib.contextmanager
def capture_or_error() -> Iterator[None]:
    """Inside it, a graph inductor would run eagerly instead of capturing raises (inductor's
    ``triton.cudagraph_or_error``), where this torch has the option; else nothing changes and
    :func:`cudagraph_skips` still counts the skipped graphs."""
    from torch._inductor import config as inductor_config

    if not hasattr(inductor_config.triton, "cudagraph_or_error"):
        yield
        return
    with inductor_config.patch({"triton.cudagraph_or_error": True}):
        yield


def cudagraph_skips() -> int:
    """Graphs inductor ran without a CUDA graph so far in this process (``counters["inductor"]``)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])
