"""The DPO objective on packed preference pairs: per-sequence log-probabilities from the boundaries, the
reference model on the same packed row, TRL's sigmoid / robust DPO loss.

Layout. :mod:`varpack.data.preference` encodes pair ``k`` as samples ``2k`` (chosen) and ``2k + 1``
(rejected), labels on the completion tokens only; the planner keeps both in one pack
(:func:`varpack.plan.plan_packs` ``groups``) and lays them out consecutively, so a collated row holds whole
pairs, chosen before rejected (checked on the batch's ``sample_ids``, host-side, no device read).

Per-sequence log-probabilities (:func:`sequence_logps`): the per-token log-probability of every label under
the row's logits (``-cross_entropy``, float32), masked to supervised predictions inside one sample
(``seq_idx`` of the prediction and of its target agree), summed per sample with ONE ``index_add_`` over the
row indexed by ``seq_idx`` (the boundaries of :class:`varpack.varlen.VarlenMeta`); no Python loop over
samples. Equal to TRL's ``per_token_logps.sum(dim=1)`` over the completion of each padded sequence.

Reference model: run alongside (as TRL's ``DPOTrainer`` does without ``precompute_ref_log_probs``): the
frozen reference takes the same packed batch (same ``cu_seq_lens_q/k`` / ``varlen_meta``) under
``torch.no_grad()`` in the same step, so its log-probabilities are in the same packed layout and need no
cache keyed by pack (packs are reshuffled every epoch and a cache would hold one float per sample anyway);
it costs one extra forward per step, no backward. With a LoRA model and no reference given, the reference
is the model with its adapters disabled (peft's ``disable_adapter()``), as in TRL.

Loss (:func:`dpo_loss`), TRL 1.16 ``DPOTrainer._compute_loss`` with ``f_divergence_type="reverse_kl"``:
``delta = (chosen - ref_chosen) - (rejected - ref_rejected)``;

* ``"sigmoid"``: ``-logsigmoid(beta * delta)`` (Rafailov et al. 2023). TRL 1.16's sigmoid loss does not
  read ``label_smoothing``; varpack refuses a non-zero ``label_smoothing`` with it rather than ignore it;
* ``"robust"``: ``(-(1 - eps) logsigmoid(beta delta) + eps logsigmoid(-beta delta)) / (1 - 2 eps)`` with
  ``eps = label_smoothing`` in ``[0, 0.5)`` (Robust DPO, Chowdhury et al. 2024; TRL's ``"robust"``).

The step's loss is the mean over the pairs of the whole optimizer step (``num_items_in_batch`` = pairs of
all accumulation micro-batches, :meth:`DPOObjective.count_items`), so a step with gradient accumulation has
the gradient of one big batch; TRL averages over the pairs of a micro-batch.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any

from varpack.schema import IGNORE_INDEX, NOT_MODEL_INPUTS
from varpack.train.objectives.base import ObjectiveLoss

if TYPE_CHECKING:
    import torch

__all__ = [
    "DPO_LOSS_TYPES",
    "DPOObjective",
    "check_dpo_settings",
    "dpo_loss",
    "pair_layout",
    "sequence_logps",
]

#: loss types (TRL's ``loss_type`` names)
DPO_LOSS_TYPES = ("sigmoid", "robust")


def check_dpo_settings(beta: float, label_smoothing: float, loss_type: str) -> None:
    """Refuse DPO settings that TRL would refuse or ignore.

    Raises:
        ValueError: ``beta`` not a finite number > 0, an unknown ``loss_type``, ``label_smoothing`` outside
            ``[0, 0.5)``, or a non-zero ``label_smoothing`` with ``loss_type="sigmoid"`` (TRL 1.16 ignores it
            there; ``"robust"`` uses it).
    """
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta must be a finite number > 0, got {beta!r}")
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    if not (isinstance(label_smoothing, (int, float)) and 0.0 <= label_smoothing < 0.5):
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    if loss_type == "sigmoid" and label_smoothing != 0:
        raise ValueError(
            f"label_smoothing={label_smoothing} has no effect on loss_type='sigmoid' (TRL 1.16's sigmoid DPO loss "
            "does not read it); use loss_type='robust' for label-noise-robust DPO, or label_smoothing=0"
        )


def sequence_logps(
    logits: torch.Tensor,
    labels: torch.Tensor,
    seq_idx: torch.Tensor,
    num_seqs: int,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Sum of the log-probabilities of each sample's labels in a packed row.

    Args:
        logits: ``[1, T, V]`` (or ``[T, V]``) any float dtype; logits at ``t`` predict ``labels[t + 1]``.
        labels: ``[1, T]`` (or ``[T]``) int64, ``ignore_index`` where nothing is scored.
        seq_idx: ``[1, T]`` (or ``[T]``) integer sample index of every token, ``0..num_seqs-1`` (the batch's
            ``seq_idx``, a view of its ``VarlenMeta``).
        num_seqs: ``N``, segments in the row (a Python int: ``VarlenMeta.num_seqs``, a pad segment included).

    Returns:
        ``[N]`` float32: ``sum_t log softmax(logits[t])[labels[t + 1]]`` over the predictions whose target is a
        label of the same sample (``seq_idx[t] == seq_idx[t + 1]``, label not ``ignore_index``); 0 for a
        sample without labels. One ``index_add_`` over the row; no host sync.

    Raises:
        ValueError: mismatched shapes.
    """
    import torch
    import torch.nn.functional as F

    if logits.dim() == 2:
        logits, labels, seq_idx = logits[None], labels.reshape(1, -1), seq_idx.reshape(1, -1)
    if logits.dim() != 3 or logits.shape[:2] != labels.shape or labels.shape != seq_idx.shape:
        raise ValueError(
            f"sequence_logps: logits {tuple(logits.shape)}, labels {tuple(labels.shape)} and seq_idx "
            f"{tuple(seq_idx.shape)} must be [B, T, V], [B, T], [B, T]"
        )
    if logits.shape[0] != 1:
        raise ValueError(f"sequence_logps takes one packed row (B = 1), got B = {logits.shape[0]}")
    targets = labels[0, 1:]
    seg = seq_idx[0, 1:].to(torch.int64)
    valid = (targets != ignore_index) & (seg == seq_idx[0, :-1].to(torch.int64))
    token_logps = -F.cross_entropy(
        logits[0, :-1].float(), targets.masked_fill(~valid, 0), reduction="none"
    ).masked_fill(~valid, 0.0)
    out = torch.zeros(num_seqs, dtype=torch.float32, device=logits.device)
    return out.index_add_(0, seg, token_logps)


