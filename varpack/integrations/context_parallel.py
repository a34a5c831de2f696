"""Context parallelism on a transformers model: the ranks of a context-parallel group share one packed row.

:func:`enable_context_parallel` makes a model (already on varpack attention, :func:`enable_varpack`) run a
context-parallel shard of a batch (:func:`varpack.collate.shard_batch`): this rank's tokens, the whole row's
boundaries, ``cp_shard``. Nothing else changes in the model: a batch without ``cp_shard`` runs the
one-process path, unchanged. Where each piece lives:

* the packing guard (:mod:`varpack.integrations.transformers`) binds the batch's shard to this model's process
  group and attention mode once per forward (:func:`bind_shard`), checking that it is this rank's share of
  the row the boundaries describe;
* full-attention layers: varpack's attention function hands the shard to
  :func:`varpack.attn.context_parallel.context_parallel_attention` (Ulysses, or ring attention where the
  heads do not divide);
* Gated DeltaNet layers (:mod:`varpack.integrations.gated_delta`): projections on this rank's tokens, one
  all-to-all to head shards, the short convolution (its channels) and the gated delta rule (its heads) on
  the whole row, one all-to-all back; the gate / norm / output projection on this rank's tokens. Key heads
  that do not divide are replicated; value heads that do not divide are refused (the recurrence has no ring
  form);
* a vision-language model: a pre-hook on the model owning the vision tower runs the tower on EVERY image of
  the row (each rank, before the split: a rank's placeholder tokens may belong to any image) and keeps, for
  each placeholder token of this rank, its feature row (and DeepStack rows), handing them to the model as
  ``mm_encoder_outputs``; the model scatters them into its own placeholder slots as usual.

Gradients: every rank's backward yields its share of every parameter's gradient (the vision tower's from the
rows it kept, a convolution's from the channels it ran); summed over the ranks of a group they are the
one-process gradient. Data parallelism over the whole world (DDP / FSDP2 over ``dp x cp`` ranks, with the
loss divided by the global count of supervised tokens and multiplied by the world size, as varpack's
Trainer does) sums them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from varpack.attn.context_parallel import (
    CONTEXT_PARALLEL_ATTENTION,
    kv_replication,
    resolve_context_parallel_attention,
)
from varpack.models.registry import family_of, is_vl_model
from varpack.schema import CP_SHARD, IMAGE_GRID_THW, PIXEL_VALUES, PIXEL_VALUES_VIDEOS, VIDEO_GRID_THW
from varpack.varlen.shard import ContextParallelShard

__all__ = [
    "ContextParallelState",
    "bind_shard",
    "context_parallel_mesh",
    "context_parallel_plan",
    "enable_context_parallel",
    "model_context_parallel",
]

_STATE = "_varpack_context_parallel"


@dataclass(frozen=True)
class ContextParallelState:
    """What :func:`enable_context_parallel` installed: the group, its size, this rank's index in it, the
    attention mode asked for (``auto`` / ``ulysses`` / ``ring``) and what each layer kind resolves to."""

    group: Any
    size: int
    rank: int
    attention: str
    plan: dict[str, str]


def context_parallel_mesh(cp: int, device_type: str | None = None) -> Any:
    """The 2-D ``DeviceMesh`` ``("dp", "cp")`` of the world: ``world // cp`` data-parallel replicas of ``cp``
    context-parallel ranks each (consecutive ranks share a row: rank = dp_index * cp + cp_index).

    Args:
        cp: ranks per context-parallel group (``>= 1``).
        device_type: ``"cpu"`` or ``"cuda"`` (default: cuda when available).

    Raises:
        ValueError: ``torch.distributed`` not initialized, or a world size that ``cp`` does not divide.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"context_parallel={cp} needs torch.distributed: launch with torchrun --nproc-per-node {cp} (or a "
            "multiple of it)"
        )
    world = dist.get_world_size()
    if cp < 1 or world % cp:
        raise ValueError(
            f"context_parallel={cp} must divide the world size {world} (world = data parallel x context parallel)"
        )
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(device_type, (world // cp, cp), mesh_dim_names=("dp", "cp"))


def _group_of(group_or_mesh: Any) -> tuple[Any, int, int]:
    """``(process group, size, rank in it)`` of a ProcessGroup, a 1-D DeviceMesh or a mesh with a ``cp`` dim."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group_or_mesh, DeviceMesh):
        mesh = group_or_mesh
        if mesh.ndim > 1:
            names = mesh.mesh_dim_names or ()
            if "cp" not in names:
                raise ValueError(f"a {mesh.ndim}-D DeviceMesh needs a 'cp' dimension, got names {names}")
            mesh = mesh["cp"]
        group = mesh.get_group()
    else:
        group = group_or_mesh if group_or_mesh is not None else dist.group.WORLD
    return group, dist.get_world_size(group), dist.get_rank(group)


def context_parallel_plan(model: torch.nn.Module, size: int, attention: str = "auto") -> dict[str, str]:
    """What each kind of token-mixing layer of ``model`` runs over ``size`` context-parallel ranks, in words
    (``{"attention": "ulysses (4 heads / 2 ranks, 2 KV heads)", "gated_delta": "ulysses (...)"}``).

    Raises:
        ValueError: an unknown mode; forced Ulysses whose attention heads do not divide ``size``; Gated DeltaNet
            layers whose value heads do not divide ``size`` (their recurrence has no ring form), naming the layer.
    """
    if attention not in CONTEXT_PARALLEL_ATTENTION:
        raise ValueError(
            f"unknown context-parallel attention {attention!r}; choose one of {list(CONTEXT_PARALLEL_ATTENTION)}"
        )
    family = family_of(model)
    cfg = family.text_config(model)
    plan: dict[str, str] = {}
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    mode = resolve_context_parallel_attention(attention, heads, size)
    if mode == "ulysses":
        rep = kv_replication(heads, kv_heads, size)
        kv = f"{kv_heads} KV heads" + (f" replicated x{rep}" if rep > 1 else "")
        plan["attention"] = f"ulysses ({heads} heads / {size} ranks, {kv})"
    else:
        plan["attention"] = f"ring ({heads} heads, zigzag key/value blocks over {size} ranks)"
    layers = family.linear_layers(model)
    if layers:
        from varpack.integrations.gated_delta import layer_head_dims

        hk, hv, _, _ = layer_head_dims(layers[0])
        if hv % size:
            raise ValueError(
                f"{type(layers[0]).__name__}(layer_idx={getattr(layers[0], 'layer_idx', '?')}) has {hv} value "
                f"heads, which do not divide over {size} context-parallel ranks: its gated delta rule runs "
                "whole heads over the whole row (Ulysses), and a recurrence has no ring form. Use a "
                "--context-parallel that divides the value heads"
            )
        rep = kv_replication(hv, hk, size)
        plan["gated_delta"] = f"ulysses ({hv} value heads / {size} ranks, {hk} key heads" + (
            f" replicated x{rep})" if rep > 1 else ")"
        )
    return plan


def enable_context_parallel(
    model: torch.nn.Module, group: Any = None, *, attention: str = "auto"
) -> torch.nn.Module:
    """Let ``model`` run context-parallel shards over ``group`` (module docstring).

    Args:
        model: a transformers model on varpack attention (:func:`varpack.integrations.transformers.enable_varpack`
            called first), or a peft model around one.
        group: the context-parallel ``ProcessGroup``, a 1-D ``DeviceMesh``, or the 2-D mesh of
            :func:`context_parallel_mesh` (its ``cp`` dimension); ``None``: the whole world.
        attention: ``"auto"`` (Ulysses where the attention heads divide the group, else ring attention),
            ``"ulysses"`` or ``"ring"``.

    Returns:
        The same model; ``model._varpack_context_parallel`` holds the :class:`ContextParallelState`.
        Idempotent (calling it again replaces the state).

    Raises:
        ValueError: ``enable_varpack`` not applied; the errors of :func:`context_parallel_plan`.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(inner, "_varpack_state", None) is None:
        raise ValueError(
            f"{type(inner).__name__} is not on varpack attention: call varpack.integrations.transformers."
            "enable_varpack(model) before enable_context_parallel"
        )
    pg, size, rank = _group_of(group)
    plan = context_parallel_plan(inner, size, attention)
    state = ContextParallelState(group=pg, size=size, rank=rank, attention=attention, plan=plan)
    base = getattr(inner, "base_model", inner)
    for module in {id(inner): inner, id(base): base}.values():
        object.__setattr__(module, _STATE, state)
    if is_vl_model(inner):
        _install_vision_step(inner)
    return model


def model_context_parallel(model: torch.nn.Module) -> ContextParallelState | None:
    """The :class:`ContextParallelState` of a model (or its base model / a peft wrapper), ``None`` without one."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(inner, "module", inner)  # DDP's wrapped module
    return getattr(inner, _STATE, None)


def bind_shard(
    model: torch.nn.Module, shard: Any, local_tokens: int | None, where: str
) -> ContextParallelShard:
    """The batch's shard bound to the model's group and attention mode, after checking it belongs here
    (called by the packing guard once per forward).

    Raises:
        ValueError: not a :class:`ContextParallelShard`; a model without :func:`enable_context_parallel`; a shard
            of another group size or rank; ``local_tokens`` other than the shard's.
    """
    if not isinstance(shard, ContextParallelShard):
        raise ValueError(
            f"{where}: cp_shard must be a varpack.varlen.shard.ContextParallelShard, got {type(shard).__name__}"
        )
    state = getattr(model, _STATE, None)
    if state is None:
        raise ValueError(
            f"{where} got a context-parallel shard (cp_shard) but context parallelism is not enabled on it: call "
            "varpack.integrations.context_parallel.enable_context_parallel(model, group)"
        )
    if shard.size != state.size or shard.rank != state.rank:
        raise ValueError(
            f"{where}: the batch is rank {shard.rank}'s share of a row split over {shard.size} ranks, but this "
            f"process is rank {state.rank} of a context-parallel group of {state.size}"
        )
    if local_tokens is not None and local_tokens != shard.num_local:
        raise ValueError(
            f"{where}: the batch holds {local_tokens} tokens but its cp_shard gives rank {shard.rank} "
            f"{shard.num_local} of the row's {shard.total}"
        )
    if shard.group is state.group and shard.attention == state.attention:
        return shard
    return shard.bind(state.group, state.attention)


# -----------------------------------------------------------------------------------------------------------
# the vision tower before the split
# -----------------------------------------------------------------------------------------------------------
_MODALITIES = (
    ("image", PIXEL_VALUES, IMAGE_GRID_THW, "image_token_id"),
    ("video", PIXEL_VALUES_VIDEOS, VIDEO_GRID_THW, "video_token_id"),
)


def _local_feature_rows(shard: ContextParallelShard, token_id: int) -> tuple[torch.Tensor, int]:
    """``(rows, placeholders in the row)``: for each placeholder token of this rank (row order), the index of
    its feature row among the row's placeholders."""

    def build() -> tuple[torch.Tensor, int]:
        if shard.full_input_ids is None:
            raise ValueError(
                "a vision-language context-parallel shard needs the whole row's input_ids on its cp_shard "
                "(varpack.collate.shard_batch keeps them when the batch has media)"
            )
        is_tok = shard.full_input_ids == token_id
        rank_of = torch.cumsum(is_tok.to(torch.int64), 0) - 1
        local = shard.index
        return rank_of[local][is_tok[local]], int(is_tok.sum())

    return shard.memo(("feature_rows", int(token_id)), build)


def _vision_before_split(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    shard = kwargs.get(CP_SHARD)
    if shard is None or not any(kwargs.get(m[1]) is not None for m in _MODALITIES):
        return None
    kwargs = dict(kwargs)
    config = module.config
    outputs = dict(kwargs.get("mm_encoder_outputs") or {})
    for modality, pix_key, grid_key, token_attr in _MODALITIES:
        pixels = kwargs.pop(pix_key, None)
        if pixels is None:
            continue
        encode = getattr(module, f"get_{modality}_features")
        enc = encode(pixels, kwargs.get(grid_key), return_dict=True)  # every image of the row, on every rank
        rows, slots = _local_feature_rows(shard, int(getattr(config, token_attr)))
        features = torch.cat(tuple(enc.pooler_output), dim=0)
        if features.shape[0] != slots:
            raise ValueError(
                f"{modality} slots != features: the row holds {slots} {modality} placeholder tokens but the vision "
                f"tower gave {features.shape[0]} feature rows"
            )
        rows = rows.to(features.device)
        enc.pooler_output = (features.index_select(0, rows),)
        deep = getattr(enc, "deepstack_features", None)
        if deep:
            enc.deepstack_features = [(torch.cat(tuple(f), dim=0).index_select(0, rows),) for f in deep]
        outputs[modality] = enc
    kwargs["mm_encoder_outputs"] = outputs
    return args, kwargs


def _install_vision_step(model: torch.nn.Module) -> None:
    """The pre-hook of the module that owns ``get_image_features`` (the base model of a Qwen-VL model)."""
    owner = next(
        (m for m in (getattr(model, "base_model", None), getattr(model, "model", None), model)
         if m is not None and hasattr(m, "get_image_features")),
        None,
    )  # fmt: skip
    if owner is None:
        raise TypeError(
            f"{type(model).__name__} is vision-language but has no get_image_features to run before the split"
        )
    if getattr(owner, "_varpack_cp_vision_hook", None) is None:
        handle = owner.register_forward_pre_hook(_vision_before_split, with_kwargs=True)
        object.__setattr__(owner, "_varpack_cp_vision_hook", handle)
