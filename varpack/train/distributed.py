"""Data-parallel ranks (``torch.distributed``): every rank must train the same plan, and the process group is
closed without hanging."""

from __future__ import annotations

__all__ = ["check_same_on_all_ranks", "close_process_group"]


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


def close_process_group() -> None:
    """Barrier, then destroy the default process group (torchrun / accelerate open it; the Trainer leaves it open).

    A gloo group left to the interpreter's exit can abort the process ("terminate called without an active
    exception"). And a group must not be destroyed by the last DDP ``Reducer`` that holds it, right after a
    collective: that destructor runs with the GIL held and waits for gloo's worker thread, which may be freeing
    the finished collective's tensors and needs the GIL, and the process hangs (torch's process-group destructor
    releases the GIL, the ``Reducer``'s does not; pytorch/pytorch#56297). So callers drop their DDP-wrapped
    models first, and this collects cyclic garbage (a Trainer's wrapped model) while the group is still
    registered. Nothing when ``torch.distributed`` is not initialized.
    """
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