def pair_layout(sample_ids: Any) -> int:
    """Number of pairs of a collated row, after checking that it holds whole pairs, chosen first: sample ids
    ``2k, 2k + 1, 2k', 2k' + 1, ...`` (:mod:`varpack.data.preference`'s numbering, kept together by the
    planner's groups).

    Raises:
        ValueError: no ``sample_ids``, an odd count, or a row whose samples are not whole pairs in order.
    """
    if not sample_ids or any(s is None for s in sample_ids):
        raise ValueError(
            "the DPO objective needs the batch's sample_ids (pair k = samples 2k, 2k + 1) to tell chosen from "
            "rejected; collate PackedDataset packs with PaddingFreeCollator"
        )
    ids = [int(s) for s in sample_ids]
    if len(ids) % 2 or any(c % 2 or r != c + 1 for c, r in zip(ids[0::2], ids[1::2])):
        raise ValueError(
            f"a DPO batch must hold whole preference pairs, chosen then rejected (sample ids 2k, 2k + 1), got "
            f"sample ids {ids[:12]}{' ...' if len(ids) > 12 else ''}; plan the packs with "
            "plan_packs(..., groups=pair_groups(n)) and overflow 'error' or 'drop'"
        )
    return len(ids) // 2


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> torch.Tensor:
    """Per-pair DPO loss, TRL 1.16's formula (module docstring).

    Args:
        chosen_logps, rejected_logps: ``[P]`` float, the policy's summed completion log-probabilities.
        ref_chosen_logps, ref_rejected_logps: ``[P]`` float, the reference model's.
        beta: TRL's ``beta`` (> 0).
        label_smoothing: TRL's ``label_smoothing`` (``"robust"`` only; ``[0, 0.5)``).
        loss_type: ``"sigmoid"`` or ``"robust"``.

    Returns:
        ``[P]`` per-pair losses (TRL's ``per_sequence_loss``; its loss is their mean).

    Raises:
        ValueError: settings refused by :func:`check_dpo_settings`.
    """
    import torch.nn.functional as F

    check_dpo_settings(beta, label_smoothing, loss_type)
    delta = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    eps = label_smoothing
    return (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)


