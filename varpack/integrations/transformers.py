"""Hugging Face ``transformers`` integration: varpack's varlen attention as an attention implementation.

:func:`enable_varpack` registers an attention function in transformers' ``AttentionInterface`` (name
``"varpack"`` for ``backend="auto"``, ``"varpack_<backend>"`` for a forced backend), switches the model to it
with ``model.set_attn_implementation``, patches linear-attention (gated-delta) layers through
:mod:`varpack.integrations.gated_delta` and Mamba-2 mixers through :mod:`varpack.integrations.mamba2`, and
installs a forward pre-hook on the base model (``model.base_model``, which every forward path reaches with the
same keywords) that refuses every batch that would reach a path mixing samples. Where the top model is not
the base model, a pre-hook on it hands a packed call's boundaries to the base model's guard for the call:
a top forward that drops them (Mamba2ForCausalLM calls its backbone with named arguments only) gets them
back, or is refused where it dropped the positions too.

How a packed batch flows (ARCHITECTURE.md, "Collated batch"): the collator emits ``cu_seq_lens_q/k``
(``[N+1]`` int32) and ``max_length_q/k`` (Python ints), transformers' ``FlashAttentionKwargs`` names, so every
HF model forwards them unchanged through ``**kwargs`` to each attention layer. The varpack attention function
reads them and calls :func:`varpack.attn.varlen_attention` on the flat ``[T, H, D]`` stream: the boundaries
are computed once per batch on the CPU and never re-derived per layer, and no layer reads a tensor value back
to the host. No ``[T, T]`` mask is ever built: the name is deliberately *not* registered in transformers'
``AttentionMaskInterface``, so ``create_causal_mask`` takes its documented early exit for custom attention
("we don't need a mask") and returns ``None``, which also skips transformers' packed-sequence detection from
``position_ids`` (a host sync per mask). Without boundary kwargs each row of the batch is one causal sequence
(the ordinary unpacked path, e.g. generation).

Guards (raised as ``ValueError`` from the pre-hook, once per forward, from shapes and CPU-side values only):

* boundary kwargs with a batch of B > 1 rows, with an ``attention_mask``, with a KV cache or
  ``use_cache=True``, without ``position_ids``, with a ``max_length_*`` that is not a host integer (a device
  tensor, a float, a bool: :func:`varpack.varlen.normalize_max_seqlen`), with ``cu_seq_lens_*`` that are not
  integer offsets ``[N+1]`` (:func:`varpack.varlen.normalize_cu_seqlens`; a list or NumPy array is converted
  once to a CPU int32 tensor) or that do not cover the row;
* ``position_ids`` that restart inside a row (several samples) but no boundary kwargs;
* a packed batch reaching a model whose attention implementation is no longer varpack's (sdpa/eager);
* an ``attention_mask`` with padding (varpack attention is padding-free);
* a model with linear-attention layers that :mod:`varpack.integrations.gated_delta` /
  :mod:`varpack.integrations.mamba2` cannot patch, or with stateful sequence layers varpack does not know
  (Mamba-1 mixers, short convolutions), named with their module path.

Transformers APIs relied on (identical in 5.17 and 5.24): ``AttentionInterface.register`` and
``PreTrainedModel.set_attn_implementation``; the attention-function call convention
``fn(module, query [B, H, T, D], key, value, attention_mask, *, dropout, scaling, sliding_window, softcap,
is_causal, **kwargs) -> (out [B, T, H, D], None)``; ``FlashAttentionKwargs`` names; the early exit of
``masking_utils._preprocess_mask_arguments`` for implementations absent from
``AttentionMaskInterface._global_mapping``; the cache keyword is ``past_key_values`` (5.17) or ``cache``
(5.24, with ``past_key_values`` deprecated): both are checked.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from varpack.integrations.context_parallel import bind_shard
from varpack.models.registry import (
    GENERIC,
    family_of,
    is_gated_delta_layer,
    require_gated_delta_layers,
    unrecognised_module_classes,
)
from varpack.schema import BOUNDARY_KEYS, CP_SHARD, FLASH_ATTN_KWARGS, MEDIA_FIELDS, POSITION_IDS, VARLEN_META
from varpack.varlen.boundaries import normalize_cu_seqlens, normalize_max_seqlen
from varpack.varlen.meta import VarlenMeta, varlen_meta_from_kwargs

__all__ = [
    "ATTN_IMPLEMENTATION",
    "IMPLEMENTED_ATTENTION_KWARGS",
    "NEUTRAL_ATTENTION_KWARGS",
    "PackingGuardError",
    "UnsupportedModelError",
    "attention_dropout_settings",
    "attn_implementation_name",
    "autocast_qkv",
    "enable_varpack",
    "is_varpack_attention",
    "refuse_attention_dropout",
    "refuse_unimplemented_kwargs",
    "register_varpack_attention",
    "varpack_attention_forward",
]

#: The attention implementation name of ``backend="auto"``.
ATTN_IMPLEMENTATION = "varpack"

_CACHE_KEYS = ("past_key_values", "cache")
#: config keys of an attention-dropout probability in transformers' configs (``attention_dropout`` most,
#: ``attention_probs_dropout_prob`` BERT-style, ``attn_pdrop`` GPT-2 / CodeGen / DBRX, ``attn_dropout``,
#: ``attention_dropout_rate``, ``attn_drop_rate``)
_ATTENTION_DROPOUT_KEY = re.compile(r"^(attention|attn)(_probs)?_(dropout|pdrop|drop)(_prob|_rate)?$")
#: implementation name -> backend name, for every name registered by this module.
_REGISTERED: dict[str, str] = {}
#: layer types of ``config.layer_types`` that varpack handles ("hybrid": a Mamba-2 mixer beside or after
#: attention, Falcon-H1 / Zamba2; "moe" / "mlp": Nemotron-H's per-token blocks; "chunked_attention": Llama 4's
#: chunked layers, run as per-sample chunks).
_KNOWN_LAYER_TYPES = {
    "full_attention", "sliding_attention", "linear_attention", "hybrid", "moe", "mlp", "chunked_attention"
}  # fmt: skip
#: layer types holding a recurrent mixer (Gated DeltaNet or Mamba-2) that must be patched
_RECURRENT_LAYER_TYPES = ("linear_attention", "hybrid")
#: class-name fragments of linear-attention mixers other than Gated DeltaNet / Mamba-2 (named in refusals)
_LINEAR_MIXER_FRAGMENTS = ("DeltaAttention", "LightningAttention", "LinearAttention", "DeltaNet", "LinearAttn")
#: module class-name fragments of stateful sequence mixers that would leak across packed samples.
_UNSUPPORTED_MIXERS = ("Mamba", "ShortConv", "RWKV", "Rwkv", "Retention", "LSTM", "RecurrentBlock", "Rglru")
#: config fields of MoE routing with an expert capacity (tokens over it are dropped), refused when set
CAPACITY_LIMIT_FIELDS = ("expert_capacity", "capacity_factor", "moe_capacity_factor", "moe_token_dropping")


class PackingGuardError(ValueError):
    """A batch would reach an attention path that mixes samples (or a model varpack cannot run exactly)."""


class UnsupportedModelError(PackingGuardError):
    """A model, one of its layers or one of its attention calls uses a feature varpack does not run exactly
    (attention sinks before their support, a stateful mixer, a layer type, a keyword); raised before that
    feature computes anything.

    Attributes:
        feature: the feature's short name (``"attention keyword s_aux"``, ``"layer type chunked_attention"``),
            what the model zoo records as ``refused: <feature>``.
        applicable: ``False`` when packing does not apply to such a model at all (an encoder-decoder): the zoo
            records ``not applicable: <feature>``.
    """

    def __init__(self, message: str, *, feature: str, applicable: bool = True) -> None:
        super().__init__(message)
        self.feature = feature
        self.applicable = applicable


#: keywords transformers' decoder layers hand to every attention function that carry no attention math: the
#: positions were applied to q and k before the call (RoPE), the rest are flags of the model's outputs and cache
#: (the packing guard sets ``use_cache=False``) or the loss's token count. Read off the attention call sites of
#: transformers 5.24 (``grep -rn "attention_interface(" transformers/models``) and the kwargs of every causal
#: LM of the model zoo (docs/MODELS.md).
NEUTRAL_ATTENTION_KWARGS: frozenset[str] = frozenset(
    {POSITION_IDS, "use_cache", "cache_position", "output_router_logits", "output_hidden_states",
     "num_items_in_batch", "return_dict"}
)  # fmt: skip
#: model-feature keywords varpack attention implements: ``{keyword: varlen_attention's argument}`` (``s_aux``:
#: GPT-OSS's learned per-head attention sinks, ``[H]``)
IMPLEMENTED_ATTENTION_KWARGS: dict[str, str] = {"s_aux": "sinks"}
#: flags varpack attention honours only when off: ``{keyword: what it would ask for}``
_OFF_ONLY_KWARGS = {"output_attentions": "attention weights (varpack attention returns none)"}
#: what the keywords seen at transformers' attention call sites that varpack does not implement are, for messages
_KWARG_FEATURES = {
    "s_aux": "attention sinks (a learned per-head logit in the softmax)",
    "sinks": "attention sinks (a learned per-head logit in the softmax)",
    "position_bias": "an additive relative position bias",
    "indices": "sparse attention (selected key indices)",
    "block_indices": "block-sparse attention (selected key blocks)",
    "encoder_hidden_states": "cross-attention on encoder states",
    "cross_attention_mask": "cross-attention",
}


def attention_dropout_settings(config: Any) -> dict[str, float]:
    """``{key: p}`` of the attention-dropout probabilities above 0 that ``config`` (a transformers config, or a
    model: its ``config``) sets, its ``text_config`` included as ``text_config.<key>``; ``{}`` when there are
    none. Keys: transformers' names for it (:data:`_ATTENTION_DROPOUT_KEY`)."""
    config = getattr(config, "config", config)
    found: dict[str, float] = {}
    for prefix, cfg in (("", config), ("text_config.", getattr(config, "text_config", None))):
        if cfg is None or cfg is config and prefix:
            continue
        for key, value in vars(cfg).items():
            if _ATTENTION_DROPOUT_KEY.match(key) and isinstance(value, (int, float)) and value > 0:
                found[prefix + key] = float(value)
    return found


