"""Training objectives: how a packed batch becomes a loss. The Trainer
(:class:`varpack.train.trainer.PackedSFTTrainer`) asks its objective for the loss and for the item count of the
``"sample"`` reduction; it keeps the rest (loss implementation choice, rank scaling, logging).

:data:`OBJECTIVES` maps a name to an :class:`Objective`; today one entry, ``"sft"``
(:class:`varpack.train.objectives.sft.CausalLMObjective`: next-token cross entropy of the packed row).

Adding a preference objective (DPO), one file plus one registry line:

1. ``varpack/train/objectives/dpo.py`` with a class that has ``name = "dpo"`` and the two methods of
   :class:`Objective`: ``loss`` reads the chosen / rejected pieces of the packed row (the packer puts a
   prompt's chosen and rejected answers in one pack, ``seq_idx`` telling them apart), sums the per-token
   log-probabilities of each answer with the policy (and a frozen reference model or precomputed reference
   log-probabilities carried as a batch field), and returns ``-logsigmoid(beta * margin)`` over pairs;
   ``count_items`` counts pairs, so a step with gradient accumulation still has the gradient of one big batch.
2. ``"dpo": DPOObjective()`` in :data:`OBJECTIVES` below.

The config side (a ``Literal`` field naming the objective, its ``beta``) then appears as ``varpack sft`` flags
by itself (:mod:`varpack.train.cli_flags`). Nothing here imports torch at import time.
"""

from __future__ import annotations

from varpack.train.objectives.base import Objective, ObjectiveLoss
from varpack.train.objectives.sft import CausalLMObjective

__all__ = ["OBJECTIVES", "Objective", "ObjectiveLoss", "get_objective"]


#: name -> objective. A new objective is one file in this folder and one line here.
OBJECTIVES: dict[str, Objective] = {
    "sft": CausalLMObjective(),
}


def get_objective(name: str) -> Objective:
    """The registered objective ``name``.

    Raises:
        ValueError: an unknown name (the message lists :data:`OBJECTIVES`).
    """
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown objective {name!r}; choose one of {sorted(OBJECTIVES)}") from None
