"""Boundary-exact packing for Gated DeltaNet layers (transformers' Qwen3.5 text and Qwen3-Next).

A packed row must reset a Gated DeltaNet layer at every sample boundary in TWO places: the 4-tap causal
short convolution in front of the rule (its first taps would read the previous sample's last tokens) and
the recurrent state of the gated delta rule. :func:`patch_linear_attention` replaces the ``forward`` of
every ``Qwen3_5GatedDeltaNet`` / ``Qwen3NextGatedDeltaNet`` instance with one that, on a packed batch,
runs the same projections and parameters through :func:`varpack.ops.short_conv` and
:func:`varpack.ops.gated_delta_rule` with the batch's boundaries; without boundaries it calls the original
``forward`` unchanged (an unpacked sample, generation with a cache). One exception: where transformers'
own forward would dispatch to an installed fla whose backward cannot run on the device (fla 0.6.0 on
Hopper with Triton < 3.7.1) and gradients are needed, an unpacked cache-free call takes varpack's path with
one sequence per row (same math) so that training, and ``varpack check``'s unpacked reference, still run.

Where the boundaries come from: the batch's :class:`varpack.varlen.VarlenMeta` (``varlen_meta``, built once by
the collator; or built once per forward from ``cu_seq_lens_q`` / ``seq_idx`` kwargs by a pre-hook on the text
model, the module owning ``layers``). transformers hands it to every decoder layer; some releases call the
linear-attention module itself without those kwargs (5.17: ``self.linear_attn(hidden_states, cache_params=...,
attention_mask=...)``), so a pre-hook on each decoder layer hands the call's meta to its Gated DeltaNet for
the duration of that call (a post-hook takes it back). Gradient-checkpointing recomputation calls the decoder
layer again with the same kwargs, so it sees the same meta; no state outlives a call and no private torch API
is needed. The per-batch work (chunk layout, ``seq_idx``, device copies) is done once, at the first linear
layer, and kept on the meta for all the others: no host sync per layer.

Limits (raised as ``ValueError``): boundaries with a batch of more than one row; boundaries together with a
cache or ``use_cache=True`` (a cache would hold one state for the whole pack; packing is for training);
boundaries that do not cover the row's tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from varpack.integrations.recurrent import (
    CACHE_KEYS,
    conv_activation,
    current_meta,
    current_shard,
    install_mixer_hooks,
    mixer_name,
)
from varpack.models.registry import is_gated_delta_layer as _is_gdn
from varpack.ops._fla import fla_chunk_indices, load_fla
from varpack.ops.gated_delta_rule import BACKENDS, ChunkLayout, gated_delta_rule, prepare_chunk_layout
from varpack.ops.gated_delta_rule.custom_op import gated_delta_rule_op
from varpack.ops.gated_delta_rule.dispatch import (
    fla_gated_delta_status,
    resolve_backend,
    resolve_backend_reason,
)
from varpack.ops.gated_delta_rule.fla_hybrid import FlaHybridBoundaries, prepare_fla_hybrid_boundaries
from varpack.ops.short_conv import TRITON_MAX_L2NORM_HEAD, short_conv
from varpack.schema import VARLEN_META
from varpack.varlen.boundaries import seq_idx_on_device
from varpack.varlen.meta import VarlenMeta

__all__ = ["layer_head_dims", "linear_attention_backend", "patch_linear_attention"]

# which modules are Gated DeltaNet layers (_is_gdn) is a model-family fact:
# varpack.models.registry.is_gated_delta_layer


def _rule_cpu(meta: VarlenMeta) -> torch.Tensor:
    """The CPU offsets the gated delta rule runs on: the meta's ``cu_seqlens_linear`` (a static row's pad
    segments as one sequence) when it has them, else its offsets."""
    lin = meta.cu_seqlens_linear_cpu()
    return lin if lin is not None else meta.cu_seqlens_cpu()


def _rule_on(meta: VarlenMeta, device: torch.device) -> torch.Tensor:
    """:func:`_rule_cpu`'s offsets on ``device`` (int32; one copy per batch, kept on the meta)."""
    if meta.cu_seqlens_linear is None:
        return meta.cu_seqlens_on(device)[0]
    lin = meta.cu_seqlens_linear
    if lin.device == device:
        return lin
    return meta.memo(("cu_seqlens_linear", str(device)), lambda: lin.to(device, non_blocking=True))