def refuse_attention_dropout(model: Any, what: str) -> None:
    """Raise before training when ``model``'s config sets attention dropout, which varpack attention does not
    implement (the model passes it only in training mode, so an evaluation or ``varpack check`` runs).

    Raises:
        ValueError: ``"{what}: varpack attention has no attention dropout; GPT2Config sets attn_pdrop=0.1: set
            it to 0.0 ..."`` naming every such key (:func:`attention_dropout_settings`).
    """
    found = attention_dropout_settings(model)
    if found:
        config = getattr(model, "config", model)
        settings = ", ".join(f"{k}={v:g}" for k, v in found.items())
        raise ValueError(
            f"{what}: varpack attention has no attention dropout; {type(config).__name__} sets {settings}: set "
            f"{'it' if len(found) == 1 else 'them'} to 0.0 in the model's config.json, or "
            f"model.config.{next(iter(found))} = 0.0 before training"
        )


def refuse_unimplemented_kwargs(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse every attention keyword varpack attention does not implement, before anything is computed.

    Accepted: the boundary keys (:data:`varpack.schema.BOUNDARY_KEYS`, and the context-parallel shard
    ``cp_shard`` the packing guard binds), :data:`NEUTRAL_ATTENTION_KWARGS`,
    :data:`IMPLEMENTED_ATTENTION_KWARGS` (attention sinks), ``output_attentions`` when false, and any keyword
    whose value is ``None`` (the feature is off for this call:
    GPT-OSS-style layers pass ``s_aux=None`` when a model has no sinks).

    Raises:
        UnsupportedModelError: naming the module class, each refused keyword and (when known) its feature.
    """
    refused = []
    for key, value in kwargs.items():
        if value is None or key in BOUNDARY_KEYS or key == CP_SHARD or key in NEUTRAL_ATTENTION_KWARGS:
            continue
        if key in IMPLEMENTED_ATTENTION_KWARGS:
            continue
        if key in _OFF_ONLY_KWARGS:
            if not value:
                continue
            refused.append(f"{key}={value!r} ({_OFF_ONLY_KWARGS[key]})")
            continue
        what = _KWARG_FEATURES.get(key)
        refused.append(f"{key}" + (f" ({what})" if what else ""))
    if refused:
        names = [r.split(" ", 1)[0].split("=", 1)[0] for r in refused]
        raise UnsupportedModelError(
            f"{type(module).__name__} passed attention keyword(s) {', '.join(refused)} that varpack attention "
            "does not implement; running without them would change the model's output, so it is refused",
            feature="attention keyword " + ", ".join(names),
        )


# ---------------------------------------------------------------------------------------------------------
# the attention function
# ---------------------------------------------------------------------------------------------------------
def _window(sliding_window: int | None, causal: bool) -> tuple[int, int]:
    """transformers' ``sliding_window=W`` (a query sees the W most recent keys, itself included:
    ``kv_idx > q_idx - W`` in masking_utils.sliding_window_overlay) as flash-attn's ``(left, right)``."""
    if sliding_window is None:
        return (-1, -1)
    w = int(sliding_window)
    if w <= 0:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    return (w - 1, 0) if causal else (w - 1, w - 1)


