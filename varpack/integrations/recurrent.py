"""How the batch's boundaries reach a recurrent token mixer (Gated DeltaNet, Mamba-2): the hooks that
:func:`varpack.integrations.gated_delta.patch_linear_attention` and
:func:`varpack.integrations.mamba2.patch_mamba2_mixers` install, once.

* On the **text model** (the module owning ``layers``), once per forward: a packed call's boundaries become the
  batch's :class:`~varpack.varlen.VarlenMeta` (the collator's, or built here from ``cu_seq_lens_q`` /
  ``seq_idx``), passed on in ``kwargs["varlen_meta"]``, which transformers hands to every decoder layer.
* On each **decoder layer** holding a mixer: a pre-hook hands the call's meta (and context-parallel shard) to
  the mixer for the duration of that call, a post-hook takes it back -- some transformers releases call the
  mixer without the layer's kwargs. Gradient-checkpointing recomputation calls the layer again with the same
  kwargs, so it sees the same meta; no state outlives a call and no private torch API is needed.
* The mixer's ``forward`` is replaced by the integration's patched one; the original is kept on the module.

Raises (at forward time, naming the module): boundaries with a batch of more than one row, with a cache or
``use_cache=True`` (the recurrent state of a packed row would mix samples: packing is for training), or not
covering the row's tokens.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from varpack.schema import CP_SHARD, SEQ_IDX, VARLEN_META
from varpack.varlen.meta import VarlenMeta, varlen_meta_from_kwargs

__all__ = ["CACHE_KEYS", "conv_activation", "current_meta", "current_shard", "install_mixer_hooks", "mixer_name"]

#: keyword names under which transformers hands a layer its cache
CACHE_KEYS = ("cache", "cache_params", "past_key_values")


def mixer_name(layer: torch.nn.Module) -> str:
    """``ClassName(layer_idx=i)``: how errors name a mixer."""
    return f"{type(layer).__name__}(layer_idx={getattr(layer, 'layer_idx', '?')})"


def _row_tokens(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    ref = kwargs.get("input_ids")
    if ref is None:
        ref = kwargs.get("inputs_embeds")
    if ref is None and args and isinstance(args[0], torch.Tensor):
        ref = args[0]
    if ref is None or ref.dim() < 2:
        return None
    return int(ref.shape[0]), int(ref.shape[1])


def _row_total(kwargs: dict, T: int, where: str) -> int:
    """The packed row's token count: ``T`` itself, or for a context-parallel shard (``cp_shard``, this rank's
    ``T`` tokens of a longer row) the whole row's, after checking that the shard holds ``T`` tokens."""
    shard = kwargs.get(CP_SHARD)
    if shard is None:
        return T
    if getattr(shard, "num_local", None) != T:
        raise ValueError(
            f"{where}: the batch holds {T} tokens but its cp_shard gives this rank {getattr(shard, 'num_local', '?')}"
        )
    return shard.total


def _text_model_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict):
    """The batch's meta, once per forward of the text model (module docstring). Stateless."""
    if not any(kwargs.get(k) is not None for k in (VARLEN_META, "cu_seq_lens_q", SEQ_IDX)):
        return None
    where = type(module).__name__
    shape = _row_tokens(args, kwargs)
    if shape is None:
        raise ValueError(
            f"{where}: packed batch (cu_seq_lens_q/seq_idx) without input_ids/inputs_embeds [1, T]"
        )
    B, T = shape
    if B != 1:
        raise ValueError(
            f"{where}: packed batch boundaries (cu_seq_lens_q/seq_idx) need one row [1, T], got a batch of "
            f"{B} rows; flatten the samples into one row (varpack.collate.PaddingFreeCollator)"
        )
    cache = next((kwargs[k] for k in CACHE_KEYS if kwargs.get(k) is not None), None)
    if cache is not None:
        raise ValueError(
            f"{where}: packed batch with a cache ({type(cache).__name__}): the recurrent state of a packed row "
            "mixes samples; packing is for training (no cache, use_cache=False)"
        )
    if kwargs.get("use_cache"):
        raise ValueError(f"{where}: packed batch with use_cache=True; packed batches need use_cache=False")
    kwargs = dict(kwargs)
    kwargs[VARLEN_META] = varlen_meta_from_kwargs(kwargs, _row_total(kwargs, T, where), where)
    kwargs["use_cache"] = False  # HF would otherwise build a cache from the packed row
    return args, kwargs


