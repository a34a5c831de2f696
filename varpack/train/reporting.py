"""What a packed run tells its logging integrations once, at the start: the packing report (the one
``varpack plan`` prints) as an artifact, and the attention backend varpack chose.

The per-step metrics (tokens/s, supervised tokens, packs, samples, fill) are not here: they go through
``Trainer.log`` (:meth:`varpack.train.trainer.PackedSFTTrainer.log`), so every ``report_to`` integration
records them. Strings cannot be scalars, so :class:`RunReportCallback` writes them where each tool's users look:

* ``output_dir/packing_report.json`` (:data:`PACKING_REPORT_FILE`): :func:`varpack.plan.report.plan_summary`
  of the run's plan (its ``overflow`` lists the samples and pieces left out, those without a supervised
  token included), plus ``attn_backend`` (chosen name and reason);
* TensorBoard (``report_to`` with ``tensorboard``): text summaries ``varpack/packing_report`` and
  ``varpack/attn_backend`` (the TEXT tab, beside the ``args`` / ``model_config`` texts transformers writes),
  through transformers' own ``TensorBoardCallback`` writer (same event file);
* Weights & Biases (``report_to`` with ``wandb``, when ``wandb`` is installed): the run config gets
  ``varpack/attn_backend``, ``varpack/attn_backend_reason`` and the plan's numbers (``varpack/fill_ratio``,
  ...), and the JSON file is logged as an artifact of type ``packing-report``. ``wandb`` is never imported
  unless transformers' ``WandbCallback`` is active.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from transformers import TrainerCallback

__all__ = ["PACKING_REPORT_FILE", "RunReportCallback", "packing_report_data", "resolved_attn_backend"]

#: file name of the packing report in ``output_dir``
PACKING_REPORT_FILE = "packing_report.json"

#: plan numbers copied into the W&B run config (``varpack/<key>``)
_CONFIG_KEYS = ("num_samples", "num_packs", "total_tokens", "fill_ratio", "packing_length", "strategy")


def packing_report_data(summary: dict[str, Any], *, attn_backend: dict[str, str]) -> dict[str, Any]:
    """The JSON of :data:`PACKING_REPORT_FILE`.

    Args:
        summary: :func:`varpack.plan.report.plan_summary` of the run's plan (``data``: the data label).
        attn_backend: ``{"name": ..., "reason": ...}`` (:func:`resolved_attn_backend`).

    Returns:
        ``summary`` with ``attn_backend`` added.
    """
    out = dict(summary)
    out["attn_backend"] = dict(attn_backend)
    return out


def _text_model(model: Any) -> Any:
    get_base = getattr(model, "get_base_model", None)  # a peft wrapper: the model inside
    return get_base() if callable(get_base) else model


def resolved_attn_backend(model: Any, backend: str, plan: Any, *, dtype: Any, device: Any) -> dict[str, str]:
    """Which varpack attention backend the run's full-attention layers take, and why.

    ``auto`` depends on the call (device, dtype, head dim, gradients, and on CUDA the shape class of the
    batch's longest sample, ``varpack.attn.AUTO_SHORT_MAX_SEQLEN``). A micro-batch's longest sample lies
    between the smallest and the largest per-pack longest item of ``plan``, so resolving at both ends covers
    every batch; when they differ both names are given (``"torch_varlen | flash_attn_4"``).

    Args:
        model: the model on varpack attention (a peft wrapper is looked through).
        backend: ``SFTConfig.attn_backend`` (``"auto"`` or a backend name).
        plan: the run's :class:`varpack.plan.PackPlan` (at least one pack).
        dtype: the dtype attention runs in (the autocast dtype under ``bf16``).
        device: where the model runs.

    Returns:
        ``{"name": ..., "reason": ...}``; a model varpack cannot inspect gives
        ``{"name": backend, "reason": "not resolved: <error>"}`` (logging never stops a run).
    """
    from varpack.check import _resolved_backend

    if plan.num_packs == 0:
        return {"name": backend, "reason": "not resolved: the plan has no pack"}
    longest = np.maximum.reduceat(plan.item_lengths, plan.offsets[:-1])
    try:
        ends = [
            _resolved_backend(_text_model(model), backend, device, dtype, int(m))
            for m in sorted({int(longest.min()), int(longest.max())})
        ]
    except Exception as exc:  # noqa: BLE001 - a model family varpack does not know: say so in the log
        return {"name": backend, "reason": f"not resolved: {type(exc).__name__}: {exc}"}
    names = list(dict.fromkeys(name for name, _ in ends))
    reasons = list(dict.fromkeys(reason for _, reason in ends))
    return {"name": " | ".join(names), "reason": " | ".join(reasons)}


class RunReportCallback(TrainerCallback):
    """At ``on_train_begin`` (main process only): resolves the attention backend, writes
    ``output_dir/packing_report.json`` (when ``write_file``), and hands the report and the backend to the
    active TensorBoard / W&B callbacks (module docstring).

    Args:
        trainer: the Trainer this callback is added to (its callback list tells which integrations run).
        summary: :func:`varpack.plan.report.plan_summary` of the run's plan.
        text: the plain-text packing report (:func:`varpack.plan.report.summary_text`).
        plan: the run's plan; backend: ``SFTConfig.attn_backend``, or the backend the run put in its place.
        write_file: write :data:`PACKING_REPORT_FILE` (``varpack sft``: when saving or logging).
        reason: why ``backend`` runs, when the run chose it in place of ``SFTConfig.attn_backend`` (the
            captured layers' ``triton_short``: :func:`varpack.integrations.cuda_graphs.graph_attention`).

    After training starts, ``report`` holds the JSON data and ``report_path`` the file written (or None).
    """

    def __init__(
        self,
        trainer: Any,
        *,
        summary: dict[str, Any],
        text: str,
        plan: Any,
        backend: str,
        write_file: bool = True,
        reason: str | None = None,
    ) -> None:
        self.trainer = trainer
        self.summary = summary
        self.text = text
        self.plan = plan
        self.backend = backend
        self.reason = reason
        self.write_file = write_file
        self.report: dict[str, Any] | None = None
        self.report_path: str | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        import torch

        model = model if model is not None else self.trainer.model
        param = next(model.parameters())
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else param.dtype
        attn = resolved_attn_backend(model, self.backend, self.plan, dtype=dtype, device=param.device)
        if self.reason is not None and not attn["reason"].startswith("not resolved"):
            attn = {"name": attn["name"], "reason": self.reason}
        self.report = packing_report_data(self.summary, attn_backend=attn)
        if self.write_file:
            os.makedirs(args.output_dir, exist_ok=True)
            self.report_path = os.path.join(args.output_dir, PACKING_REPORT_FILE)
            with open(self.report_path, "w", encoding="utf-8") as f:
                json.dump(self.report, f, indent=2)
                f.write("\n")
        from transformers.integrations import TensorBoardCallback, WandbCallback  # neither imports its tool

        for cb in self.trainer.callback_handler.callbacks:
            if isinstance(cb, TensorBoardCallback):
                self._to_tensorboard(cb, attn, state.global_step)
            elif isinstance(cb, WandbCallback):
                self._to_wandb(attn)

    def _to_tensorboard(self, cb: Any, attn: dict[str, str], step: int) -> None:
        writer = getattr(cb, "tb_writer", None)
        if writer is None:
            return
        # TensorBoard renders text summaries as markdown: indent 4 spaces for a code block
        writer.add_text("varpack/packing_report", _code_block(self.text), step)
        writer.add_text("varpack/attn_backend", f"**{attn['name']}**\n\n{attn['reason']}", step)
        writer.flush()

    def _to_wandb(self, attn: dict[str, str]) -> None:
        try:
            import wandb
        except ImportError:  # WandbCallback active without wandb cannot happen; nothing to log to
            return
        run = getattr(wandb, "run", None)
        if run is None:
            return
        config = {"varpack/attn_backend": attn["name"], "varpack/attn_backend_reason": attn["reason"]}
        config.update({f"varpack/{k}": self.summary[k] for k in _CONFIG_KEYS if k in self.summary})
        run.config.update(config, allow_val_change=True)
        if self.report_path is not None:
            artifact = wandb.Artifact(name=f"packing-report-{run.id}", type="packing-report")
            artifact.add_file(self.report_path, name=PACKING_REPORT_FILE)
            run.log_artifact(artifact)


def _code_block(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