def _attention_chunk(module: torch.nn.Module) -> int | None:
    """The chunk size of a ``chunked_attention`` layer (Llama 4: a token sees the keys of its own chunk of
    ``config.attention_chunk_size`` tokens), read from the module's config and ``layer_idx``; ``None`` for
    every other layer.

    Raises:
        UnsupportedModelError: a model with chunked layers whose attention module has no ``layer_idx``.
    """
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    if not types or "chunked_attention" not in types:
        return None
    index = getattr(module, "layer_idx", None)
    if not isinstance(index, int) or not 0 <= index < len(types):
        raise UnsupportedModelError(
            f"{type(module).__name__} belongs to a model with chunked_attention layers but has no layer_idx: "
            "varpack cannot tell whether its attention is chunked",
            feature=f"chunked attention in {type(module).__name__} without layer_idx",
        )
    if types[index] != "chunked_attention":
        return None
    return int(config.attention_chunk_size)


def _refuse_row_position_scaling(module: torch.nn.Module, total: int) -> None:
    """Llama 4's NoPE layers scale queries by their position in the row (``attn_temperature_tuning``:
    ``log1p(floor((p + 1) / floor_scale))``), not by ``position_ids``: in a packed row a sample's tokens get
    their row positions, which equal their own positions' scale only while the row is shorter than
    ``floor_scale`` tokens (the scale is then 1 everywhere)."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return
    floor_scale = int(getattr(module, "floor_scale", 0) or 0)
    if total >= floor_scale:
        raise UnsupportedModelError(
            f"{type(module).__name__} scales queries by their position in the row (attn_temperature_tuning, "
            f"floor_scale={floor_scale}); a packed row of {total} tokens >= floor_scale would give a sample's "
            "tokens other scales than its own positions: pack rows shorter than floor_scale tokens",
            feature="query temperature by row position (attn_temperature_tuning) in rows >= floor_scale",
        )


def autocast_qkv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in the autocast dtype when autocast is on for their device and they are not all in it.

    Under mixed precision (``--bf16``: float32 master weights, ``torch.autocast``) a Qwen3 / Llama layer hands
    attention q and k in float32 (its RMSNorm's float32 weight promotes the bf16 projection) and v in bf16;
    transformers' own attention functions run in the autocast dtype there (SDPA is on autocast's
    lower-precision list; the flash-attention integration casts float32 inputs to
    ``torch.get_autocast_dtype``), so varpack does the same. Without autocast nothing is cast: mixed dtypes
    are then refused by :func:`varpack.attn.varlen_attention` (TypeError naming the three dtypes).

    Args:
        query, key, value: the attention inputs, any shape (only dtype and device are read).

    Returns:
        ``(query, key, value)``, cast with ``Tensor.to`` (a no-op for a tensor already in the dtype).
    """
    device_type = query.device.type
    if not torch.is_autocast_enabled(device_type):
        return query, key, value
    target = torch.get_autocast_dtype(device_type)
    return query.to(target), key.to(target), value.to(target)


