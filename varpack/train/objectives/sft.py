"""The SFT objective: next-token cross entropy of a packed causal-LM batch.

``logits``: ``model(**inputs)`` then :func:`varpack.loss.causal_lm_loss` with the batch's ``seq_idx`` (no
prediction crosses a sample boundary) and ``loss_scale``; ``linear_ce``:
:func:`varpack.ops.linear_ce.causal_lm_forward_with_linear_ce` (chunked LM head + cross entropy, never the
``[T, V]`` logits). Both divide by ``num_items_in_batch`` (supervised tokens, or samples with a supervised
token for ``reduction="sample"``; see :mod:`varpack.loss`).
"""

from __future__ import annotations

from typing import Any

from varpack.schema import (
    BATCH_STATS,
    BOOKKEEPING_BATCH_KEYS,
    CP_SHARD,
    IGNORE_INDEX,
    NOT_MODEL_INPUTS,
    SHIFT_LABELS,
    SHIFT_LOSS_SCALE,
)
from varpack.train.objectives.base import ObjectiveLoss

__all__ = ["CausalLMObjective"]


class CausalLMObjective:
    """Packed causal-LM loss (registered as ``"sft"`` in :data:`varpack.train.objectives.OBJECTIVES`)."""

    name = "sft"

    def loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        *,
        reduction: str = "token",
        num_items_in_batch: Any = None,
        linear_ce: bool = False,
    ) -> ObjectiveLoss:
        """Loss of one collated packed micro-batch.

        Args:
            model: a causal LM on varpack attention.
            inputs: the collator's batch with the boundaries unwrapped: ``input_ids`` / ``labels`` /
                ``seq_idx`` / ``position_ids`` ``[1, T]`` int64, ``cu_seq_lens_q/k`` ``[N+1]`` int32, optional
                ``loss_scale`` ``[1, T]`` float and bookkeeping keys (dropped here).
            reduction: ``"token"`` or ``"sample"``.
            num_items_in_batch: the step's denominator (``None``: this batch's own count).
            linear_ce: run the chunked linear cross entropy instead of materialising the logits; with the
                collator's ``batch_stats`` in ``inputs`` the LM head runs on the supervised rows only
                (``max_supervised`` of :func:`varpack.ops.linear_ce.linear_cross_entropy`).

        Returns:
            :class:`varpack.train.objectives.base.ObjectiveLoss` ``(loss, outputs, impl)``.

        An MoE model that returns its router's auxiliary loss (``config.output_router_logits=True``) gets
        ``config.router_aux_loss_coef * aux_loss`` added, as its own forward adds it when given labels; on a
        packed row that loss is the one of the same samples as a padded batch with the padding masked
        (:mod:`varpack.models.moe`).

        Raises:
            ValueError: from :func:`varpack.loss.causal_lm_loss` (mismatched shapes, ``"sample"`` without
                ``seq_idx``); ``linear_ce`` with ``output_router_logits`` (the head-less path has no router
                loss).
        """
        if inputs.get(CP_SHARD) is not None:
            return self._context_parallel_loss(model, inputs, reduction, num_items_in_batch, linear_ce)
        if linear_ce:
            from varpack.ops.linear_ce import causal_lm_forward_with_linear_ce

            if getattr(getattr(model, "config", None), "output_router_logits", False):
                raise ValueError(
                    "linear_ce runs the base model without its head, which leaves out the MoE router's "
                    "auxiliary loss (config.output_router_logits=True); train with linear_ce off, or set "
                    "output_router_logits=False to train without that loss"
                )

            batch = {k: v for k, v in inputs.items() if k not in BOOKKEEPING_BATCH_KEYS}
            stats = inputs.get(BATCH_STATS)  # the collator's host count: the LM head skips prompt rows
            loss = causal_lm_forward_with_linear_ce(
                model,
                batch,
                reduction=reduction,
                num_items_in_batch=num_items_in_batch,
                max_supervised=None if stats is None else int(stats["supervised_tokens"]),
            )
            return ObjectiveLoss(loss, None, "linear_ce")
        from varpack.loss import causal_lm_loss

        model_inputs = {k: v for k, v in inputs.items() if k not in NOT_MODEL_INPUTS}
        outputs = model(**model_inputs)
        loss = causal_lm_loss(
            outputs.logits,
            inputs["labels"],
            reduction=reduction,
            seq_idx=inputs.get("seq_idx"),
            num_items_in_batch=num_items_in_batch,
            loss_scale=inputs.get("loss_scale"),
        )
        aux = getattr(outputs, "aux_loss", None)
        if aux is not None:  # MoE router load balancing (output_router_logits=True), added as transformers does
            loss = loss + float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0) * aux.to(loss.dtype)
        return ObjectiveLoss(loss, outputs, "logits")

    def _context_parallel_loss(
        self, model: Any, inputs: dict[str, Any], reduction: str, num_items_in_batch: Any, linear_ce: bool
    ) -> ObjectiveLoss:
        """The loss of a context-parallel shard (:func:`varpack.collate.shard_batch`): this rank's logits
        against the targets shifted before the split (:func:`varpack.loss.shifted_lm_loss`), divided by the
        step's global count of supervised tokens."""
        from varpack.loss import shifted_lm_loss

        if reduction != "token":
            raise ValueError(
                f"loss_reduction={reduction!r} with context parallelism: a sample's tokens are spread over the "
                "ranks of the group; use loss_reduction='token'"
            )
        if linear_ce:
            raise ValueError(
                "loss_impl='linear_ce' with context parallelism is not implemented: use loss_impl='logits' (or auto)"
            )
        if num_items_in_batch is None:
            raise ValueError(
                "a context-parallel shard needs num_items_in_batch: the supervised tokens of the whole step summed "
                "over every rank (a rank's own count would weigh its tokens wrongly)"
            )
        model_inputs = {k: v for k, v in inputs.items() if k not in NOT_MODEL_INPUTS}
        outputs = model(**model_inputs)
        loss = shifted_lm_loss(
            outputs.logits,
            inputs[SHIFT_LABELS],
            num_items_in_batch=num_items_in_batch,
            loss_scale=inputs.get(SHIFT_LOSS_SCALE),
        )
        return ObjectiveLoss(loss, outputs, "logits")

    def count_items(self, batch: dict[str, Any], *, reduction: str) -> Any:
        """Supervised tokens (``"token"``) or samples with a supervised token (``"sample"``) of ``batch``:
        :func:`varpack.loss.count_loss_items_tensor` (a tensor on the batch's device, no host sync). For a
        context-parallel shard: its supervised shifted targets (summed over the group's ranks: the row's)."""
        from varpack.loss import count_loss_items_tensor

        if batch.get(CP_SHARD) is not None:
            if reduction != "token":
                raise ValueError(f"loss_reduction={reduction!r} with context parallelism; use 'token'")
            return (batch[SHIFT_LABELS] != IGNORE_INDEX).sum()
        return count_loss_items_tensor(batch["labels"], reduction=reduction, seq_idx=batch["seq_idx"])
