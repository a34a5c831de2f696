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
import sys
from typing import Any

__all__ = ["add_sft_arguments", "config_from_args", "register", "run"]


def add_sft_arguments(p: argparse.ArgumentParser, *, defaults: dict[str, Any] | None = None) -> None:
    """The flags of ``varpack sft`` (shared with ``varpack demo``, which changes some defaults)."""
    from varpack.plan import OVERFLOW_POLICIES, STRATEGIES
    from varpack.train import SFTConfig

    d = SFTConfig()
    defaults = defaults or {}

    def dflt(name: str) -> Any:
        return defaults.get(name, getattr(d, name))

    p.add_argument(
        "--model", default=dflt("model"), metavar="DIR|NAME", help="model dir, .gguf, or built-in name"
    )
    p.add_argument(
        "--data", nargs="+", default=None, metavar="PATH", help="chat data files (default: built-in)"
    )
    p.add_argument("--output-dir", dest="output_dir", default=dflt("output_dir"), help="where to save")
    p.add_argument("--packing-length", dest="packing_length", type=int, default=dflt("packing_length"))
    p.add_argument(
        "--packing-strategy", dest="packing_strategy", choices=STRATEGIES, default=dflt("packing_strategy")
    )
    p.add_argument("--overflow", choices=OVERFLOW_POLICIES, default=dflt("overflow"), help="overlong samples")
    p.add_argument("--epochs", type=float, default=dflt("epochs"), help="passes over the packs")
    p.add_argument(
        "--max-steps", dest="max_steps", type=int, default=dflt("max_steps"), help="optimizer steps"
    )
    p.add_argument("--lr", type=float, default=dflt("lr"), help="peak learning rate (AdamW)")
    p.add_argument("--lr-scheduler", dest="lr_scheduler", default=dflt("lr_scheduler"))
    p.add_argument("--warmup-steps", dest="warmup_steps", type=int, default=dflt("warmup_steps"))
    p.add_argument("--grad-accum", dest="grad_accum", type=int, default=dflt("grad_accum"))
    p.add_argument(
        "--packs-per-step",
        dest="packs_per_step",
        type=int,
        default=dflt("packs_per_step"),
        help="packs per micro-batch per device (flattened into one row)",
    )
    p.add_argument(
        "--loss-reduction", dest="loss_reduction", choices=("token", "sample"), default=dflt("loss_reduction")
    )
    p.add_argument(
        "--loss-impl",
        dest="loss_impl",
        choices=("auto", "linear_ce", "logits"),
        default=dflt("loss_impl"),
        help="linear_ce: chunked LM head + CE without [T, V] logits",
    )
    p.add_argument("--attn-backend", dest="attn_backend", default=dflt("attn_backend"))
    p.add_argument("--bf16", action="store_true", default=dflt("bf16"), help="bfloat16 mixed precision")
    p.add_argument("--seed", type=int, default=dflt("seed"))
    p.add_argument("--logging-steps", dest="logging_steps", type=int, default=dflt("logging_steps"))
    p.add_argument("--num-proc", dest="num_proc", type=int, default=None, help="encoding worker processes")
    p.add_argument("--gradient-checkpointing", dest="gradient_checkpointing", action="store_true")
    p.add_argument(
        "--use-liger-kernel",
        dest="use_liger_kernel",
        action="store_true",
        help="Liger-Kernel's fused RMSNorm / RoPE / SwiGLU (CUDA, pip install liger-kernel); the loss stays varpack's",
    )
    p.add_argument(
        "--torch-compile",
        dest="torch_compile",
        action="store_true",
        help="torch.compile each decoder layer (varpack attention stays outside the graph); compiles in step 1",
    )
    p.add_argument("--no-save", dest="save", action="store_false", help="do not save the model at the end (the default saves: save=True)")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``sft`` sub-command to ``subparsers`` and return its parser."""
    p = subparsers.add_parser(
        "sft",
        help="fine-tune with padding-free packing (HF Trainer)",
        description="Supervised fine-tuning on chat data with padding-free packing; packed == unpacked.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_sft_arguments(p)
    return p


def config_from_args(args: argparse.Namespace) -> Any:
    """``SFTConfig`` from parsed ``varpack sft`` flags."""
    from varpack.train import SFTConfig

    return SFTConfig(
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


def run(args: argparse.Namespace) -> int:
    from varpack.train import run_sft

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"varpack sft: error: {exc}", file=sys.stderr)
        return 2
    try:
        run_sft(config)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"varpack sft: error: {exc}", file=sys.stderr)
        return 1
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
