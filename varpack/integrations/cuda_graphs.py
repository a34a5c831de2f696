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
Embedding, final norm, the loss and the optimizer stay eager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from varpack.schema import FLASH_ATTN_KWARGS, VARLEN_META

__all__ = [
    "GATED_DELTA_GRAPHS_REFUSAL",
    "GRAPH_BACKENDS",
    "GRAPH_COMPILE_KW",
    "MAMBA2_GRAPHS_REFUSAL",
    "attention_refusal",
    "begin_step",
    "boundaries_on_device",
    "capture_or_error",
    "compile_layers_as_graphs",
    "cudagraph_skips",
    "model_refusal",
]

#: Why CUDA-graph layers are refused for a model with Gated DeltaNet layers, read from the backends' code.
#: Replaying a captured graph re-runs its kernel launches with the grids, loop counts and host-built index
#: tensors of the pack it was captured on; neither gated delta rule backend launches from device-only
#: boundaries with a static grid: ``chunk`` runs a Python loop over chunk steps whose count and per-step
#: batch sizes come from a CPU chunk layout (varpack.ops.gated_delta_rule.chunk.prepare_chunk_layout), and
#: ``fla_hybrid`` launches fla's kernels over ``NT`` chunks from fla's ``prepare_chunk_indices`` /
#: ``prepare_chunk_offsets`` (built from the CPU offsets) and its dq/dk step over a CPU-built plan
#: (varpack.ops.gated_delta_rule.fla_hybrid.dqkwg_plan: grid ``NT``, one launch per padded chunk size).
GATED_DELTA_GRAPHS_REFUSAL = (
    "its recurrent mixers (Gated DeltaNet) are not replay-safe: a replayed CUDA graph re-runs the kernel "
    "launches captured for one pack (grids, loop counts, host-built chunk indices), and both gated delta rule "
    "backends size their launches from boundaries read on the host (chunk: the CPU chunk layout's steps; "
    "fla_hybrid: fla's chunk indices / offsets and the dq/dk plan, grid = the pack's chunk count), so the next "
    "pack would be computed with the captured pack's segmentation. Without CUDA graphs, compiled layers "
    "(compile_layers(model, custom_ops=True)) trace the whole Gated DeltaNet layer without a graph break"
)
#: Why CUDA-graph layers are refused for a model with Mamba-2 mixers.
MAMBA2_GRAPHS_REFUSAL = (
    "its recurrent mixers (Mamba-2) are graph breaks in a compiled layer (the SSD chunk layout is built on the "
    "host per pack), and CUDA-graph layers are compiled whole (fullgraph)"
)


def _recurrent_refusal(model: torch.nn.Module) -> str | None:
    """:data:`GATED_DELTA_GRAPHS_REFUSAL` / :data:`MAMBA2_GRAPHS_REFUSAL` for a model with those mixers."""
    from varpack.models.mamba2 import is_mamba2_mixer
    from varpack.models.registry import is_gated_delta_layer

    if any(is_gated_delta_layer(m) for m in model.modules()):
        return GATED_DELTA_GRAPHS_REFUSAL
    if any(is_mamba2_mixer(m) for m in model.modules()):
        return MAMBA2_GRAPHS_REFUSAL
    return None


#: :func:`varpack.integrations.kernels.compile_layers` keywords of CUDA-graph layers: attention as the custom op
#: inside the layer's graph (``custom_ops``), no graph break allowed (``fullgraph``), one static shape
#: (``dynamic=False``), CUDA-graph trees (``mode="reduce-overhead"``).
GRAPH_COMPILE_KW: dict[str, Any] = {
    "custom_ops": True,
    "fullgraph": True,
    "dynamic": False,
    "mode": "reduce-overhead",
}


