"""Packs per rank: which packs each data-parallel rank trains in each micro-batch, balanced by cost.

Pure numpy, deterministic from the plan, the seed, the epoch and the layout (world size, packs per rank per
micro-batch); every rank computes the same layout and takes its own column, so no rank talks to another.

Cost model (:func:`pack_costs`). The step time of a pack is, to first order, its FLOPs: the linear layers
cost the same per token (``2 x params`` FLOPs forward), causal attention costs per pair of tokens of one
sample (``QK^T`` and ``AV``: ``2 x H x D`` multiply-adds per (query, key) pair, ``L (L + 1) / 2 ~ L^2 / 2``
pairs per causal sample of ``L`` tokens; Kaplan et al. 2020, "Scaling laws", Table 1; Dao 2023,
FlashAttention-2, section 4.1 counts ``4 x L^2 x D x H / 2`` FLOPs for causal attention). Backward is about
twice forward for both, so the ratio does not change. In units of "one token through the linear layers"::

    cost(pack) = tokens + attention_weight x sum_i L_i^2
    attention_weight = (attention layers x H x D) / (multiply-adds per token of the linear layers and the LM head)

(:func:`attention_cost_weight` reads it off a transformers config; Qwen3-0.6B: 9.6e-5, so one 8,192-token
sample costs 1.8x a pack of 8,192 tokens of short samples.)

Layout (:func:`epoch_layout`). With ``W`` ranks and ``P`` packs per rank per micro-batch, a micro-batch
slot takes ``W x P`` packs. The epoch's packs (the plan's per-epoch permutation, ``PackPlan.pack_order``)
are sorted by cost (stable, so equal costs keep the random order), cut into slots of ``W x P`` neighbours in
cost (near-equal costs), dealt to the ranks in snake order (rank ``0..W-1``, then ``W-1..0``, ...), and the
slots are shuffled (``(seed, epoch)``). A slot therefore costs about the same on every rank whatever the
mix of lengths; the price is that one micro-batch's packs are of similar cost (as transformers'
``LengthGroupedSampler`` groups by length).

Remainder. When ``W x P`` does not divide the number of packs, the last slot holds the ``r < W x P``
cheapest packs: a rank gets ``floor`` or ``ceil(r / W)`` of them (a shorter micro-batch, the loss stays the
global token mean through ``num_items_in_batch``); when ``r < W`` the ranks without a pack get ``-1`` in the
layout, which the sampler turns into a *masked* copy of the cheapest pack (every label ``-100``: it adds no
loss, no gradient and no count, and lets every rank take part in the all-reduce). No sample is dropped or
repeated with weight.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

__all__ = [
    "PER_TOKEN_LAYER_TYPES",
    "attention_cost_weight",
    "epoch_layout",
    "layout_imbalance",
    "pack_costs",
    "pack_membership_fingerprint",
]


def pack_costs(plan: Any, attention_weight: float = 0.0) -> np.ndarray:
    """Cost of every pack of ``plan``: ``tokens + attention_weight x sum_i L_i^2`` (module docstring).

    Args:
        plan: a :class:`varpack.plan.PackPlan` (``offsets``, ``item_lengths``, ``pack_lengths``).
        attention_weight: ``>= 0``; 0 balances tokens only.

    Returns:
        ``[P]`` float64, in units of one token through the linear layers.

    Raises:
        ValueError: a negative ``attention_weight``.
    """
    if not attention_weight >= 0:
        raise ValueError(f"attention_weight must be >= 0, got {attention_weight!r}")
    tokens = np.asarray(plan.pack_lengths, dtype=np.float64)
    if tokens.size == 0:
        return tokens
    sq = np.asarray(plan.item_lengths, dtype=np.float64) ** 2
    sum_sq = np.add.reduceat(sq, np.asarray(plan.offsets[:-1], dtype=np.int64))
    return tokens + float(attention_weight) * sum_sq


#: ``layer_types`` entries of layers that cost per token, not per (query, key) pair: linear attention / Gated
#: DeltaNet and Mamba-2 mixers ("linear_attention", older configs "mamba"), MLP / MoE blocks (Nemotron-H),
#: short convolutions (LFM2 "conv"), recurrent blocks (RecurrentGemma)
PER_TOKEN_LAYER_TYPES = frozenset({"linear_attention", "mamba", "mlp", "moe", "conv", "recurrent"})


def _attends_per_pair(layer_type: Any, config_name: str) -> bool:
    """Whether a ``layer_types`` entry has softmax attention (cost per (query, key) pair): any ``*attention``
    but linear attention (full, sliding, chunked: a sliding window is counted as full), and ``"hybrid"``
    (Falcon-H1: attention beside a Mamba-2 mixer; Zamba2: the shared attention block before a mixer).

    Raises:
        ValueError: a layer type that is neither (its cost is unknown), naming it.
    """
    t = str(layer_type)
    if t in PER_TOKEN_LAYER_TYPES:
        return False
    if t == "hybrid" or t.endswith("attention"):
        return True
    raise ValueError(
        f"cannot read the attention cost off {config_name}: layer type {t!r} of its layer_types is neither "
        f"attention ('*attention', 'hybrid') nor per token ({sorted(PER_TOKEN_LAYER_TYPES)}); "
        "give attention_cost_weight explicitly"
    )


def attention_cost_weight(config: Any) -> float:
    """``attention_weight`` of :func:`pack_costs` for a transformers model config (FLOPs, module docstring).

    Multiply-adds per token of the linear layers: per layer ``q, o: d x H x D``, ``k, v: d x Hkv x D``, MLP
    ``3 x d x I`` (SwiGLU; MoE: ``3 x d x I_moe x experts per token``), plus the LM head ``d x V`` once.
    Attention: ``H x D`` multiply-adds per (query, key) pair per attention layer. With ``layer_types``, only
    the layers whose entry has softmax attention count (``*attention`` but linear attention, and ``"hybrid"``);
    linear attention / Gated DeltaNet, Mamba-2 mixers, MLP and MoE blocks cost per token
    (:data:`PER_TOKEN_LAYER_TYPES`). A model without attention layers (pure Mamba-2) has weight 0. A
    vision-language config is read through its text config.

    Returns:
        float ``>= 0`` (``0``: no attention layer).

    Raises:
        ValueError: the config lacks ``hidden_size`` / ``num_attention_heads`` / ``num_hidden_layers`` (and
            does not list layer types without attention), or a ``layer_types`` entry is of an unknown kind.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(cfg, "layer_types", None)
    full = None if not types else sum(_attends_per_pair(t, type(cfg).__name__) for t in types)
    if full == 0:
        return 0.0
    try:
        d = int(cfg.hidden_size)
        heads = int(cfg.num_attention_heads)
        layers = int(cfg.num_hidden_layers)
    except (AttributeError, TypeError) as e:
        raise ValueError(
            f"cannot read the attention cost off {type(cfg).__name__}: it needs hidden_size, "
            f"num_attention_heads and num_hidden_layers ({e}); give attention_cost_weight explicitly"
        ) from None
    head_dim = int(getattr(cfg, "head_dim", None) or d // heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    inter = int(getattr(cfg, "intermediate_size", None) or 4 * d)
    if getattr(cfg, "num_experts_per_tok", None) and getattr(cfg, "moe_intermediate_size", None):
        inter = int(cfg.moe_intermediate_size) * int(cfg.num_experts_per_tok)
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    per_layer = 2 * d * heads * head_dim + 2 * d * kv * head_dim + 3 * d * inter
    full = layers if full is None else full
    return full * heads * head_dim / (layers * per_layer + d * vocab)


def _snake_ranks(n: int, world_size: int) -> np.ndarray:
    """Rank of each of ``n`` packs sorted by cost, dealt 0..W-1, W-1..0, 0..W-1, ..."""
    j = np.arange(n)
    lap, pos = np.divmod(j, world_size)
    return np.where(lap % 2 == 0, pos, world_size - 1 - pos)


def epoch_layout(
    order: np.ndarray,
    costs: np.ndarray,
    *,
    world_size: int,
    packs_per_rank: int = 1,
    balance: bool = True,
    seed: int = 0,
    epoch: int = 0,
) -> np.ndarray:
    """The packs of every rank in every micro-batch slot of one epoch.

    Args:
        order: ``[n]`` int64 pack ids to lay out, in the epoch's random order (``plan.pack_order(epoch)``,
            or the packs left of it after a resume).
        costs: ``[P]`` float64 cost of every pack of the plan (:func:`pack_costs`), indexed by pack id.
        world_size: ranks ``W >= 1``.
        packs_per_rank: packs per rank per micro-batch ``>= 1`` (``packs_per_step``).
        balance: sort by cost into slots of near-equal cost and shuffle the slots (module docstring);
            ``False`` (or ``W == 1``): slots in ``order``, dealt in order (rank ``r`` takes entries
            ``r x P .. r x P + P - 1`` of each slot).
        seed, epoch: the slot shuffle's seed (``numpy.random.SeedSequence([seed, epoch, 1])``).

    Returns:
        ``[S, W, P]`` int64 pack ids, ``S = ceil(n / (W x P))`` slots; ``-1`` where a rank has fewer than
        ``P`` packs in the last slot (the remainder, module docstring). Every id of ``order`` appears once.

    Raises:
        ValueError: ``world_size`` or ``packs_per_rank`` below 1, or ``order`` repeats a pack.
    """
    if world_size < 1 or packs_per_rank < 1:
        raise ValueError(f"world_size and packs_per_rank must be >= 1, got {world_size}, {packs_per_rank}")
    order = np.asarray(order, dtype=np.int64)
    if np.unique(order).size != order.size:
        raise ValueError("order repeats a pack id")
    W, P = int(world_size), int(packs_per_rank)
    slot = W * P
    n = order.size
    S = -(-n // slot)
    out = np.full((S, W, P), -1, dtype=np.int64)
    if n == 0:
        return out
    if balance and W > 1:
        ranked = order[np.argsort(-np.asarray(costs)[order], kind="stable")]
        full = n // slot
        body = ranked[: full * slot].reshape(full, slot)
        ranks = _snake_ranks(slot, W)  # the same deal in every full slot
        for r in range(W):
            out[:full, r, :] = body[:, ranks == r]
        rest = ranked[full * slot :]
        if rest.size:
            ranks = _snake_ranks(rest.size, W)
            for r in range(W):
                mine = rest[ranks == r]
                out[full, r, : mine.size] = mine
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), 1]))
        out[:full] = out[:full][rng.permutation(full)]  # the short remainder slot stays last
    else:
        padded = np.full(S * slot, -1, dtype=np.int64)
        padded[:n] = order
        grid = padded.reshape(S, W, P)
        if n % slot:  # the last slot: spread its packs over the ranks (floor / ceil each), not rank 0 first
            rest = order[(S - 1) * slot :]
            grid[-1] = -1
            ranks = np.arange(rest.size) % W
            for r in range(W):
                mine = rest[ranks == r]
                grid[-1, r, : mine.size] = mine
        out[:] = grid
    return out