def varpack_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    *,
    backend: str = "auto",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function running :func:`varpack.attn.varlen_attention`.

    Args:
        module: the attention module (``module.is_causal`` decides causality unless ``is_causal`` is given).
        query: ``[B, H, Tq, D]``; key, value: ``[B, Hkv, Tk, D]`` (GQA: ``H % Hkv == 0``).
        attention_mask: must be ``None`` (the implementation has no mask function; padding-free batches
            carry their boundaries in ``cu_seq_lens_*``).
        dropout: must be 0 (varlen kernels have no attention dropout).
        scaling: softmax scale (default ``D ** -0.5``).
        sliding_window: transformers' window W (a query sees its W most recent keys) or None.
        softcap: tanh soft-capping of the scores (Gemma 2) or None.
        backend: varpack attention backend (bound at registration).
        **kwargs: ``cu_seq_lens_q/k`` (``[N+1]`` int32, CPU or q's device) and ``max_length_q/k`` (a host
            integer: Python int, NumPy integer or one-element CPU tensor, never a device tensor; see
            :func:`varpack.varlen.normalize_max_seqlen`), ``varlen_meta``, ``seq_idx`` for a packed batch (B
            must be 1); absent for unpacked rows. Besides those only :data:`NEUTRAL_ATTENTION_KWARGS`,
            ``output_attentions=False`` and ``None`` values are accepted: any other keyword is refused before
            anything is computed (:func:`refuse_unimplemented_kwargs`).

    Returns:
        ``(out [B, Tq, H, D], None)`` in q's dtype.

    Raises:
        PackingGuardError: boundary kwargs with B > 1, or an attention mask.
        UnsupportedModelError: a keyword varpack attention does not implement (named, with its feature).
        ValueError: dropout > 0, bad sliding window; TypeError: ``max_length_*`` not a host integer.
        varpack.attn.BackendUnavailableError: the backend cannot run this call.
    """
    refuse_unimplemented_kwargs(module, kwargs)
    sinks = kwargs.get("s_aux")
    through_op = getattr(module, "_varpack_custom_op", False)  # compile_layers(custom_ops=True)
    if through_op and sinks is not None:
        raise UnsupportedModelError(
            f"{type(module).__name__} has attention sinks (s_aux), which the varpack::varlen_attention custom op "
            "does not carry; compile the layers without custom_ops (varpack.integrations.kernels.compile_layers)",
            feature="attention sinks through the compiled custom op",
        )
    extra = {} if sinks is None else {"sinks": sinks}
    if torch.compiler.is_compiling() and not through_op:
        # inside a torch.compile'd layer (varpack.integrations.kernels.compile_layers): the attention call is
        # a graph break, run eagerly with concrete ints (kernels such as FA4's are not traceable)
        return _attention_outside_graph(
            module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, is_causal,
            backend=backend, **kwargs,
        )  # fmt: skip
    if through_op:  # traced as the varpack::varlen_attention custom op: one graph node, no graph break
        from varpack.attn.custom_op import varlen_attention_op as varlen_attention
    else:
        from varpack.attn import varlen_attention

    query, key, value = autocast_qkv(query, key, value)
    if dropout:
        keys = list(attention_dropout_settings(module.config)) if hasattr(module, "config") else []
        raise ValueError(
            f"varpack attention has no attention dropout (got dropout={dropout} from "
            f"{type(module).__name__}); set config.{' / '.join(keys) or 'attention_dropout'} = 0.0"
        )
    if attention_mask is not None:
        raise UnsupportedModelError(
            f"varpack attention got an attention mask of shape {tuple(attention_mask.shape)} in "
            f"{type(module).__name__}; it takes padding-free batches whose boundaries are cu_seq_lens_q/k "
            "(use varpack.collate.PaddingFreeCollator), and the packing guard refuses a caller's mask, so this "
            "mask was built by the model itself",
            feature=f"an attention mask built by the model ({type(module).__name__})",
        )
    if is_causal is None:
        is_causal = bool(getattr(module, "is_causal", True))
    window = _window(sliding_window, is_causal)
    softcap_f = float(softcap) if softcap else 0.0
    bsz, num_heads, len_q, head_dim = query.shape
    len_k = key.shape[2]

    meta = kwargs.get(VARLEN_META)
    if kwargs.get(CP_SHARD) is not None and (meta is None or getattr(kwargs[CP_SHARD], "group", None) is None):
        raise PackingGuardError(
            f"{type(module).__name__} got a context-parallel shard that the model's packing guard did not bind "
            "(call the model with the shard's batch: varpack.integrations.context_parallel.enable_context_parallel)"
        )
    if meta is None and kwargs.get("cu_seq_lens_q") is not None:
        # boundary kwargs without the guard's meta (a model whose forward was not hooked): built here, once
        # per call; enable_varpack's guard builds it once per forward instead
        if kwargs.get("max_length_q") is None:
            raise PackingGuardError("cu_seq_lens_q given without max_length_q (the longest segment, an int)")
        try:
            meta = varlen_meta_from_kwargs(kwargs, len_q if bsz == 1 else None, type(module).__name__)
        except (TypeError, ValueError) as exc:
            raise PackingGuardError(str(exc)) from exc
    chunk = _attention_chunk(module)
    if meta is not None:
        if bsz != 1:
            raise PackingGuardError(
                f"packed batch (cu_seq_lens_q given) must have one row, got query of shape "
                f"{tuple(query.shape)} (B={bsz})"
            )
        _refuse_row_position_scaling(module, meta.total_q)
        if chunk is not None:  # chunked attention: each sample's chunks are segments of their own
            meta = meta.chunked(chunk)
        q = query[0].transpose(0, 1)  # [T, H, D]
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
        shard = kwargs.get(CP_SHARD)
        if shard is not None and (sinks is not None or chunk is not None):
            what = "attention sinks" if sinks is not None else "chunked attention"
            raise UnsupportedModelError(
                f"{type(module).__name__}: {what} under context parallelism is not implemented (the ring / "
                "Ulysses paths carry neither); train without --context-parallel",
                feature=f"{what} under context parallelism",
            )
        if shard is not None:  # this rank's tokens of a row split over a context-parallel group
            if through_op:
                raise PackingGuardError(
                    "context parallelism does not run through compile_layers(custom_ops=True): train without "
                    "compiled layers (--torch-compile false)"
                )
            from varpack.attn.context_parallel import context_parallel_attention

            out = context_parallel_attention(
                q, k, v, meta=meta, shard=shard, causal=is_causal, window_size=window,
                softmax_scale=scaling, softcap=softcap_f, backend=backend,
            )  # fmt: skip
            return out.reshape(bsz, len_q, num_heads, out.shape[-1]), None
        out = varlen_attention(
            q,
            k,
            v,
            causal=is_causal,
            window_size=window,
            softmax_scale=scaling,
            softcap=softcap_f,
            backend=backend,
            meta=meta,
            **extra,
        )
        return out.reshape(bsz, len_q, num_heads, out.shape[-1]), None
    state = module.__dict__.get("_varpack_state")
    if state is not None and state.packed_tokens is not None:
        raise UnsupportedModelError(
            f"{type(module).__name__} was called without the batch's boundary keywords (cu_seq_lens_q/k, "
            f"varlen_meta) inside the forward of a packed row of {state.packed_tokens} tokens: its decoder layer "
            "does not hand **kwargs on to attention, so the samples of the row would attend to each other",
            feature=f"attention without the boundary keywords ({type(module).__name__})",
        )
    # unpacked: every row is one sequence; the offsets are built on the device (no host copy, no sync)
    if chunk is not None:
        if len_k != len_q:
            raise UnsupportedModelError(
                f"{type(module).__name__}: chunked attention with {len_k} keys for {len_q} queries (a KV cache); "
                "varpack runs chunked layers on whole rows only",
                feature="chunked attention with a KV cache",
            )
        rows = VarlenMeta(list(range(0, (bsz + 1) * len_q, len_q)), total_q=bsz * len_q)
        meta = rows.chunked(chunk)
        q = query.transpose(1, 2).reshape(bsz * len_q, num_heads, head_dim)
        k = key.transpose(1, 2).reshape(bsz * len_k, key.shape[1], key.shape[3])
        v = value.transpose(1, 2).reshape(bsz * len_k, value.shape[1], value.shape[3])
        out = varlen_attention(
            q, k, v, causal=is_causal, window_size=window, softmax_scale=scaling, softcap=softcap_f,
            backend=backend, meta=meta, **extra,
        )  # fmt: skip
        return out.reshape(bsz, len_q, num_heads, out.shape[-1]), None
    q = query.transpose(1, 2).reshape(bsz * len_q, num_heads, head_dim)
    k = key.transpose(1, 2).reshape(bsz * len_k, key.shape[1], key.shape[3])
    v = value.transpose(1, 2).reshape(bsz * len_k, value.shape[1], value.shape[3])  # Dv may differ (MLA)
    cu_q = torch.arange(0, (bsz + 1) * len_q, len_q, device=query.device, dtype=torch.int32)
    cu_k = torch.arange(0, (bsz + 1) * len_k, len_k, device=query.device, dtype=torch.int32)
    max_q, max_k = len_q, len_k
    out = varlen_attention(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        causal=is_causal,
        window_size=window,
        softmax_scale=scaling,
        softcap=softcap_f,
        backend=backend,
        **extra,
    )
    return out.reshape(bsz, len_q, num_heads, out.shape[-1]), None


#: varpack_attention_forward as torch.compile sees it: never traced, so a compiled decoder layer breaks its
#: graph here and the varlen kernel gets Python ints and the per-batch boundary cache.
_attention_outside_graph = torch.compiler.disable(varpack_attention_forward)


# ---------------------------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------------------------
def attn_implementation_name(backend: str = "auto") -> str:
    """The transformers attention implementation name for a varpack backend: ``"varpack"`` for ``auto``,
    else ``"varpack_<backend>"`` with ``flash_attn`` shortened to ``fa`` and ``sdpa`` to ``sdp`` (transformers
    treats any name containing "flash" as a flash-attention implementation, and one containing "sdpa" as SDPA,
    which it refuses for models without SDPA support, e.g. GPT-OSS)."""
    if backend == "auto":
        return ATTN_IMPLEMENTATION
    return f"{ATTN_IMPLEMENTATION}_{backend.replace('flash_attn', 'fa').replace('sdpa', 'sdp')}"


def register_varpack_attention(backend: str = "auto") -> str:
    """Register varpack's attention function (bound to ``backend``) in transformers' ``AttentionInterface``
    and return its implementation name. Idempotent.

    Raises:
        ValueError: unknown backend name.
    """
    from transformers import AttentionInterface

    if backend != "auto":
        from varpack.attn.registry import get_backend

        get_backend(backend)  # raises ValueError for an unknown name
    name = attn_implementation_name(backend)
    if name not in _REGISTERED:
        fn = functools.partial(varpack_attention_forward, backend=backend)
        functools.update_wrapper(fn, varpack_attention_forward)
        AttentionInterface.register(name, fn)
        _REGISTERED[name] = backend
    return name


def is_varpack_attention(attn_implementation: str | None) -> bool:
    """Whether ``attn_implementation`` is one of the names registered by :func:`register_varpack_attention`."""
    return attn_implementation in _REGISTERED


# ---------------------------------------------------------------------------------------------------------
# the packing guard (forward pre-hook on the base model)
# ---------------------------------------------------------------------------------------------------------
@dataclass
class _GuardState:
    """What :func:`enable_varpack` installed (``model._varpack_state`` and ``model.base_model._varpack_state``)."""

    backend: str
    attn_implementation: str
    original_attn_implementation: str | None
    positional_names: tuple[str, ...]
    linear_layers_patched: int = 0
    #: the base model's forward declares ``position_ids`` (positions are one of its inputs)
    takes_positions: bool = True
    notes: list[str] = field(default_factory=list)
    #: tokens of the packed row whose forward is in flight (set by the guard, cleared when the forward ends)
    packed_tokens: int | None = None
    #: media (pixel_values, ...) may reach the model in a packed batch: a prepared vision-language family
    media_allowed: bool = False


def _text_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The text plane ``[B, T]`` of ``position_ids`` (``[B, T]``, ``[T]``, or mRoPE ``[4, B, T]`` with the text
    plane first); ``None`` for ``[3, B, T]`` mRoPE planes, where restarts cannot be read off."""
    if position_ids.dim() == 1:
        return position_ids.unsqueeze(0)
    if position_ids.dim() == 2:
        return position_ids
    if position_ids.dim() == 3 and position_ids.shape[0] == 4:
        return position_ids[0]
    return None