#: the attention backends a captured layer runs: they launch without reading ``cu_seqlens`` on the host and have a
#: backward through varpack's custom op (tests/invariant/test_static_shapes.py's GPU test captures both)
GRAPH_BACKENDS: tuple[str, ...] = ("flash_attn_4", "triton_short")


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
    from varpack.attn._base import BackendUnavailableError, CallSpec
    from varpack.attn.custom_op import _no_op_backward
    from varpack.attn.registry import resolve_spec
    from varpack.models.registry import family_of

    config = family_of(model).text_config(model)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    head_dim = getattr(config, "head_dim", None) or (int(config.hidden_size) // heads if heads else 0)
    softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
    spec = CallSpec(
        device=torch.device(device), dtype=dtype, head_dim=int(head_dim), num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads), softcap=softcap,
        needs_grad=True, max_seqlen=int(max_seqlen),
    )  # fmt: skip
    try:
        resolved = resolve_spec(backend, spec, exclude=_no_op_backward(True, softcap))
    except (BackendUnavailableError, ValueError) as exc:
        return f"attention {backend!r}: {exc}"
    name = str(resolved)
    if name in GRAPH_BACKENDS:
        return None
    return (
        f"attention {backend!r} resolves to {name} here (head dim {int(head_dim)}, {str(dtype).split('.')[-1]}): "
        f"captured layers need {' or '.join(GRAPH_BACKENDS)}"
    )


def model_refusal(model: torch.nn.Module, *, autocast: bool = False) -> str | None:
    """Why ``model``'s decoder layers cannot run as CUDA graphs exactly, or ``None`` when they can.

    Args:
        model: a transformers model (before or after :func:`varpack.integrations.transformers.enable_varpack`).
        autocast: the step runs under bf16 / fp16 autocast (``--bf16``), so float32 weights are fine.

    Returns:
        ``None``, or the reason in words, naming the model class: a vision-language model (the vision tower and
        mRoPE positions are not tested with static packs and captured layers); recurrent mixers (Gated DeltaNet /
        Mamba-2: host-built chunk layouts, a replayed graph would reuse the previous pack's); float32 training
        without autocast (no capturable varlen kernel has a float32 backward through varpack's op).
    """
    from varpack.models import is_vl_model
    from varpack.models.registry import family_of

    name = type(model).__name__
    if is_vl_model(model):
        return f"a vision-language model ({name}): the vision tower and mRoPE positions are not tested with graphs"
    recurrent = _recurrent_refusal(model)
    if recurrent is not None or family_of(model).linear_layers(model):
        return f"{name}: {recurrent or GATED_DELTA_GRAPHS_REFUSAL}"
    dtype = next(model.parameters()).dtype
    if dtype == torch.float32 and not autocast:
        return (
            "float32 training: the captured layers need bf16 / fp16 attention (FlashAttention-4); "
            "--bf16 (mixed precision) or --dtype bfloat16 gets them"
        )
    return None


def compile_layers_as_graphs(
    model: torch.nn.Module, *, device: torch.device | str | None = None, what: str = "CUDA graphs"
) -> int:
    """Compile every decoder layer of ``model`` (on varpack attention) for CUDA-graph replay
    (:data:`GRAPH_COMPILE_KW`; compiled lazily, at the first call). Returns the number of layers compiled.

    Args:
        model: the model.
        device: the device it will train on (a Trainer moves it there after this); default: its parameters'.
        what: the setting named in the error.

    Raises:
        ValueError: ``device`` is not CUDA (``"{what}: CUDA graphs need a CUDA device, the model is on cpu"``),
            or the model has Gated DeltaNet / Mamba-2 layers (:data:`GATED_DELTA_GRAPHS_REFUSAL`), nothing
            compiled; :func:`varpack.integrations.kernels.compile_layers`' refusals.
    """
    from varpack.integrations.kernels import compile_layers

    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"{what}: CUDA graphs need a CUDA device, the model is on {device}")
    recurrent = _recurrent_refusal(model)
    if recurrent is not None:
        raise ValueError(f"{what} with {type(model).__name__}: {recurrent}")
    return compile_layers(model, **GRAPH_COMPILE_KW)


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
