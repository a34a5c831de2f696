"""The objective interface (:class:`Objective`) and its result (:class:`ObjectiveLoss`); registry in
:mod:`varpack.train.objectives`."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

__all__ = ["Objective", "ObjectiveLoss"]


class ObjectiveLoss(NamedTuple):
    """What :meth:`Objective.loss` returns."""

    #: float32 scalar tensor, already divided by ``num_items_in_batch`` (or the batch's own count).
    loss: Any
    #: the model's outputs when the objective ran ``model(**inputs)`` (``None`` for the fused linear CE).
    outputs: Any
    #: the loss implementation that ran: ``"logits"`` or ``"linear_ce"``.
    impl: str


class Objective(Protocol):
    """A training objective: the loss of one packed micro-batch, and its share of the step's denominator."""

    name: str

    def loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        *,
        reduction: str,
        num_items_in_batch: Any,
        linear_ce: bool,
    ) -> ObjectiveLoss:
        """Loss of ``inputs`` (a collated packed batch, boundaries unwrapped) under ``model``."""
        ...

    def count_items(self, batch: dict[str, Any], *, reduction: str) -> Any:
        """Items of ``batch`` the step's loss is averaged over (a device tensor)."""
        ...