def _rows_restart(position_ids: torch.Tensor) -> bool:
    """Whether some row of ``position_ids`` holds several sequences (a step other than +1). One host read
    when the tensor lives on a device (once per forward, only on the unpacked path)."""
    text = _text_positions(position_ids)
    if text is None or text.shape[-1] < 2:
        return False
    return bool((text[:, 1:] - text[:, :-1] != 1).any())


def _normalize_boundary_kwargs(kwargs: dict, where: str) -> None:
    """Bring the boundary kwargs to the one contract of :mod:`varpack.varlen.boundaries`, in place, once per
    forward: ``max_length_q/k`` -> Python int (:func:`~varpack.varlen.normalize_max_seqlen`),
    ``cu_seq_lens_q/k`` -> an integer tensor, a list / array converted once to a CPU int32 tensor
    (:func:`~varpack.varlen.normalize_cu_seqlens`; one object given for both stays one tensor for both).
    A refusal is a :class:`PackingGuardError` naming the key."""
    try:
        for key in ("max_length_q", "max_length_k"):
            if kwargs.get(key) is not None:
                kwargs[key] = normalize_max_seqlen(kwargs[key], key)
        raw_q, raw_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if raw_q is not None:
            kwargs["cu_seq_lens_q"] = normalize_cu_seqlens(raw_q, "cu_seq_lens_q")
        if raw_k is not None:
            kwargs["cu_seq_lens_k"] = (
                kwargs["cu_seq_lens_q"] if raw_k is raw_q else normalize_cu_seqlens(raw_k, "cu_seq_lens_k")
            )
    except (TypeError, ValueError) as exc:
        raise PackingGuardError(f"{where}: {exc}") from exc


def _refuse_empty_segments(model: torch.nn.Module, backend: str, where: str, device: Any) -> None:
    """A batch with zero-length segments (repeated ``cu_seqlens`` offsets, e.g. ``StaticShape(empty_pads=True)``)
    reaches attention only where it is computed right: a named backend whose ``Capabilities`` lack
    ``empty_segments`` (FlashAttention-4) is refused, and so is ``auto`` in compiled layers (``Module.compile``,
    as :func:`varpack.integrations.kernels.compile_layers` does) where such a backend can run on ``device``:
    compiled layers resolve ``auto`` when traced, without reading the offsets. Eager ``auto`` reads them and
    passes over such backends.

    Raises:
        PackingGuardError: naming the backend.
    """
    from varpack.attn.registry import available_backends, get_backend

    what = f"{where} got a packed batch with zero-length segments (repeated cu_seqlens offsets)"
    if backend == "auto":
        if not any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()):  # eager
            return
        risky = [
            name for name, (ok, _) in available_backends(device).items()
            if ok and not get_backend(name).capabilities.empty_segments
        ]  # fmt: skip
        if risky:
            raise PackingGuardError(
                f"{what}, and its compiled layers resolve attention 'auto' when traced, without reading the "
                f"offsets, where {risky} (which do not take them) can run; name a backend that takes zero-length "
                "segments (triton_short, sdpa, flex, torch_varlen), or give every pad segment a token"
            )
        return
    if not get_backend(backend).capabilities.empty_segments:
        raise PackingGuardError(
            f"{what}, which attention backend {backend!r} does not take; name one that does (triton_short, sdpa, "
            "flex, torch_varlen), or give every pad segment a token"
        )


