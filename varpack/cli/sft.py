"""``varpack sft``: fine-tune a causal LM on chat data with padding-free packing (HF ``Trainer``).

    varpack sft [--model DIR|tiny-qwen3|tiny-llama|...] [--data PATH...] [--output-dir DIR]
                [--packing-length N] [--packing-strategy bfd|sequential] [--overflow error|drop|truncate|split]
                [--epochs E | --max-steps S] [--lr LR] [--grad-accum K] [--packs-per-step P]
                [--loss-reduction token|sample] [--attn-backend auto|...] [--bf16] [--seed S]

Without ``--data`` the built-in chats are used; the tokenizer is the model directory's / GGUF file's own,
else the embedded Qwen3 vocabulary. Prints the packing report (samples, packs, fill, overflow) first, then a
progress bar with loss, tokens/s and pack fill, and saves the model and tokenizer to ``--output-dir``.
Runs on CPU and GPU, and under ``torchrun`` / ``accelerate launch`` (each rank trains on its share of the
packs).
"""

from __future__ import annotations

import argparse
from typing import Any

from varpack.cli._common import (
    ATTN_BACKENDS,
    UsageError,
    check_data_files,
    float_above,
    int_at_least,
    max_steps_type,
)

__all__ = ["add_sft_arguments", "config_from_args", "register", "run"]


def _config_defaults() -> dict[str, Any]:
    """``SFTConfig``'s field defaults, read without instantiating it (nothing heavy is imported)."""
    import dataclasses

    from varpack.train_config import SFTConfig

    return {f.name: f.default for f in dataclasses.fields(SFTConfig) if f.default is not dataclasses.MISSING}


