"""Step-time options outside attention: Liger-Kernel's fused layers and regional ``torch.compile``.

The profile of a packed SFT step (benchmarks/profile_step.py, benchmarks/RESULTS.md#sft-step) shows that once samples are packed, most of a
small model's step is spent outside attention: in many small element-wise kernels (RMSNorm, RoPE, SiLU·mul,
casts, residual adds) and in the host time to launch them. Two well-kept remedies, both leaving varpack's
boundaries untouched: ``varpack sft --use-liger-kernel`` (opt-in) and ``--torch-compile`` (``auto`` by default:
on for a CUDA run, one process, DDP or FSDP2, :func:`varpack.train.config.resolve_torch_compile`):

* :func:`apply_liger_kernels` swaps a model's RMSNorm, RoPE and SwiGLU MLP for Liger-Kernel's fused Triton
  kernels (``liger_kernel.transformers._apply_liger_kernel_to_instance``; Hsu et al., "Liger Kernel: Efficient
  Triton Kernels for LLM Training", 2024). These layers act on each token alone (RoPE reads the token's own
  ``position_ids``, which restart per sample), so packing cannot leak through them. The loss stays varpack's
  (:mod:`varpack.loss` / :mod:`varpack.ops.linear_ce`): Liger's own loss patches are not applied.
* :func:`compile_layers` compiles every decoder layer with ``torch.compile`` ("regional compilation", the
  PyTorch recipe for repeated blocks: one compiled graph reused by every layer). varpack's attention function
  is a graph break (``torch.compiler.disable``): the varlen kernel runs eagerly with the batch's Python-int
  ``max_seqlen`` and its once-per-batch device copy of ``cu_seqlens``, and is never traced or specialised;
  with ``custom_ops=True`` attention and Gated DeltaNet mixers are traced as custom ops instead (no break).
  ``dynamic=True`` by default, so packs of different lengths and sample counts reuse one graph; layers are
  traced without duck sizing, so a pack whose sizes happen to equal a model width does not specialise it.

Both keep packed == unpacked (tests/invariant/test_compile_and_liger.py, with a negative control); neither changes the attention
backend ``auto`` picks. They are exclusive: :data:`LIGER_COMPILE_REFUSAL` says why.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "DYNAMIC_INDUCTOR_OPTIONS",
    "LIGER_COMPILE_REFUSAL",
    "apply_liger_kernels",
    "compile_layers",
    "decoder_layers",
    "dynamic_inductor_options",
    "liger_available",
]

#: Why Liger's layers and regional ``torch.compile`` are refused together. Seen on the H200 (torch 2.11,
#: Triton 3.6, liger-kernel 0.8.5): dynamo fails while tracing Liger's ``autograd.Function`` s inside a
#: compiled decoder layer (``AssertionError`` in ``torch/_dynamo/variables/higher_order_ops.py``). Running them
#: as graph breaks instead would split every layer into ~7 graphs. Inductor already fuses RMSNorm, RoPE and
#: SwiGLU into its own Triton kernels, and varpack's fused loss (``loss_impl="linear_ce"``) uses Liger's fused
#: linear cross-entropy on CUDA either way, so one of the two options is enough.
LIGER_COMPILE_REFUSAL = (
    "Liger-Kernel layers and torch.compile are not combined: dynamo cannot trace Liger's autograd functions "
    "inside a compiled layer (torch 2.11 / liger-kernel 0.8.5, AssertionError in dynamo's higher_order_ops). "
    "Choose one: torch_compile (--torch-compile; inductor fuses RMSNorm / RoPE / SwiGLU itself) or "
    "use_liger_kernel (--use-liger-kernel)"
)


def liger_available() -> bool:
    """True when ``liger_kernel`` is importable (``pip install liger-kernel``; its kernels need a CUDA GPU)."""
    return importlib.util.find_spec("liger_kernel") is not None


def _liger_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("liger-kernel")
    except PackageNotFoundError:
        return "?"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers model, in order: its family's answer
    (:meth:`varpack.models.ModelFamily.decoder_layers`: modules whose class name ends in ``DecoderLayer``,
    ``Qwen3DecoderLayer``, ``LlamaDecoderLayer``, ``Qwen3_5DecoderLayer``, ...)."""
    from varpack.models.registry import family_of

    return family_of(model).decoder_layers(model)


