"""Training objectives: how a packed batch becomes a loss. The Trainer
(:class:`varpack.train.trainer.PackedSFTTrainer`) asks its objective for the loss and for the item count of the
``"sample"`` reduction; it keeps the rest (loss implementation choice, rank scaling, logging).

:data:`OBJECTIVES` maps a name to an :class:`Objective`: ``"sft"``
(:class:`varpack.train.objectives.sft.CausalLMObjective`: next-token cross entropy of the packed row) and
``"dpo"`` (:class:`varpack.train.objectives.dpo.DPOObjective`: DPO on packed preference pairs; ``build_sft``
makes one with the run's ``beta`` / ``label_smoothing`` / ``loss_type`` and reference model, and
:class:`varpack.train.trainer.PackedSFTTrainer` takes an objective object as well as a name).

A new objective is one file in this folder (a class with ``name``, ``loss`` and ``count_items`` of
:class:`Objective`; ``own_item_count = True`` when the step's denominator is its own count, not the supervised
tokens) plus one registry line below; its settings are ``SFTConfig`` fields, which appear as ``varpack sft``
flags by themselves (:mod:`varpack.train.cli_flags`). Nothing here imports torch at import time.
"""

from __future__ import annotations

from varpack.train.objectives.base import Objective, ObjectiveLoss
from varpack.train.objectives.dpo import DPOObjective as _DPO
from varpack.train.objectives.sft import CausalLMObjective

__all__ = ["OBJECTIVES", "Objective", "ObjectiveLoss", "get_objective"]


#: name -> objective. A new objective is one file in this folder and one line here.
OBJECTIVES: dict[str, Objective] = {
    "sft": CausalLMObjective(),
    "dpo": _DPO(),
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