def _packing_guard(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    state: _GuardState = model._varpack_state
    kwargs = dict(kwargs)
    if args:  # name positional arguments (input_ids, attention_mask, position_ids, ...)
        for name, value in zip(state.positional_names, args):
            kwargs[name] = value
        args = ()
    positions_optional = False
    handed = model.__dict__.get("_varpack_outer_boundaries")
    if handed and not any(kwargs.get(k) is not None for k in BOUNDARY_KEYS):
        # the top model got a packed batch but its forward does not hand the boundaries down
        # (Mamba2ForCausalLM calls its backbone with named arguments only): given back here, unless the
        # positions were dropped too
        boundaries, had_positions = handed
        if had_positions and kwargs.get("position_ids") is None and state.takes_positions:
            raise PackingGuardError(
                f"{type(model).__name__} got a packed batch whose boundaries and position_ids its top model "
                "did not pass on; varpack cannot run this model packed"
            )
        kwargs.update(boundaries)
        positions_optional = not state.takes_positions
    impl = getattr(model.config, "_attn_implementation", None)
    input_ids = kwargs.get("input_ids")
    embeds = kwargs.get("inputs_embeds")
    ref = input_ids if input_ids is not None else embeds
    position_ids = kwargs.get("position_ids")
    attention_mask = kwargs.get("attention_mask")
    cache = next((kwargs[k] for k in _CACHE_KEYS if kwargs.get(k) is not None), None)
    packed = any(kwargs.get(k) is not None for k in FLASH_ATTN_KWARGS)
    where = type(model).__name__
    shard = kwargs.get(CP_SHARD)
    if shard is not None and not packed:
        raise PackingGuardError(
            f"{where} got a context-parallel shard (cp_shard) without the row's boundaries (cu_seq_lens_q/k, "
            "max_length_q/k, varlen_meta): pass varpack.collate.shard_batch's output whole"
        )

    if packed:
        if not is_varpack_attention(impl):
            raise PackingGuardError(
                f"{where} got a packed batch (cu_seq_lens_q/k) but its attention implementation is {impl!r}, "
                "not varpack's; call varpack.integrations.transformers.enable_varpack(model) again"
            )
        if kwargs.get("cu_seq_lens_q") is None:
            raise PackingGuardError(
                f"{where} got {[k for k in FLASH_ATTN_KWARGS if kwargs.get(k) is not None]} "
                "without cu_seq_lens_q"
            )
        if ref is not None and ref.dim() >= 2 and ref.shape[0] != 1:
            raise PackingGuardError(
                f"packed batch must be one row [1, T] (padding-free), got {'input_ids' if input_ids is not None else 'inputs_embeds'} "
                f"of shape {tuple(ref.shape)}"
            )
        if attention_mask is not None:
            raise PackingGuardError(
                f"packed batch with an attention_mask of shape {tuple(attention_mask.shape)}: a padding-free "
                "batch carries its boundaries in cu_seq_lens_q/k; drop attention_mask"
            )
        if cache is not None:
            raise PackingGuardError(
                f"packed batch with a KV cache ({type(cache).__name__}): a cache would hold the keys of all "
                "samples of the pack; packed batches are for training (pass use_cache=False, no cache)"
            )
        if kwargs.get("use_cache"):
            raise PackingGuardError("packed batch with use_cache=True; packed batches need use_cache=False")
        kwargs["use_cache"] = False  # HF models otherwise create a DynamicCache filled with the whole pack
        if position_ids is None and not positions_optional:
            raise PackingGuardError(
                "packed batch without position_ids: positions must restart at 0 for every sample "
                "(the collator provides them)"
            )
        total = ref.shape[1] if ref is not None and ref.dim() >= 2 else None
        if shard is not None:  # this rank's tokens; the boundaries describe the whole row
            try:
                kwargs[CP_SHARD] = shard = bind_shard(model, shard, total, where)
            except ValueError as exc:
                raise PackingGuardError(str(exc)) from exc
            total = shard.total
        _normalize_boundary_kwargs(kwargs, where)
        if kwargs.get("varlen_meta") is None and kwargs.get("max_length_q") is None:
            raise PackingGuardError(
                f"{where}: cu_seq_lens_q given without max_length_q (the longest segment, an int)"
            )
        media = [k for k in MEDIA_FIELDS if kwargs.get(k) is not None]
        if media and not state.media_allowed:
            raise UnsupportedModelError(
                f"packed batch with {media} for {where}: varpack keeps media apart in packed batches for the "
                "vision-language families it prepares (Qwen-VL: varpack.models.qwen_vl); for this model only "
                "text-only packed batches are exact",
                feature="media inputs in a packed batch",
            )
        try:  # the batch's boundaries, validated once (the collator's meta, or built here from the kwargs)
            kwargs[VARLEN_META] = varlen_meta_from_kwargs(kwargs, total, where)
        except (TypeError, ValueError) as exc:
            raise PackingGuardError(str(exc)) from exc
        if kwargs[VARLEN_META].has_empty:
            _refuse_empty_segments(model, state.backend, where, None if ref is None else ref.device)
        state.packed_tokens = kwargs[VARLEN_META].total_q
        # every layer reads this one meta: one host-to-device copy of the offsets per batch, kept on it
        return args, kwargs

    # unpacked path: rows are whole sequences
    state.packed_tokens = None
    if attention_mask is not None and attention_mask.dim() == 2 and is_varpack_attention(impl):
        if not bool(attention_mask.all()):
            raise PackingGuardError(
                f"{where} uses varpack attention, which is padding-free, but got an attention_mask with "
                f"padding (shape {tuple(attention_mask.shape)}); pack the samples with "
                "varpack.collate.PaddingFreeCollator (or switch the model to sdpa for padded batches)"
            )
    if position_ids is not None and cache is None and _rows_restart(position_ids):
        raise PackingGuardError(
            f"{where} got position_ids that restart inside a row (several samples packed in one row) but no "
            "boundary kwargs cu_seq_lens_q/k and max_length_q/k: attention would mix the samples. Pass the "
            "collator's full output (varpack.collate.PaddingFreeCollator)"
        )
    return args, kwargs


# ---------------------------------------------------------------------------------------------------------
# enable
# ---------------------------------------------------------------------------------------------------------
def _first_class(model: torch.nn.Module, fragments: tuple[str, ...]) -> str | None:
    """The class name of the first submodule (not the model itself, not a whole model) whose class name holds
    one of ``fragments``."""
    from transformers import PreTrainedModel

    for module in model.modules():
        name = type(module).__name__
        if module is not model and not isinstance(module, PreTrainedModel) and any(f in name for f in fragments):
            return name
    return None


def _conv_owner(model: torch.nn.Module) -> str | None:
    """The class of the first module holding a 1-D convolution over the sequence (a token mixer of its own)."""
    for module in model.modules():
        if any(isinstance(child, torch.nn.Conv1d) for child in module.children()):
            return type(module).__name__
    return None


def _refuse_by_family(model: torch.nn.Module) -> None:
    """A family that varpack refuses (or that packing does not apply to), and encoder-decoder models."""
    family = family_of(model)
    model_type = getattr(model.config, "model_type", None)
    if family.not_applicable or family.refused:
        feature = family.not_applicable or family.refused
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type {model_type!r}, family {family.name!r}): "
            f"{'packing does not apply' if family.not_applicable else 'varpack refuses it'}: {feature}",
            feature=feature,
            applicable=family.not_applicable is None,
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type {model_type!r}) is an encoder-decoder model; varpack packs "
            "decoder-only causal LMs (the decoder's positions and cross-attention follow the encoder's batch)",
            feature="encoder-decoder model",
            applicable=False,
        )
    for key in CAPACITY_LIMIT_FIELDS:
        value = getattr(model.config, key, None)
        if value:
            raise UnsupportedModelError(
                f"{type(model).__name__} routes tokens to experts with a capacity limit ({key}={value!r}): "
                "which tokens are dropped depends on the other samples of the batch, so a packed step cannot "
                "equal each sample's own",
                feature=f"MoE routing with an expert capacity ({key})",
            )