def _chunk_layout(meta: VarlenMeta) -> ChunkLayout:
    """The gated-delta chunk layout of this batch, built once (first linear layer) and kept on the meta."""
    return meta.memo("gated_delta_chunk_layout", lambda: prepare_chunk_layout(_rule_cpu(meta)))


def _fla_hybrid_boundaries(meta: VarlenMeta, device: torch.device) -> FlaHybridBoundaries:
    """fla_hybrid's per-batch boundaries (device offsets, dq/dk plan), built once and kept on the meta."""
    return meta.memo(
        ("fla_hybrid_boundaries", str(device)),
        lambda: prepare_fla_hybrid_boundaries(_rule_cpu(meta), device),
    )


def _fla_chunk_indices(meta: VarlenMeta, device: torch.device) -> torch.Tensor:
    """fla's chunk indices of this batch on ``device`` (:func:`varpack.ops._fla.fla_chunk_indices`), built once
    and kept on the meta: fla's short conv then never makes its own blocking copy of them."""
    return meta.memo(
        ("fla_chunk_indices", str(device)), lambda: fla_chunk_indices(meta.cu_seqlens_cpu(), device)
    )


def _projections(layer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask) -> tuple:
    """The token-local input projections: ``(mixed [B, T, 2 * key_dim + value_dim], z [B, T, H, V],
    b [B, T, H], a [B, T, H])`` (``mixed``: q, k, v channels before the short convolution)."""
    B, T, _ = hidden_states.shape
    if attention_mask is not None and attention_mask.dim() == 2:  # as apply_mask_to_padding_states
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next: interleaved q/k/v/z and b/a projections
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(
            layer.in_proj_qkvz(hidden_states), layer.in_proj_ba(hidden_states)
        )
        mixed = torch.cat([x.reshape(B, T, -1) for x in (q, k, v)], dim=-1)
    else:  # Qwen3.5
        mixed = layer.in_proj_qkv(hidden_states)
        z = layer.in_proj_z(hidden_states).reshape(B, T, -1, layer.head_v_dim)
        b = layer.in_proj_b(hidden_states)
        a = layer.in_proj_a(hidden_states)
    return mixed, z, b, a


def _conv_weight(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [C, K], bias [C] or None)`` of the short convolution, read directly."""
    # a peft adapter (LoRA) on the conv: reading .weight would drop it
    if hasattr(layer.conv1d, "base_layer"):
        raise ValueError(
            f"{type(layer).__name__}(layer_idx={getattr(layer, 'layer_idx', '?')}).conv1d carries a LoRA / peft "
            "adapter; the packed short convolution reads conv1d.weight directly and would drop it: leave "
            "conv1d out of the adapter's target modules"
        )
    weight = layer.conv1d.weight
    return weight.reshape(weight.shape[0], -1), layer.conv1d.bias


def _conv_and_rule(
    layer: torch.nn.Module,
    mixed: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    meta: VarlenMeta,
    *,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dims: tuple[int, int, int, int],
    needs_grad: bool,
) -> torch.Tensor:
    """The short convolution and the gated delta rule over the whole row ``meta`` for the ``dims = (Hk, H, K,
    V)`` heads in ``mixed`` (``[1, T, Hk*K + Hk*K + H*V]``, ``weight`` / ``bias`` its channels), ``beta`` / ``g``
    ``[1, T, H]``: ``core [1, T, H, V]``."""
    B, T, _ = mixed.shape
    hk, hv, dk, dv = dims
    backend = getattr(layer, "_varpack_gdn_backend", "auto")
    device = mixed.device
    rule_backend = resolve_backend(backend, device, needs_grad=needs_grad, dims=dims)
    conv_backend = "auto" if backend in ("auto", "fla", "fla_hybrid") and device.type == "cuda" else "torch"
    if conv_backend != "torch":
        conv_kwargs = {
            "cu_seqlens": meta.cu_seqlens_on(device)[0],
            "cu_seqlens_cpu": meta.cu_seqlens_cpu(),
            "chunk_indices": _fla_chunk_indices(meta, device),
        }
    else:
        conv_kwargs = {"seq_idx": meta.seq_idx_on(device)}
    mixed = short_conv(
        mixed, weight, bias, conv_activation(layer.activation), backend=conv_backend, **conv_kwargs
    )
    query, key, value = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    query = query.reshape(B, T, -1, dk)
    key = key.reshape(B, T, -1, dk)
    value = value.reshape(B, T, -1, dv)
    # the rule on the linear-attention offsets when the meta has them (module docstring of VarlenMeta)
    if rule_backend in ("fla", "fla_hybrid"):  # fla's kernels: int64 offsets on the device + the CPU copy
        rule_kwargs = {"cu_seqlens": _rule_on(meta, device), "cu_seqlens_cpu": _rule_cpu(meta)}
        if rule_backend == "fla_hybrid":
            rule_kwargs["fla_boundaries"] = _fla_hybrid_boundaries(meta, device)
    else:
        rule_kwargs = {"cu_seqlens": _rule_cpu(meta), "layout": _chunk_layout(meta)}
    core, _ = gated_delta_rule(
        query, key, value, g, beta, use_qk_l2norm_in_kernel=True, backend=rule_backend, **rule_kwargs
    )
    return core


def _gates(layer: torch.nn.Module, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(beta, g)`` of the rule from the b / a projections (token-local; fp32 decay, as the model)."""
    return b.sigmoid(), -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)