class DPOObjective:
    """Packed DPO (registered as ``"dpo"`` in :data:`varpack.train.objectives.OBJECTIVES` with TRL's defaults
    and no reference model: a LoRA model's adapter-free base then serves as reference).

    Args:
        beta, label_smoothing, loss_type: as :func:`dpo_loss`.
        ref_model: the frozen reference model on varpack attention (put in eval mode, no gradients; moved to
            the batch's device at the first step), or None (LoRA: the adapters disabled).

    Raises:
        ValueError: settings refused by :func:`check_dpo_settings`.
    """

    name = "dpo"
    #: the Trainer always asks :meth:`count_items` for the step's denominator (pairs, not tokens)
    own_item_count = True
    #: :meth:`loss` reads log-probabilities from the logits whatever ``linear_ce`` says (the Trainer's report
    #: of the loss implementation reads this)
    supports_linear_ce = False

    def __init__(
        self,
        *,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        loss_type: str = "sigmoid",
        ref_model: Any = None,
    ) -> None:
        check_dpo_settings(beta, label_smoothing, loss_type)
        self.beta, self.label_smoothing, self.loss_type = float(beta), float(label_smoothing), loss_type
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.eval()
            ref_model.requires_grad_(False)
        #: the last micro-batch's detached ``chosen`` / ``rejected`` rewards (``beta * log ratio``) ``[P]``
        self.last_rewards: tuple[torch.Tensor, torch.Tensor] | None = None

    def __repr__(self) -> str:
        return (
            f"DPOObjective(beta={self.beta}, label_smoothing={self.label_smoothing}, loss_type={self.loss_type!r}, "
            f"ref_model={type(self.ref_model).__name__ if self.ref_model is not None else None})"
        )

    def _reference(self, model: Any, device: torch.device) -> tuple[Any, Any]:
        """``(reference model, context to run it in)``."""
        if self.ref_model is not None:
            ref = self.ref_model
            first = next(ref.parameters(), None)
            if first is not None and first.device != device:
                ref.to(device)
            return ref, contextlib.nullcontext()
        if hasattr(model, "disable_adapter"):  # peft: the base model is the reference
            return model, model.disable_adapter()
        raise ValueError(
            "the DPO objective needs a reference model: DPOObjective(ref_model=...) (varpack sft --objective dpo "
            "uses a frozen copy of the starting model), or a LoRA model (its adapters disabled)"
        )

    def sequence_logps(self, model: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``(policy [N], reference [N], policy outputs)`` summed completion log-probabilities of a packed
        batch (``N`` segments, a pad segment included)."""
        import torch

        model_inputs = {k: v for k, v in inputs.items() if k not in NOT_MODEL_INPUTS}
        meta = inputs.get("varlen_meta")
        n = meta.num_seqs if meta is not None else int(inputs["cu_seq_lens_q"].shape[0]) - 1
        labels, seq_idx = inputs["labels"], inputs["seq_idx"]
        outputs = model(**model_inputs)
        logps = sequence_logps(outputs.logits, labels, seq_idx, n)
        ref, context = self._reference(model, labels.device)
        with torch.no_grad(), context:
            ref_logps = sequence_logps(ref(**model_inputs).logits, labels, seq_idx, n)
        return logps, ref_logps, outputs

    def loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        *,
        reduction: str = "token",
        num_items_in_batch: Any = None,
        linear_ce: bool = False,
    ) -> ObjectiveLoss:
        """DPO loss of one collated packed micro-batch of whole pairs.

        Args:
            model: the policy, a causal LM on varpack attention.
            inputs: the collator's batch (``input_ids`` / ``labels`` / ``seq_idx`` / ``position_ids`` ``[1, T]``,
                ``cu_seq_lens_q/k``, ``varlen_meta``, ``sample_ids``).
            reduction: ignored (DPO averages over pairs).
            num_items_in_batch: pairs of the optimizer step (``None``: this batch's pairs).
            linear_ce: ignored (the log-probabilities are read from the logits).

        Returns:
            ``ObjectiveLoss(sum of per-pair losses / num_items_in_batch, policy outputs, "logits")``.

        Raises:
            ValueError: a batch that is not whole pairs in order (:func:`pair_layout`), no reference model.
        """
        pairs = pair_layout(inputs.get("sample_ids"))
        logps, ref_logps, outputs = self.sequence_logps(model, inputs)
        real = logps[: 2 * pairs].view(pairs, 2)  # a pad segment, if any, is last
        ref = ref_logps[: 2 * pairs].view(pairs, 2)
        losses = dpo_loss(
            real[:, 0],
            real[:, 1],
            ref[:, 0],
            ref[:, 1],
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            loss_type=self.loss_type,
        )
        from varpack.loss import loss_denominator

        # the causal-LM loss's rule for the step's count (0 divides by 1, a number or a tensor alike)
        count = num_items_in_batch if num_items_in_batch is not None else pairs
        denominator = loss_denominator(count, losses.device)
        self.last_rewards = (
            (self.beta * (real[:, 0] - ref[:, 0])).detach(),
            (self.beta * (real[:, 1] - ref[:, 1])).detach(),
        )
        return ObjectiveLoss(losses.sum() / denominator, outputs, "logits")

    def count_items(self, batch: dict[str, Any], *, reduction: str = "token") -> Any:
        """Pairs in ``batch`` (a CPU int64 tensor; read off ``sample_ids``, no device read)."""
        import torch

        return torch.tensor(pair_layout(batch.get("sample_ids")), dtype=torch.int64)
