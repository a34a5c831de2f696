"""``BalancedPackSampler``: each data-parallel rank's packs, micro-batch by micro-batch, balanced by cost and
resumable mid-epoch on the same or another number of ranks.

A batch sampler over a plan's packs (use it with ``PackedDataset(..., shuffle=False)``: the sampler yields
plan pack ids and does the per-epoch order itself). Every rank builds the same sampler with its own
``rank`` and gets its column of :func:`varpack.plan.balance.epoch_layout`; the cost model, the remainder
rule and the masked filler pack are described in :mod:`varpack.plan.balance`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch.utils.data import Sampler

from varpack.plan.balance import epoch_layout, pack_costs, pack_membership_fingerprint

__all__ = ["BalancedPackSampler", "MaskedPack", "SAMPLER_STATE_FORMAT"]

SAMPLER_STATE_FORMAT = "varpack-pack-sampler/1"


class MaskedPack(int):
    """A dataset index meaning "pack ``int(self)`` with every label ``-100``": the filler micro-batch of a
    rank that has no pack left in the last slot of an epoch. :class:`varpack.data.dataset.PackedDataset`
    returns its samples with ``labels`` all ``-100`` and ``sample_id`` ``None``, so it adds no loss, no
    gradient, no ``num_items_in_batch`` and no sample to any count."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"MaskedPack({int(self)})"