def _decoder_layer_pre_hook(mixer: torch.nn.Module, module, args: tuple, kwargs: dict) -> None:
    mixer._varpack_meta = kwargs.get(VARLEN_META)
    mixer._varpack_cp_shard = kwargs.get(CP_SHARD)


def _decoder_layer_post_hook(mixer: torch.nn.Module, module, args, kwargs, output) -> None:
    mixer._varpack_meta = None  # the meta lives for one call of the layer, never beyond
    mixer._varpack_cp_shard = None


def current_shard(layer: torch.nn.Module, kwargs: dict) -> Any:
    """The context-parallel shard of this call (bound by the packing guard), or ``None``."""
    shard = kwargs.get(CP_SHARD)
    return shard if shard is not None else layer.__dict__.get("_varpack_cp_shard")


def current_meta(layer: torch.nn.Module, T: int, kwargs: dict) -> VarlenMeta | None:
    """The meta of this call of a patched mixer over ``T`` tokens: from its own kwargs, else the one its decoder
    layer handed over, else built from boundary kwargs given to the mixer directly; ``None`` when unpacked.

    Raises:
        ValueError: boundaries that do not cover the row (``T``, or the whole row of a context-parallel shard).
    """
    where = mixer_name(layer)
    meta = kwargs.get(VARLEN_META)
    if meta is None:
        meta = layer.__dict__.get("_varpack_meta")
    shard = current_shard(layer, kwargs)
    total = T if shard is None else _row_total({CP_SHARD: shard}, T, where)
    if meta is None and (kwargs.get("cu_seq_lens_q") is not None or kwargs.get(SEQ_IDX) is not None):
        return varlen_meta_from_kwargs(kwargs, total, where)  # called directly with boundaries
    if meta is not None and meta.total_q != total:
        raise ValueError(
            f"{where}: the model's packed boundaries cover {meta.total_q} tokens but the layer got T={total}"
        )
    return meta


def conv_activation(name: Any):
    """A short convolution's activation as :func:`varpack.ops.short_conv` takes it: ``"silu"`` / ``"swish"`` /
    ``None`` as they are, any other transformers name as its function (``ACT2FN``)."""
    if name in ("silu", "swish") or name is None:
        return name
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def install_mixer_hooks(
    model: torch.nn.Module, mixers: Sequence[torch.nn.Module], patched_forward: Callable, *, original_attr: str
) -> None:
    """Install the hooks of the module docstring for ``mixers`` of ``model`` and replace each mixer's ``forward``
    by ``patched_forward`` (a function of ``(mixer, hidden_states, *args, **kwargs)``), keeping the original
    forward as ``mixer.<original_attr>``. Idempotent: a text model, a (layer, mixer) pair or a mixer already
    handled is left as it is."""
    ids = {id(m) for m in mixers}
    for m in model.modules():  # the text models (modules owning a `layers` list that holds the mixers)
        sub = getattr(m, "layers", None)
        if (
            isinstance(sub, torch.nn.ModuleList)
            and any(id(x) in ids for layer in sub for x in layer.modules())
            and not getattr(m, "_varpack_text_hook", False)
        ):
            m.register_forward_pre_hook(_text_model_pre_hook, with_kwargs=True)
            m._varpack_text_hook = True
    for parent in model.modules():  # the decoder layers holding a mixer: hand it the call's meta
        for child in parent.children():
            hooked = parent.__dict__.setdefault("_varpack_hooked_mixers", set()) if id(child) in ids else ()
            if id(child) in ids and id(child) not in hooked:
                parent.register_forward_pre_hook(
                    functools.partial(_decoder_layer_pre_hook, child), with_kwargs=True
                )
                parent.register_forward_hook(
                    functools.partial(_decoder_layer_post_hook, child), with_kwargs=True, always_call=True
                )
                hooked.add(id(child))
    for m in mixers:
        if original_attr not in m.__dict__:
            setattr(m, original_attr, m.forward)
            m.forward = types.MethodType(patched_forward, m)
        m._varpack_meta = None
        m._varpack_cp_shard = None