def _packed_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask, meta: VarlenMeta):
    B, T, _ = hidden_states.shape
    mixed, z, b, a = _projections(layer, hidden_states, attention_mask)
    weight, bias = _conv_weight(layer)
    beta, g = _gates(layer, b, a)
    core = _conv_and_rule(
        layer, mixed, beta, g, meta, weight=weight, bias=bias, dims=layer_head_dims(layer),
        needs_grad=_needs_grad(layer, hidden_states),
    )  # fmt: skip
    core = layer.norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(core.reshape(B, T, -1))


def _context_parallel_channels(
    layer: torch.nn.Module, size: int, rank: int, rep: int, device: torch.device
) -> torch.Tensor:
    """The short convolution's channel rows of ``rank``'s heads (``[C_r]`` int64 on ``device``): its key heads
    (after repeating each ``rep`` times) in the q and k channels, its value heads in the v channels. Kept on
    the layer per (size, rank, rep, device): built once, no host-to-device copy per call."""
    key = (size, rank, rep, str(device))
    cache = layer.__dict__.setdefault("_varpack_cp_channels", {})
    if key not in cache:
        hk, hv, dk, dv = layer_head_dims(layer)
        per_k, per_v = hk * rep // size, hv // size
        heads_k = torch.arange(rank * per_k, (rank + 1) * per_k) // rep  # original key head of each local one
        d_k = torch.arange(dk)
        q_rows = (heads_k[:, None] * dk + d_k).reshape(-1)
        heads_v = torch.arange(rank * per_v, (rank + 1) * per_v)
        v_rows = 2 * layer.key_dim + (heads_v[:, None] * dv + torch.arange(dv)).reshape(-1)
        cache[key] = torch.cat([q_rows, layer.key_dim + q_rows, v_rows]).to(device)
    return cache[key]