class BalancedPackSampler(Sampler):
    """Batch sampler: yields, for one rank, the list of plan pack ids of each of its micro-batches.

    Every rank yields the same number of micro-batches (``len(sampler)``), so the ranks step together;
    every pack of the plan is yielded by exactly one rank once per epoch (``MaskedPack`` fillers aside).

    Args:
        plan: a :class:`varpack.plan.PackPlan`.
        rank, world_size: this rank (``0 <= rank < world_size``) and the number of data-parallel ranks.
        packs_per_rank: packs per rank per micro-batch (``SFTConfig.packs_per_step``).
        grad_accum: micro-batches per optimizer step (only for counting steps in :meth:`state_dict`).
        attention_weight: the cost model's weight of ``sum L_i^2`` (:func:`varpack.plan.balance.pack_costs`).
        balance: balance slots by cost (``False``: the plan's per-epoch order dealt round-robin).
        seed: seed of the slot shuffle (default: the plan's seed); the pack order is ``plan.pack_order``.
        epoch: initial epoch.

    Resuming: :meth:`state_dict` records the epoch and the optimizer steps done under each layout
    (world size, packs per rank, accumulation) of that epoch; :meth:`load_state_dict` recomputes which packs
    those steps trained and lays the *rest* of the epoch out for this sampler's world size. The next epoch
    (:meth:`set_epoch`) is whole again.

    Raises:
        ValueError: a bad ``rank`` / ``world_size`` / ``packs_per_rank`` / ``grad_accum``.
    """

    def __init__(
        self,
        plan: Any,
        *,
        rank: int = 0,
        world_size: int = 1,
        packs_per_rank: int = 1,
        grad_accum: int = 1,
        attention_weight: float = 0.0,
        balance: bool = True,
        seed: int | None = None,
        epoch: int = 0,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if packs_per_rank < 1 or grad_accum < 1:
            raise ValueError(f"packs_per_rank and grad_accum must be >= 1, got {packs_per_rank}, {grad_accum}")
        self.plan = plan
        self.rank, self.world_size = int(rank), int(world_size)
        self.packs_per_rank, self.grad_accum = int(packs_per_rank), int(grad_accum)
        self.attention_weight = float(attention_weight)
        self.balance = bool(balance)
        self.seed = int(plan.seed if seed is None else seed)
        self.costs = pack_costs(plan, self.attention_weight)
        self.filler = int(np.argmin(self.costs)) if self.costs.size else 0
        self.plan_fingerprint = pack_membership_fingerprint(plan)
        self.epoch = int(epoch)
        self._segments: list[tuple[int, int, int, int]] = []  # earlier layouts of this epoch: (W, P, G, steps)
        self._yielded = 0

    # ------------------------------------------------------------------ layout
    def fingerprint(self) -> str:
        """SHA-256 of the plan's packs and every setting that decides the layout (not ``rank``): equal on
        every rank of one run (:func:`varpack.plan.balance.pack_membership_fingerprint`)."""
        return pack_membership_fingerprint(
            self.plan,
            world_size=self.world_size,
            packs_per_rank=self.packs_per_rank,
            grad_accum=self.grad_accum,
            attention_weight=self.attention_weight,
            balance=self.balance,
            seed=self.seed,
        )

    def _layout(self, order: np.ndarray, world_size: int, packs_per_rank: int) -> np.ndarray:
        return epoch_layout(
            order,
            self.costs,
            world_size=world_size,
            packs_per_rank=packs_per_rank,
            balance=self.balance,
            seed=self.seed,
            epoch=self.epoch,
        )

    def remaining_packs(self) -> np.ndarray:
        """Pack ids this epoch still has to train (all of them unless resumed), in the epoch's order."""
        order = np.asarray(self.plan.pack_order(self.epoch), dtype=np.int64)
        for W, P, G, steps in self._segments:
            done = self._layout(order, W, P)[: steps * G]
            order = order[~np.isin(order, done[done >= 0])]
        return order

    def layout(self) -> np.ndarray:
        """``[S, W, P]`` pack ids of the rest of this epoch (``-1``: none), every rank's columns."""
        return self._layout(self.remaining_packs(), self.world_size, self.packs_per_rank)

    def set_epoch(self, epoch: int) -> None:
        """Lay out ``epoch`` (whole, unless it is the epoch a loaded state is in the middle of)."""
        if int(epoch) != self.epoch:
            self._segments = []
        self.epoch = int(epoch)

    def __len__(self) -> int:
        n = self.remaining_packs().size
        return -(-n // (self.world_size * self.packs_per_rank))

    def __iter__(self):
        layout = self.layout()
        self._yielded = 0
        for s in range(layout.shape[0]):
            mine = layout[s, self.rank]
            mine = mine[mine >= 0]
            self._yielded += 1
            yield mine.tolist() if mine.size else [MaskedPack(self.filler)]

    # ------------------------------------------------------------------ resume
    def state_dict(self, consumed_steps: int | None = None) -> dict[str, Any]:
        """JSON-ready state after ``consumed_steps`` optimizer steps of the current layout (default: the
        micro-batches this sampler has yielded since its last ``__iter__``, divided by ``grad_accum``, which
        is right for a loop that steps every ``grad_accum`` micro-batches and prefetches nothing).

        Returns:
            ``{"format", "epoch", "segments": [[world_size, packs_per_rank, grad_accum, steps], ...],
            "plan_fingerprint", "attention_weight", "balance", "seed"}``.
        """
        k = self._yielded // self.grad_accum if consumed_steps is None else int(consumed_steps)
        if k < 0:
            raise ValueError(f"consumed_steps must be >= 0, got {consumed_steps}")
        segments = [list(s) for s in self._segments]
        if k:
            segments.append([self.world_size, self.packs_per_rank, self.grad_accum, k])
        return {
            "format": SAMPLER_STATE_FORMAT,
            "epoch": self.epoch,
            "segments": segments,
            "plan_fingerprint": self.plan_fingerprint,
            "attention_weight": self.attention_weight,
            "balance": self.balance,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the epoch of ``state`` with the packs its steps did not train, laid out for this
        sampler's world size / packs per rank (which may differ from the state's).

        Raises:
            ValueError: not a sampler state, or made for another plan or with another cost model, balance or
                seed (the packs its steps trained could not be recomputed), naming the field.
        """
        if not isinstance(state, dict) or state.get("format") != SAMPLER_STATE_FORMAT:
            raise ValueError(f"not a {SAMPLER_STATE_FORMAT} state: {str(state)[:200]}")
        mine = {
            "plan_fingerprint": self.plan_fingerprint,
            "attention_weight": self.attention_weight,
            "balance": self.balance,
            "seed": self.seed,
        }
        for key, value in mine.items():
            if state.get(key) != value:
                raise ValueError(
                    f"sampler state was saved with {key}={state.get(key)!r} but this sampler has {value!r}: "
                    "resume with the same plan, attention_cost_weight, rank_balance and seed"
                )
        self.epoch = int(state["epoch"])
        self._segments = [tuple(int(v) for v in s) for s in state["segments"]]  # type: ignore[misc]
        self._yielded = 0
