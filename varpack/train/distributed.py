"""Checks across data-parallel ranks (``torch.distributed``): every rank must train the same plan."""

from __future__ import annotations

__all__ = ["check_same_on_all_ranks"]


def check_same_on_all_ranks(value: str, *, what: str = "pack plan") -> None:
    """Raise unless every rank of the default process group holds the same ``value`` (a fingerprint).

    One ``all_gather_object`` of a short string; nothing when ``torch.distributed`` is not initialized or has
    one rank.

    Raises:
        RuntimeError: the values differ, naming each rank's value (first 16 characters).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    values: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if len(set(values)) > 1:
        shown = ", ".join(f"rank {r}: {str(v)[:16]}" for r, v in enumerate(values))
        raise RuntimeError(
            f"the {what} differs across ranks ({shown}); every rank must encode and plan the same data with "
            "the same settings (files, tokenizer, packing_length, packing_strategy, overflow, seed, "
            "packs_per_step, grad_accum, rank_balance, attention_cost_weight)"
        )
