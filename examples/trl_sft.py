"""Keep your TRL script: a plain TRL ``SFTTrainer`` script, with ``VarpackSFTTrainer`` in its place.

Runs offline on varpack's built-in chats (Python's language reference as conversations,
:func:`varpack.data.builtin_chats`) and a built-in random-init model (``tiny-qwen3``: the Qwen3 architecture
and vocabulary, 2 layers) with the embedded Qwen3 tokenizer; ``--model`` also takes a Hugging Face model
directory. TRL prepares the data as usual (chat template, assistant-only labels); varpack plans packs of
complete samples (best-fit decreasing, ``max_length`` tokens each), collates them padding-free with their
boundaries, runs the model on varpack attention and trains varpack's packed loss.

    python examples/trl_sft.py --max-steps 20
    python examples/trl_sft.py --model path/to/hf-model --packing-length 8192 --max-steps 200

Needs ``pip install 'varpack[trl]'``.
"""

from __future__ import annotations

import argparse
from typing import Any

import datasets
import torch
from trl import SFTConfig

from varpack.data.builtin import builtin_chats
from varpack.models import load_model, load_tokenizer_for
from varpack.train.trl import VarpackSFTTrainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-qwen3", help="built-in model name or HF model directory")
    p.add_argument("--packing-length", type=int, default=4096, help="tokens per pack (SFTConfig.max_length)")
    p.add_argument("--overflow", default="error", help="a chat longer than a pack: error, drop, truncate, split")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--max-samples", type=int, default=None, help="first N built-in chats only")
    p.add_argument("--batch-size", type=int, default=1, help="packs per micro-batch")
    p.add_argument("--lr", type=float, default=3e-3, help="3e-3 suits the random-init tiny model")
    p.add_argument("--output-dir", default="varpack-trl-sft")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Any:
    args = parse_args(argv)
    chats = builtin_chats()[: args.max_samples]
    train_dataset = datasets.Dataset.from_list([{"messages": c["messages"]} for c in chats])
    tokenizer = load_tokenizer_for(args.model)
    model = load_model(args.model, dtype=torch.float32)

    # --- from here on, an ordinary TRL script ---
    config = SFTConfig(
        output_dir=args.output_dir,
        max_length=args.packing_length,  # with varpack: the packing length (nothing is truncated)
        per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        logging_steps=5,
        logging_first_step=True,
        gradient_checkpointing=False,
        assistant_only_loss=True,  # TRL's assistant masks become the labels
        save_strategy="no",
        report_to=[],
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = VarpackSFTTrainer(  # was: trl.SFTTrainer
        model=model,
        args=config,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        overflow=args.overflow,  # varpack's only extra argument here (default "error": nothing cut silently)
    )
    print(f"{len(trainer.samples)} samples in {trainer.plan.num_packs} packs of <= {args.packing_length} tokens")
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if losses:
        print(f"done: {trainer.state.global_step} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return trainer


if __name__ == "__main__":
    main()