def apply_liger_kernels(
    model: torch.nn.Module, *, rope: bool = True, rms_norm: bool = True, swiglu: bool = True
) -> list[str]:
    """Replace RMSNorm / RoPE / SwiGLU of ``model`` (in place) by Liger-Kernel's fused Triton kernels.

    Args:
        model: a transformers model of a family Liger supports (``config.model_type`` in Liger's
            ``MODEL_TYPE_TO_APPLY_LIGER_FN``: llama, qwen2, qwen3, mistral, gemma, ...), on a CUDA device
            when run.
        rope / rms_norm / swiglu: which layers to replace.

    Returns:
        The names of the replaced layer kinds (e.g. ``["rope", "rms_norm", "swiglu"]``).

    Raises:
        ImportError: ``liger_kernel`` is not installed (``pip install liger-kernel``).
        ValueError: Liger has no kernels for this ``model_type`` (nothing would be replaced: refused rather
            than silently training without them), or its patch fails for this model (Liger-Kernel 0.8.5 has no
            RoPE for Qwen3.5 and does not import against transformers 5.24's Qwen3-VL), or its layers are
            already compiled by :func:`compile_layers` (:data:`LIGER_COMPILE_REFUSAL`).

    Note: Liger patches RoPE at module level (``modeling_<family>.apply_rotary_pos_emb``), so every model of
    that family built later in the process uses it too. Liger's loss patches are never applied here.
    """
    if getattr(model, "_varpack_compiled", None):
        raise ValueError(LIGER_COMPILE_REFUSAL)
    if not liger_available():
        raise ImportError("liger_kernels needs Liger-Kernel: pip install liger-kernel")
    from liger_kernel.transformers.monkey_patch import (
        MODEL_TYPE_TO_APPLY_LIGER_FN,
        _apply_liger_kernel_to_instance,
    )

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(
            f"Liger-Kernel has no kernels for model_type {model_type!r} ({type(model).__name__}); "
            f"supported: {sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)}"
        )
    kinds = {"rope": rope, "rms_norm": rms_norm, "swiglu": swiglu}
    try:
        _apply_liger_kernel_to_instance(
            model=model, cross_entropy=False, fused_linear_cross_entropy=False, **kinds
        )
    except (NotImplementedError, ImportError, AttributeError) as exc:
        # e.g. liger-kernel 0.8.5: "liger_rotary_pos_emb is not available for Qwen3_5 models", or a name
        # missing from the installed transformers (Qwen3-VL on transformers 5.24)
        raise ValueError(
            f"Liger-Kernel {_liger_version()} cannot patch {type(model).__name__} (model_type {model_type!r}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    model._varpack_liger = [k for k, v in kinds.items() if v]
    return model._varpack_liger


def _without_duck_shapes(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` (a layer's ``torch.compile``'d call) run with duck shaping off while dynamo traces it.

    With duck shaping (torch's default) two input sizes that happen to be equal when a frame is first traced
    share one symbol, and the graph is guarded on their equality. A pack's sizes are arbitrary: its token
    count ``T`` or its ``cu_seq_lens_q`` length ``N + 1`` can equal a model width (head count, head dim,
    the 4 planes of VL ``position_ids``) in one pack and not in the next, which then recompiled every layer
    (past ``torch._dynamo.config.recompile_limit`` a frame runs eagerly). Off, every dynamic size gets its own
    symbol, so one graph serves every pack. ``use_duck_shape`` is read when a frame is traced (the layer and the frames
    resumed after its graph breaks, all inside this call), so the patch is scoped to the layer's calls.
    """
    from torch.fx.experimental import _config as fx_config

    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # inlined into an outer compile: its settings apply
            return compiled(*args, **kwargs)
        duck = fx_config.use_duck_shape  # set and restored directly: a few us per call, less than .patch()
        fx_config.use_duck_shape = False
        try:
            return compiled(*args, **kwargs)
        finally:
            fx_config.use_duck_shape = duck

    return call


#: inductor options of a layer compiled for dynamic shapes (:func:`dynamic_inductor_options`)
DYNAMIC_INDUCTOR_OPTIONS = {"triton.mix_order_reduction_non_strict_mode": True}


def dynamic_inductor_options(backend: str, dynamic: bool | None, compile_kw: dict[str, Any]) -> dict[str, Any]:
    """``compile_kw`` with the inductor options that keep one graph for packs of every token count ``T``.

    Inductor's mix-order reduction (GPU / Triton only: it fuses a reduction over the hidden size with one over
    the tokens, as in an RMSNorm backward, whose graph AOTAutograd compiles with the forward for symbolic
    sizes) decides by size thresholds on the token count and guards on them: ``5242880 <= T * D``,
    ``2 * D <= T``, ``4096 <= T``. A first pack of 8192 tokens then recompiles every layer for the first pack
    under the thresholds. ``triton.mix_order_reduction_non_strict_mode`` skips those size checks (the fusion is
    decided by the graph's structure alone), so no guard on ``T`` is added. Added for ``backend="inductor"``
    with ``dynamic`` not ``False`` and no ``mode`` (torch takes ``mode`` or ``options``, not both), where this
    torch has the option; options the caller gives win.

    Returns:
        A new dict: ``compile_kw`` with ``options`` completed, or ``compile_kw`` unchanged.
    """
    if backend != "inductor" or dynamic is False or "mode" in compile_kw:
        return dict(compile_kw)
    from torch._inductor import config as inductor_config

    wanted = {
        key: value
        for key, value in DYNAMIC_INDUCTOR_OPTIONS.items()
        if hasattr(getattr(inductor_config, key.split(".")[0], None), key.split(".")[1])
    }
    if not wanted:
        return dict(compile_kw)
    return {**compile_kw, "options": {**wanted, **(compile_kw.get("options") or {})}}


def compile_layers(
    model: torch.nn.Module,
    *,
    backend: str = "inductor",
    dynamic: bool | None = True,
    custom_ops: bool = False,
    **compile_kw: Any,
) -> int:
    """``torch.compile`` every decoder layer of ``model`` in place (``nn.Module.compile``).

    Args:
        model: a transformers model already switched to varpack attention
            (:func:`varpack.integrations.transformers.enable_varpack`): its attention call is a graph break.
        backend: ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` traces without code generation,
            which the CPU tests use).
        dynamic: ``True`` (default) compiles for symbolic token counts once, so packs of every length reuse
            the graph (traced without duck sizing: see :func:`_without_duck_shapes`; with inductor's
            size-threshold guards of mix-order reductions off: see :func:`dynamic_inductor_options`); ``None``
            lets torch decide after the first recompilation.
        custom_ops: ``False`` (default): varpack attention is a graph break in every layer. ``True``: it is
            traced as the ``varpack::varlen_attention`` custom op (:mod:`varpack.attn.custom_op`), one node
            of the layer's graph, so a dense decoder layer compiles whole (``fullgraph=True`` works). The
            backend is then resolved at trace time and CPU ``cu_seqlens`` are copied to the device in each
            layer's graph; gradients: native FA4 backward, recomputation for the PyTorch backends, none
            for FA2 / FA3 (:func:`varpack.attn.custom_op.op_backward_kind`). A Gated DeltaNet mixer's packed
            call is then traced whole too (:mod:`varpack.integrations.gated_delta`): projections, the short
            convolution (segment index computed in the graph from the meta's offsets), gates, the rule as the
            ``varpack::gated_delta_rule`` custom op (q/k l2norm inside), output gate + RMSNorm; its ``chunk``
            / ``fla_hybrid`` plan is built on the host from the meta's CPU offsets inside the op, once per
            batch (no device sync). So a Qwen3.5 / Qwen3-Next layer compiles with ``fullgraph=True`` and one
            graph serves every pack (tests/invariant/test_compiled_gated_delta.py). Without ``custom_ops`` the
            mixer is a graph break, as attention. Unpacked, cached or context-parallel mixer calls stay graph
            breaks either way.
        **compile_kw: passed to ``torch.compile`` (``mode``, ``fullgraph=False`` ...). CUDA graphs per layer:
            ``custom_ops=True, dynamic=False, mode="reduce-overhead"`` on static-shape packs
            (:class:`varpack.collate.StaticShape`) whose boundaries are on the device
            (:meth:`varpack.varlen.VarlenMeta.on_device`: inductor does not capture a graph with CPU inputs),
            with ``torch.compiler.cudagraph_mark_step_begin()`` before each step's forward; the attention
            backend must launch without host reads (``flash_attn_4``, ``triton_short``: the GPU test of
            tests/invariant/test_static_shapes.py checks both; the per-segment PyTorch
            backends read the offsets). ``benchmarks/train.py``'s ``varpack_lce_static_graphs`` runs it. Gated
            DeltaNet models only through :func:`varpack.integrations.cuda_graphs.compile_layers_as_graphs` (it marks
            their mixers to pass no CPU offsets; ``fla_hybrid`` then builds its chunk tables on the device).

    Returns:
        The number of layers compiled.

    Raises:
        ValueError: the model has no ``*DecoderLayer`` modules, or its attention is not varpack's (a compiled
            layer would otherwise trace whatever attention it has, masks included, unchecked by varpack), or
            Liger-Kernel's layers are on it (:func:`apply_liger_kernels`; :data:`LIGER_COMPILE_REFUSAL`).
    """
    from varpack.integrations.transformers import is_varpack_attention

    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not is_varpack_attention(impl):
        raise ValueError(
            f"compile_layers needs a model on varpack attention (enable_varpack first); {type(model).__name__} "
            f"uses {impl!r}"
        )
    if getattr(model, "_varpack_liger", None):
        raise ValueError(LIGER_COMPILE_REFUSAL)
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no *DecoderLayer modules to compile")
    for layer in layers:
        for module in layer.modules():  # read by varpack_attention_forward (its `module` argument)
            module._varpack_custom_op = bool(custom_ops)
        layer.compile(backend=backend, dynamic=dynamic, **dynamic_inductor_options(backend, dynamic, compile_kw))
        layer._compiled_call_impl = _without_duck_shapes(layer._compiled_call_impl)
    model._varpack_compiled = {
        "backend": backend, "dynamic": dynamic, "layers": len(layers), "custom_ops": bool(custom_ops)
    }
    return len(layers)