def add_sft_arguments(p: argparse.ArgumentParser, *, defaults: dict[str, Any] | None = None) -> None:
    """The flags of ``varpack sft`` (shared with ``varpack demo``, which changes some defaults).

    Every help text shows its default once (``%(default)s``, so ``varpack demo --help`` shows the demo's).
    """
    from varpack.plan import OVERFLOW_POLICIES, STRATEGIES, strategies_help
    from varpack.train_config import DEFAULT_LR

    d = {**_config_defaults(), **(defaults or {})}
    lr_help = (
        "peak learning rate (AdamW) (default: %(default)s)"
        if d["lr"] is not None
        else f"peak learning rate (AdamW) (default: {DEFAULT_LR['random-init']:g} for a random-init built-in "
        f"model, {DEFAULT_LR['pretrained']:g} for a model directory or GGUF file)"
    )
    add = p.add_argument
    add(
        "--model",
        default=d["model"],
        metavar="DIR|NAME",
        help="model directory, .gguf file / package, or a built-in name (default: %(default)s)",
    )
    add(
        "--data",
        nargs="+",
        default=None,
        metavar="PATH",
        help="chat data files (JSON/JSONL/parquet) (default: the built-in chats)",
    )
    add(
        "--output-dir",
        dest="output_dir",
        default=d["output_dir"],
        metavar="DIR",
        help="where the model and tokenizer are saved (default: %(default)s)",
    )
    add(
        "--packing-length",
        dest="packing_length",
        type=int_at_least(1),
        default=d["packing_length"],
        metavar="N",
        help="tokens per pack (default: %(default)s)",
    )
    add(
        "--packing-strategy",
        dest="packing_strategy",
        choices=STRATEGIES,
        default=d["packing_strategy"],
        help=f"{strategies_help()} (default: %(default)s)",
    )
    add(
        "--overflow",
        choices=OVERFLOW_POLICIES,
        default=d["overflow"],
        help="samples longer than --packing-length (default: %(default)s)",
    )
    add(
        "--epochs",
        type=float_above(0),
        default=d["epochs"],
        metavar="E",
        help="passes over the packs, ignored with --max-steps (default: %(default)s)",
    )
    add(
        "--max-steps",
        dest="max_steps",
        type=max_steps_type,
        default=d["max_steps"],
        metavar="N",
        help="optimizer steps; -1: run --epochs (default: %(default)s)",
    )
    add("--lr", type=float_above(0), default=d["lr"], metavar="LR", help=lr_help)
    add(
        "--lr-scheduler",
        dest="lr_scheduler",
        default=d["lr_scheduler"],
        metavar="NAME",
        help="transformers scheduler name: constant, linear, cosine, ... (default: %(default)s)",
    )
    add(
        "--warmup-steps",
        dest="warmup_steps",
        type=int_at_least(0),
        default=d["warmup_steps"],
        metavar="N",
        help="linear warm-up steps (default: %(default)s)",
    )
    add(
        "--grad-accum",
        dest="grad_accum",
        type=int_at_least(1),
        default=d["grad_accum"],
        metavar="K",
        help="gradient-accumulation micro-batches per optimizer step (default: %(default)s)",
    )
    add(
        "--packs-per-step",
        dest="packs_per_step",
        type=int_at_least(1),
        default=d["packs_per_step"],
        metavar="P",
        help="packs per micro-batch per device, flattened into one row (default: %(default)s)",
    )
    add(
        "--loss-reduction",
        dest="loss_reduction",
        choices=("token", "sample"),
        default=d["loss_reduction"],
        help="token: global token mean; sample: global sample mean (default: %(default)s)",
    )
    add(
        "--loss-impl",
        dest="loss_impl",
        choices=("auto", "linear_ce", "logits"),
        default=d["loss_impl"],
        help="linear_ce: chunked LM head + CE without [T, V] logits (default: %(default)s)",
    )
    add(
        "--attn-backend",
        dest="attn_backend",
        choices=ATTN_BACKENDS,
        default=d["attn_backend"],
        help="varpack attention backend (default: %(default)s)",
    )
    add("--bf16", action="store_true", default=d["bf16"], help="bfloat16 mixed precision")
    add(
        "--seed",
        type=int_at_least(0),
        default=d["seed"],
        metavar="S",
        help="random-init seed of built-in models, plan and Trainer seed (default: %(default)s)",
    )
    add(
        "--logging-steps",
        dest="logging_steps",
        type=int_at_least(1),
        default=d["logging_steps"],
        metavar="N",
        help="log every N optimizer steps (default: %(default)s)",
    )
    add(
        "--num-proc",
        dest="num_proc",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="encoding worker processes",
    )
    add(
        "--gradient-checkpointing",
        dest="gradient_checkpointing",
        action="store_true",
        help="recompute activations in the backward pass",
    )
    add(
        "--use-liger-kernel",
        dest="use_liger_kernel",
        action="store_true",
        help="Liger-Kernel's fused RMSNorm / RoPE / SwiGLU (CUDA, pip install liger-kernel); the loss stays "
        "varpack's",
    )
    add(
        "--torch-compile",
        dest="torch_compile",
        action="store_true",
        help="torch.compile each decoder layer (varpack attention stays outside the graph); compiles in step 1",
    )


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``sft`` sub-command to ``subparsers`` and return its parser."""
    p = subparsers.add_parser(
        "sft",
        help="fine-tune with padding-free packing (HF Trainer)",
        description="Supervised fine-tuning on chat data with padding-free packing; packed == unpacked.",
    )
    add_sft_arguments(p)
    p.add_argument(
        "--no-save", dest="save", action="store_false", help="do not save the model and tokenizer at the end"
    )
    return p


def config_from_args(args: argparse.Namespace) -> Any:
    """``SFTConfig`` from parsed ``varpack sft`` flags.

    Raises:
        UsageError: a combination of flags ``SFTConfig`` refuses (exit code 2).
    """
    from varpack.train_config import SFTConfig

    kw = dict(
        model=args.model,
        data=tuple(args.data or ()),
        output_dir=args.output_dir,
        packing_length=args.packing_length,
        packing_strategy=args.packing_strategy,
        overflow=args.overflow,
        packs_per_step=args.packs_per_step,
        grad_accum=args.grad_accum,
        epochs=args.epochs,
        max_steps=args.max_steps,
        lr=args.lr,
        lr_scheduler=args.lr_scheduler,
        warmup_steps=args.warmup_steps,
        loss_reduction=args.loss_reduction,
        loss_impl=args.loss_impl,
        attn_backend=args.attn_backend,
        bf16=args.bf16,
        seed=args.seed,
        logging_steps=args.logging_steps,
        num_proc=args.num_proc,
        gradient_checkpointing=args.gradient_checkpointing,
        use_liger_kernel=args.use_liger_kernel,
        torch_compile=args.torch_compile,
        save=args.save,
    )
    try:
        return SFTConfig(**kw)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    """Run ``varpack sft``; returns 0. Errors propagate to ``varpack.cli.main`` (exit codes 2 / 1)."""
    config = config_from_args(args)
    check_data_files(config.data)  # a missing file is reported before torch and transformers are imported
    from varpack.train import run_sft

    try:
        run_sft(config)
    finally:
        _close_process_group()
    return 0


def _close_process_group() -> None:
    """Tear down the process group torchrun/accelerate opened (the Trainer leaves it open): a gloo group
    left to the interpreter's exit can abort the process ("terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