def _linear_attention_layers(model: torch.nn.Module) -> int:
    """The number of layers with a recurrent mixer (``config.layer_types``), refusing stateful layers varpack
    does not patch -- a state-space mixer by its structure (an ``A_log`` parameter and a ``conv1d``, whatever its
    class is called) or a module named like a stateful one (:data:`_UNSUPPORTED_MIXERS`), outside a Mamba-2
    mixer varpack patches and its parents, normalization layers aside -- and unknown layer types; each refusal
    an :class:`UnsupportedModelError` naming the mixer class or the layer type."""
    from varpack.models.mamba2 import is_mamba2_mixer

    mixers = [path for path, m in model.named_modules() if is_mamba2_mixer(m)]

    def patched(path: str) -> bool:  # a patched Mamba-2 mixer, a module inside one, or one of its parents
        return any(path == m or m.startswith(f"{path}.") or path.startswith(f"{m}.") or not path for m in mixers)

    stateful = [
        (path, type(module).__name__)
        for path, module in model.named_modules()
        if not patched(path)
        and not is_gated_delta_layer(module)
        and (
            (hasattr(module, "A_log") and hasattr(module, "conv1d"))
            or (
                any(frag in type(module).__name__ for frag in _UNSUPPORTED_MIXERS)
                and not type(module).__name__.endswith("Norm")
            )
        )
    ]
    if stateful:
        path, name = max(stateful, key=lambda item: item[0].count("."))  # the innermost: the mixer
        raise UnsupportedModelError(
            f"{type(model).__name__} contains {name} ({path}), a stateful sequence layer that would carry "
            "state across packed samples; varpack does not support it",
            feature=f"stateful sequence mixer {name}",
        )
    count = 0
    seen: set[int] = set()
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        types = getattr(cfg, "layer_types", None) or []
        unknown = sorted({t for t in types if isinstance(t, str) and t not in _KNOWN_LAYER_TYPES})
        if unknown:
            raise UnsupportedModelError(
                f"{type(model).__name__} has layer types {unknown} that varpack cannot keep packed samples "
                f"apart in (supported: {', '.join(sorted(_KNOWN_LAYER_TYPES))})",
                feature="layer type " + ", ".join(unknown),
            )
        count = max(count, sum(t in _RECURRENT_LAYER_TYPES for t in types))
    return count