def layout_imbalance(layout: np.ndarray, costs: np.ndarray) -> dict[str, float]:
    """How long ranks wait at the all-reduce of each slot, from the cost model.

    Returns:
        ``{"imbalance"``: sum over slots of the slowest rank's cost / sum over slots of the mean rank cost
        (the time of a synchronous run over the time of a perfectly balanced one; 1.0 = no waiting),
        ``"worst_slot"``: the largest max / mean of one slot, ``"slots"``: number of slots}. A rank without
        a pack in a slot runs the masked copy of the cheapest pack (module docstring), counted at that cost.
    """
    costs = np.asarray(costs, dtype=np.float64)
    c = np.where(layout >= 0, costs[np.maximum(layout, 0)], 0.0).sum(axis=2)  # [S, W]
    if costs.size:
        c = np.where((layout < 0).all(axis=2), costs.min(), c)
    mx, mean = c.max(axis=1), c.mean(axis=1)
    ok = mean > 0
    return {
        "imbalance": float(mx.sum() / mean.sum()) if mean.sum() else 1.0,
        "worst_slot": float((mx[ok] / mean[ok]).max()) if ok.any() else 1.0,
        "slots": int(layout.shape[0]),
    }


def pack_membership_fingerprint(plan: Any, **settings: Any) -> str:
    """SHA-256 (hex) of which ids are in which pack (``offsets``, ``items``, the pieces' ranges) and of
    ``settings`` (any JSON-like keywords: seed, world size, ...): two ranks that would train different
    packs, or lay them out differently, get different fingerprints.

    Unlike ``PackPlan.fingerprint`` (the lengths the plan was made *for*), this hashes the plan's result.
    """
    h = hashlib.sha256()
    h.update(
        f"varpack-packs/1|packing_length={int(plan.packing_length)}|strategy={plan.strategy}|"
        f"seed={int(plan.seed)}|num_samples={int(plan.num_samples)}|".encode()
    )
    for name in ("offsets", "items", "piece_sample", "piece_start", "piece_stop"):
        arr = np.ascontiguousarray(np.asarray(getattr(plan, name)), dtype="<i8")
        h.update(f"{name}:{arr.size}|".encode())
        h.update(memoryview(arr).cast("B"))
    h.update(repr(sorted(settings.items())).encode())
    return h.hexdigest()