def _context_parallel_forward(
    layer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask, meta: VarlenMeta, shard: Any
) -> torch.Tensor:
    """The layer on this rank's tokens of a row split over a context-parallel group (Ulysses): projections
    and gates on the rank's tokens, one all-to-all to head shards (q / k channels of its key heads, v channels
    and gates of its value heads, for every token of the row), the short convolution and the gated delta
    rule over the whole row for those heads, one all-to-all back, the norm and output projection on the rank's
    tokens. Key heads that do not divide the group are repeated (:func:`~varpack.attn.context_parallel.kv_replication`)."""
    from varpack.attn.context_parallel import heads_to_seq, kv_replication, seq_to_heads

    B, T_r, _ = hidden_states.shape
    hk, hv, dk, dv = layer_head_dims(layer)
    n = shard.size
    where = f"{type(layer).__name__}(layer_idx={getattr(layer, 'layer_idx', '?')})"
    if hv % n:
        raise ValueError(
            f"{where}: {hv} value heads do not divide over {n} context-parallel ranks (the gated delta rule "
            "runs whole heads over the whole row)"
        )
    rep = kv_replication(hv, hk, n)
    mixed, z, b, a = _projections(layer, hidden_states, attention_mask)
    beta, g = _gates(layer, b, a)
    q, k, v = torch.split(mixed[0], [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    q, k = q.reshape(T_r, hk, dk), k.reshape(T_r, hk, dk)
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    per_k, per_v = hk * rep // n, hv // n
    # one all-to-all for the channels and beta (the model's dtype), one for the fp32 decay g
    blocks = torch.cat(
        [
            q.reshape(T_r, n, per_k * dk),
            k.reshape(T_r, n, per_k * dk),
            v.reshape(T_r, n, per_v * dv),
            beta[0].reshape(T_r, n, per_v).to(mixed.dtype),
        ],
        dim=2,
    )
    width = blocks.shape[2]
    whole = seq_to_heads(blocks.reshape(T_r, n * width), shard)  # [T, width]
    g_whole = seq_to_heads(g[0], shard)  # [T, per_v]
    mixed_r, beta_r = torch.split(whole, [width - per_v, per_v], dim=-1)
    weight, bias = _conv_weight(layer)
    rows = _context_parallel_channels(layer, n, shard.rank, rep, weight.device)
    core = _conv_and_rule(
        layer, mixed_r[None], beta_r[None].to(beta.dtype), g_whole[None], meta,
        weight=weight.index_select(0, rows), bias=None if bias is None else bias.index_select(0, rows),
        dims=(per_k, per_v, dk, dv), needs_grad=_needs_grad(layer, hidden_states),
    )  # fmt: skip
    core = heads_to_seq(core[0], shard)  # [T_r, H, V]
    core = layer.norm(core.reshape(-1, dv), z.reshape(-1, dv))
    return layer.out_proj(core.reshape(B, T_r, -1))


def layer_head_dims(layer: torch.nn.Module) -> tuple[int, int, int, int]:
    """``(Hk, H, K, V)`` of a Gated DeltaNet layer (key heads, value heads, their dims): the dims fla's probes
    run at, so that their autotuning is the layer's own (:func:`varpack.ops.gated_delta_rule.resolve_backend`)."""
    return (
        layer.key_dim // layer.head_k_dim,
        layer.value_dim // layer.head_v_dim,
        layer.head_k_dim,
        layer.head_v_dim,
    )


def _needs_grad(layer: torch.nn.Module, hidden_states: torch.Tensor) -> bool:
    # training mode counts as needing gradients even under no_grad (reentrant gradient checkpointing runs
    # the first forward without grad): the recomputation must use the same backend as the first pass
    return layer.training or (
        torch.is_grad_enabled()
        and (hidden_states.requires_grad or any(p.requires_grad for p in layer.parameters()))
    )


def _truth_via_varpack(layer: torch.nn.Module, hidden_states: torch.Tensor) -> bool:
    """True for the fp32 truth copy of ``varpack check`` (``layer._varpack_gdn_truth``, set by
    :func:`varpack.check._truth_gated_delta`) on CUDA: its unpacked rows run varpack's path with the layer's
    backend (the PyTorch chunked path) rather than transformers' forward, which on CUDA calls fla's Triton
    kernels when fla is installed (fp32 dots in TF32: a weaker truth, and a second autotuning). On the CPU
    transformers' forward is its PyTorch reference: kept, an implementation independent of varpack's."""
    return bool(getattr(layer, "_varpack_gdn_truth", False)) and hidden_states.device.type == "cuda"


def _original_cannot_train(layer: torch.nn.Module, hidden_states: torch.Tensor) -> bool:
    """True where transformers' own forward would dispatch to fla (installed) but fla's backward cannot run
    on this device (fla 0.6.0 on Hopper with Triton < 3.7.1): training through the original would fail.
    Probed at the layer's own head dims (:func:`layer_head_dims`), as the packed path probes: one fla
    autotuning and one :func:`varpack.ops._fla.autotune_notice` for the model's shape, not a second pair at
    the default probe dims."""
    if hidden_states.device.type != "cuda" or not _needs_grad(layer, hidden_states):
        return False
    if load_fla()[0] is None:
        return False
    _, backward = fla_gated_delta_status(hidden_states.device, layer_head_dims(layer))
    return not backward[0]


def _traced_packed_forward(
    layer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask, meta: VarlenMeta
) -> torch.Tensor:
    """The packed forward as ``torch.compile`` traces it (``compile_layers(custom_ops=True)``): the same
    projections, gates, norm and output projection as :func:`_packed_forward`; the short convolution with the
    segment index computed in the graph from the meta's offsets (:func:`varpack.varlen.seq_idx_on_device`: no
    host read, no data-dependent shape), on varpack's Triton kernels where Triton runs (:func:`_traced_conv_backend`),
    else on the PyTorch path, its output cut into q, k and v (each contiguous), q and k L2-normalised per head
    by the convolution (``short_conv(..., l2norm=...)``: no separate norm kernels, and the rule's residuals
    are q and k themselves; heads above 256 channels leave the norm to the rule); the gated delta rule
    on the meta's ``cu_seqlens_linear`` when it has them (a static row's pad segments as one sequence: fewer
    chunks, the same real tokens; its chunk tables ``linear_chunk_rows`` long), else on its offsets
    as the ``varpack::gated_delta_rule`` custom op, one graph node, with the offsets on
    the device and the meta's CPU copy (the ``chunk`` / ``fla_hybrid`` backends build their chunk plans from
    it inside the op: host work, no device sync). A layer compiled for CUDA graphs
    (``_varpack_static_boundaries``, set by :func:`varpack.integrations.cuda_graphs.compile_layers_as_graphs`)
    passes no CPU copy: ``fla_hybrid`` then builds fixed-size chunk tables on the device
    (:func:`varpack.ops.gated_delta_rule.fla_hybrid.device_fla_hybrid_boundaries`), replay-safe. The backend is resolved at trace time from the layer's
    backend, device, grad need and head dims. ``hidden_states`` ``[1, T, hidden]`` -> ``[1, T, hidden]``."""
    B, T, _ = hidden_states.shape
    device = hidden_states.device
    mixed, z, b, a = _projections(layer, hidden_states, attention_mask)
    weight, bias = _conv_weight(layer)
    beta, g = _gates(layer, b, a)
    hk, hv, dk, dv = layer_head_dims(layer)
    cu_host = meta.cu_seqlens_q
    cu = cu_host.to(device=device, dtype=torch.int32)  # in the graph: a no-op for offsets already there
    # the rule runs on the linear-attention offsets (a static row's pad segments as one sequence) when given
    lin_host = meta.cu_seqlens_linear if meta.cu_seqlens_linear is not None else cu_host
    lin = lin_host.to(device=device, dtype=torch.int32)
    if getattr(layer, "_varpack_static_boundaries", False):
        lin_cpu = None  # CUDA-graph layers: fla_hybrid builds fixed-size chunk tables on the device
    else:
        lin_cpu = lin_host if lin_host.device.type == "cpu" else _rule_cpu(meta)
    # q, k and v come out of the convolution as three contiguous tensors (the Triton kernels write each
    # straight into its own; the rule reads them contiguous): no copies of the split; q and k L2-normalised
    # per head there too (in fp32 before rounding), so the rule runs without its own l2norm
    fused_norm = dk <= TRITON_MAX_L2NORM_HEAD
    query, key, value = short_conv(
        mixed, weight, bias, conv_activation(layer.activation), seq_idx=seq_idx_on_device(cu, T),
        backend=_traced_conv_backend(device.type, -1 if device.index is None else device.index),
        split=[hk * dk, hk * dk, hv * dv], l2norm=[dk, dk, 0] if fused_norm else None,
    )  # fmt: skip
    core, _ = gated_delta_rule_op(
        query.reshape(B, T, hk, dk), key.reshape(B, T, hk, dk), value.reshape(B, T, hv, dv), g, beta,
        cu_seqlens=lin, cu_seqlens_cpu=lin_cpu, use_qk_l2norm_in_kernel=not fused_norm,
        backend=getattr(layer, "_varpack_gdn_backend", "auto"), needs_grad=_needs_grad(layer, hidden_states),
        chunk_rows=meta.linear_chunk_rows if meta.cu_seqlens_linear is not None else None,
    )  # fmt: skip
    core = layer.norm(core.reshape(-1, dv), z.reshape(-1, dv))
    return layer.out_proj(core.reshape(B, T, -1))


@torch.compiler.assume_constant_result
def _traced_conv_backend(device_type: str, device_index: int) -> str:
    """The traced layer's short convolution: varpack's Triton kernels (``varpack::short_conv``, one forward and
    one backward kernel; :func:`varpack.ops.short_conv.triton_conv_status`) wherever Triton runs them, else the
    PyTorch path; a trace-time constant."""
    from varpack.ops.short_conv import triton_conv_status

    device = torch.device(device_type, device_index) if device_index >= 0 else torch.device(device_type)
    return "triton" if triton_conv_status(device)[0] else "torch"


def _traced_call(layer: torch.nn.Module, hidden_states: torch.Tensor, args: tuple, kwargs: dict):
    """Inside a compiled layer with ``custom_ops``: the traced packed forward for a packed, cache-free call
    on one row outside context parallelism; ``None`` for every other call (it then runs as a graph break,
    where the eager path raises its errors)."""
    cache = args[0] if args else next((kwargs[k] for k in CACHE_KEYS if kwargs.get(k) is not None), None)
    attention_mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
    meta = kwargs.get(VARLEN_META)
    if meta is None:
        meta = getattr(layer, "_varpack_meta", None)  # handed over by the decoder layer's pre-hook
    if (
        meta is None
        or cache is not None
        or hidden_states.shape[0] != 1
        or current_shard(layer, kwargs) is not None
        or (attention_mask is not None and attention_mask.dim() == 2)
    ):
        return None
    # the meta's token count was checked against the row where it was bound (the text model's pre-hook)
    return _traced_packed_forward(layer, hidden_states, None, meta)


def _patched_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    if torch.compiler.is_compiling():
        # inside a torch.compile'd decoder layer (varpack.integrations.kernels.compile_layers): with custom_ops
        # a packed call is traced whole (the rule as one custom-op node); otherwise the mixer is a graph break,
        # like varpack attention (traced eagerly, its data-dependent chunking would recompile for every pack)
        if getattr(self, "_varpack_custom_op", False):
            out = _traced_call(self, hidden_states, args, kwargs)
            if out is not None:
                return out
        return _patched_forward_outside_graph(self, hidden_states, *args, **kwargs)
    B, T = hidden_states.shape[:2]
    cache = args[0] if args else next((kwargs[k] for k in CACHE_KEYS if kwargs.get(k) is not None), None)
    attention_mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
    meta = current_meta(self, T, kwargs)
    if meta is None:
        if cache is None and (
            _truth_via_varpack(self, hidden_states) or _original_cannot_train(self, hidden_states)
        ):
            # each row is one sequence: the same math through varpack's path, whose backward runs here
            rows = VarlenMeta(torch.arange(B + 1, dtype=torch.int32) * T)
            mask = (
                attention_mask.reshape(1, B * T)
                if attention_mask is not None and attention_mask.dim() == 2
                else None
            )
            out = _packed_forward(self, hidden_states.reshape(1, B * T, -1), mask, rows)
            return out.reshape(B, T, -1)
        return self._varpack_gdn_original_forward(hidden_states, *args, **kwargs)
    where = mixer_name(self)
    if B != 1:
        raise ValueError(
            f"{where}: packed boundaries need one row [1, T], got hidden_states {tuple(hidden_states.shape)}"
        )
    if cache is not None:
        raise ValueError(
            f"{where}: packed batch with a cache ({type(cache).__name__}); incremental decoding cannot be "
            "combined with packing (use_cache=False for packed training batches)"
        )
    shard = current_shard(self, kwargs)
    if shard is not None:
        return _context_parallel_forward(self, hidden_states, attention_mask, meta, shard)
    return _packed_forward(self, hidden_states, attention_mask, meta)


_patched_forward_outside_graph = torch.compiler.disable(_patched_forward)


# ---------------------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------------------
def _check_structure(module: torch.nn.Module) -> None:
    need = [
        "conv1d",
        "A_log",
        "dt_bias",
        "norm",
        "out_proj",
        "key_dim",
        "value_dim",
        "head_k_dim",
        "head_v_dim",
    ]
    missing = [n for n in need if not hasattr(module, n)]
    if hasattr(module, "in_proj_qkvz"):
        missing += [n for n in ("in_proj_ba", "fix_query_key_value_ordering") if not hasattr(module, n)]
    else:
        missing += [
            n for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a") if not hasattr(module, n)
        ]
    if missing:
        raise TypeError(
            f"{type(module).__name__} does not have the Qwen3.5 / Qwen3-Next GatedDeltaNet structure varpack "
            f"knows (missing {missing}); it cannot be patched for packed batches"
        )


def patch_linear_attention(model: torch.nn.Module, *, backend: str = "auto") -> int:
    """Make every Gated DeltaNet layer of ``model`` reset its short conv and recurrent state at sample boundaries.

    Works on transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3_5TextModel`` (and the text tower of
    ``Qwen3_5ForConditionalGeneration``) and ``Qwen3NextForCausalLM`` / ``Qwen3NextModel``. After patching, a
    forward with ``cu_seq_lens_q`` (``[N+1]`` int32, CPU) and/or ``seq_idx`` (``[1, T]``) over a packed
    ``input_ids [1, T]`` equals running the ``N`` samples one by one (logits, loss, gradients); a forward
    without them is unchanged. Idempotent: patching again only updates ``backend``.

    Args:
        model: a transformers model containing ``*GatedDeltaNet`` modules.
        backend: gated delta rule backend, ``"auto"`` (fla when it runs forward and backward on the
            device, else ``fla_hybrid`` when ``AUTO_FLA_HYBRID`` is on and its probe passes, else varpack's
            chunked PyTorch path),
            ``"fla"``, ``"fla_hybrid"``, ``"chunk"``, ``"chunk_compiled"`` or ``"naive"`` (see
            :mod:`varpack.ops.gated_delta_rule.dispatch`). With ``"fla"``/``"fla_hybrid"``/``"auto"`` on
            CUDA the short conv uses fla's ``causal_conv1d`` when its probe passed.

    Returns:
        The number of GatedDeltaNet layers patched (0 for a model without any).

    Raises:
        ValueError: an unknown backend name.
        TypeError: a GatedDeltaNet module whose structure varpack does not know.
        (At forward time) ValueError: boundaries with ``B > 1``, with a cache or ``use_cache=True``, or not
        covering the row; RuntimeError: a forced backend that cannot run on the device.
    """
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(
            f"unknown linear-attention backend {backend!r}; expected 'auto' or one of {BACKENDS}"
        )
    layers = [m for m in model.modules() if _is_gdn(m)]
    for m in layers:
        _check_structure(m)
    if not layers:
        return 0
    install_mixer_hooks(model, layers, _patched_forward, original_attr="_varpack_gdn_original_forward")
    for m in layers:
        m._varpack_gdn_backend = backend
    return len(layers)


def linear_attention_backend(
    model: torch.nn.Module, device: torch.device | str, *, needs_grad: bool = True
) -> tuple[str, str] | None:
    """The gated delta rule backend the Gated DeltaNet layers of ``model`` run on ``device``, and why.

    Reads the backend :func:`patch_linear_attention` set on the layers (``"auto"`` on layers never patched)
    and resolves it as their packed forward will (:func:`varpack.ops.gated_delta_rule.dispatch.resolve_backend_reason`):
    ``"auto"`` with the probes' reasons (``("chunk", "auto on cpu: varpack's chunked PyTorch path")``), a
    forced name as ``(name, "forced")``. Call it before training to refuse a forced backend that cannot run
    here up front instead of at the first packed forward. The fla / fla_hybrid probes run once per device
    (on CUDA: a tiny problem and Triton compiles on the first call).

    Args:
        model: a model, patched or not.
        device: where the layers will run (the training device, not necessarily the model's now).
        needs_grad: the layers will be trained (fla counts only if its backward runs too).

    Returns:
        ``(name, why)``, or ``None`` for a model without Gated DeltaNet layers.

    Raises:
        RuntimeError: a forced backend that cannot run on ``device``, with its reason
            (``gated delta rule backend 'fla_hybrid' cannot run on cpu: fla_hybrid needs a CUDA device, got cpu``).
        ValueError: the layers carry different backends (patched separately), or an unknown name.
    """
    layers = [m for m in model.modules() if _is_gdn(m)]
    if not layers:
        return None
    names = sorted({getattr(m, "_varpack_gdn_backend", "auto") for m in layers})
    if len(names) > 1:
        raise ValueError(
            f"the {len(layers)} Gated DeltaNet layers of {type(model).__name__} carry different gated delta "
            f"rule backends {names}; patch them with one (patch_linear_attention(model, backend=...))"
        )
    # at the layers' own head dims: fla's probe then autotunes for the model's shape, once
    return resolve_backend_reason(
        names[0], torch.device(device), needs_grad=needs_grad, dims=layer_head_dims(layers[0])
    )