def _hand_boundaries_down(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Pre-hook on a top model that is not its base model: a packed call's boundary keywords (and whether it
    had positions) are kept on the base model for the call, for :func:`_packing_guard` (a top forward that
    drops them, e.g. Mamba2ForCausalLM's, would otherwise run the pack as one sequence). Stateless beyond the
    call (:func:`_hand_boundaries_done`)."""
    boundaries = {k: kwargs[k] for k in BOUNDARY_KEYS if kwargs.get(k) is not None}
    model.base_model._varpack_outer_boundaries = (
        (boundaries, kwargs.get("position_ids") is not None) if boundaries else None
    )


def _hand_boundaries_done(model: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    model.base_model._varpack_outer_boundaries = None


def _refuse_unverified(model: torch.nn.Module) -> None:
    """A model of a ``model_type`` no family covers runs only if every module class is a verified one."""
    if family_of(model) is not GENERIC:
        return
    unknown = unrecognised_module_classes(model)
    if unknown:
        model_type = getattr(model.config, "model_type", None)
        shown = ", ".join(u.rsplit(".", 1)[-1] for u in unknown[:6]) + (" ..." if len(unknown) > 6 else "")
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type {model_type!r}) is not verified exact by varpack: no model family "
            f"covers that model type and its layers {shown} are not among the verified ones (docs/MODELS.md). "
            "Check it with varpack.check.check_exactness after varpack.models.register_family(...) covers it",
            feature=f"unverified model type {model_type} ({unknown[0].rsplit('.', 1)[-1]})",
        )


def _end_of_forward(model: torch.nn.Module, args: tuple, output: Any) -> None:
    """The base model's forward ended (or raised): no packed forward in flight any more."""
    state = model.__dict__.get("_varpack_state")
    if state is not None:
        state.packed_tokens = None


def _remove_guard(model: torch.nn.Module) -> None:
    """Drop varpack's hooks (found by function identity, so that deep copies of a model are handled too)."""
    ours = (_packing_guard, _hand_boundaries_down)
    hooks = model._forward_pre_hooks
    for hook_id in [i for i, fn in hooks.items() if fn in ours]:
        del hooks[hook_id]
        model._forward_pre_hooks_with_kwargs.pop(hook_id, None)
    post = (_hand_boundaries_done, _end_of_forward)
    for hook_id in [i for i, fn in model._forward_hooks.items() if fn in post]:
        del model._forward_hooks[hook_id]
        model._forward_hooks_with_kwargs.pop(hook_id, None)
        model._forward_hooks_always_called.pop(hook_id, None)


def enable_varpack(
    model: torch.nn.Module,
    *,
    backend: str = "auto",
    linear_backend: str = "auto",
) -> torch.nn.Module:
    """Switch a transformers model to varpack attention and install the packing guards.

    Args:
        model: a ``transformers`` ``PreTrainedModel`` whose attention layers dispatch through
            ``ALL_ATTENTION_FUNCTIONS`` (Llama, Qwen2/3, Mistral, Gemma 2/3, Qwen3.5, ... in transformers 5.x).
        backend: varpack attention backend (``"auto"`` or a name of :data:`varpack.attn.registry.BACKENDS`).
        linear_backend: gated delta rule backend of the linear-attention (Gated DeltaNet) layers, passed to
            :func:`varpack.integrations.gated_delta.patch_linear_attention`: ``"auto"`` or a name of
            :data:`varpack.ops.gated_delta_rule.BACKENDS` (``fla``, ``fla_hybrid``, ``chunk``,
            ``chunk_compiled``, ``naive``). A forced name is checked against the device at the first packed
            forward (:func:`varpack.integrations.gated_delta.linear_attention_backend` checks it up front).

    Returns:
        The same model (modified in place): ``model.config._attn_implementation`` is
        :func:`attn_implementation_name` ``(backend)``; ``model._varpack_state`` records what was done.
        Calling it again replaces the previous hook (idempotent).

    Raises:
        ValueError: unknown backend or ``linear_backend``; a ``linear_backend`` other than ``"auto"`` for a
            model without Gated DeltaNet layers (:func:`varpack.models.registry.require_gated_delta_layers`);
            PackingGuardError: a model with layers varpack cannot run exactly
            (linear attention that is neither Gated DeltaNet nor Mamba-2, Mamba-1 / short-conv layers);
            TypeError: not a transformers model.
    """
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise TypeError(f"enable_varpack needs a transformers PreTrainedModel, got {type(model).__name__}")
    _refuse_by_family(model)
    require_gated_delta_layers(model, linear_backend, setting="linear_backend")
    num_linear = _linear_attention_layers(model)
    _refuse_unverified(model)
    old = getattr(model, "_varpack_state", None)
    original = old.original_attn_implementation if old is not None else model.config._attn_implementation
    name = register_varpack_attention(backend)
    model.set_attn_implementation(name)
    if getattr(model.config, "_attn_implementation", None) != name:
        attention = _first_class(model, ("Attention", "Attn")) or type(model).__name__
        raise UnsupportedModelError(
            f"{type(model).__name__} did not switch to attention implementation {name!r} "
            f"(still {model.config._attn_implementation!r}): {attention} does not dispatch through transformers' "
            "AttentionInterface, so varpack attention never runs there",
            feature=f"attention outside transformers' AttentionInterface ({attention})",
        )
    patched = gated_delta = 0
    if num_linear:
        try:
            from varpack.integrations.gated_delta import patch_linear_attention
            from varpack.integrations.mamba2 import patch_mamba2_mixers
        except ImportError as exc:
            raise PackingGuardError(
                f"{type(model).__name__} has {num_linear} linear-attention layers, which mix packed samples "
                f"unless patched, and varpack's gated-delta / Mamba-2 integration is not available: {exc}"
            ) from exc
        try:
            gated_delta = int(patch_linear_attention(model, backend=linear_backend))
        except TypeError as exc:  # a GatedDeltaNet-named module of another structure
            mixer = _first_class(model, ("GatedDeltaNet",)) or "GatedDeltaNet"
            raise UnsupportedModelError(str(exc), feature=f"linear attention {mixer}") from exc
        patched = gated_delta + int(patch_mamba2_mixers(model))
        if patched < num_linear:
            mixer = _first_class(model, _LINEAR_MIXER_FRAGMENTS) or _conv_owner(model) or "of an unknown kind"
            raise UnsupportedModelError(
                f"{type(model).__name__} has {num_linear} linear-attention layers but only {patched} were "
                f"patched: varpack's patches know Gated DeltaNet and Mamba-2 layers, not {mixer}",
                feature=f"linear attention {mixer}",
            )
    if linear_backend != "auto" and not gated_delta:  # Gated DeltaNet modules, but no linear_attention type
        raise PackingGuardError(
            f"linear_backend={linear_backend!r}: {type(model).__name__} has Gated DeltaNet modules but its config "
            "lists no 'linear_attention' layer types, so varpack did not patch them"
        )

    # The guard sits on the base model (``model.model`` of a *ForCausalLM): every path reaches it with the
    # same keywords -- model(**batch), and base-model-only calls such as varpack.ops.linear_ce's.
    base = getattr(model, "base_model", model)
    for module in {id(model): model, id(base): base}.values():
        _remove_guard(module)
    params = inspect.signature(base.forward).parameters.values()
    positional = tuple(
        p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"
    )
    state = _GuardState(
        backend=backend,
        attn_implementation=name,
        original_attn_implementation=original,
        positional_names=positional,
        linear_layers_patched=patched,
        takes_positions="position_ids" in inspect.signature(base.forward).parameters,
    )
    model._varpack_state = state
    base._varpack_state = state
    base.register_forward_pre_hook(_packing_guard, with_kwargs=True)
    if base is not model:
        model.register_forward_pre_hook(_hand_boundaries_down, with_kwargs=True)
        model.register_forward_hook(_hand_boundaries_done, with_kwargs=True, always_call=True)
    base.register_forward_hook(_end_of_forward, always_call=True)
    family = family_of(model)
    tower = family.vision_tower(model) if family.is_vl(model) else None
    skip = {id(m) for m in tower.modules()} if tower is not None else set()
    for module in model.modules():  # every text-side layer can tell a packed forward from an unpacked one
        if id(module) not in skip:
            module.__dict__["_varpack_state"] = state
    state.media_allowed = tower is not None
    return model
