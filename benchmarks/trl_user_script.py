"""An ordinary TRL SFT script, as a user writes it: TRL's own packing, or varpack's drop-in in its place.

What ``benchmarks/trl_user.py`` runs (and what a user can run as is)::

    python benchmarks/trl_user_script.py --trainer trl --data chats.jsonl --model qwen3-0.6b-shape \\
        --packing-length 8192 --dtype bfloat16 --max-steps 60 --logging-steps 10
    python benchmarks/trl_user_script.py --trainer varpack ...     # the same script, VarpackSFTTrainer

* ``--trainer trl``: ``trl.SFTTrainer`` with TRL's strongest packing configuration (trl 1.16,
  ``trl/trainer/sft_trainer.py``): ``packing=True`` with ``packing_strategy="bfd"`` (best-fit decreasing, one
  packed row of ``max_length`` tokens per item), ``padding_free=True`` (TRL's collator flattens the row with
  ``position_ids`` and FlashAttention's ``cu_seq_lens``), the model on the first attention implementation
  transformers takes for it among ``flash_attention_4``, ``flash_attention_2``, ``flex_attention``, ``sdpa``
  (``model.set_attn_implementation``, as ``benchmarks/train.py`` sets up its HF flattening peers; on the CPU
  ``sdpa``), ``use_liger_kernel=True`` when liger-kernel is installed and the run is on CUDA (``--liger``);
  transformers' ``torch_compile`` only with ``--torch-compile``.
* ``--trainer varpack``: the same script with ``from varpack.train.trl import VarpackSFTTrainer`` in
  ``SFTTrainer``'s place; every setting the same except ``packing=False`` and ``padding_free=False``, which
  ``VarpackSFTTrainer`` refuses (varpack plans the packs and collates them itself; ``max_length`` is its
  packing length). It puts the model on varpack attention, whatever implementation the script chose.

Data: ``--data`` JSON Lines chats (``{"messages": [{"role", "content"}, ...]}``, loaded with
``datasets.load_dataset("json")``; other columns are dropped), else varpack's built-in chats. Model: a varpack
built-in name (random init, ``--seed``) or a Hugging Face model directory, weights in ``--dtype`` (no autocast,
as ``varpack sft --dtype``); optimizer and schedule are transformers' defaults with ``varpack sft``'s defaults
for a random-init model (AdamW fused on CUDA, lr 3e-3 constant, no warm-up, no weight decay);
``assistant_only_loss=True``.

Before training the script prints one line ``trl_user_script {json}``: the settings it ran with, the
attention implementation the model got, whether Liger is on, the packed rows of the epoch. The training logs
are Trainer's own (printed by its progress bar): ``num_tokens`` (TRL, cumulative) or ``tokens_per_step`` /
``tokens_per_second`` (varpack).

Needs ``pip install 'varpack[trl]'``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from typing import Any

import datasets
import torch
from trl import SFTConfig, SFTTrainer

from varpack.data.builtin import builtin_chats
from varpack.models import load_model, load_tokenizer_for

#: The attention implementations tried, fastest first (FlashAttention-4 on Hopper / Blackwell when installed).
ATTN_ORDER = ("flash_attention_4", "flash_attention_2", "flex_attention", "sdpa")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer", choices=("trl", "varpack"), default="trl",
                   help="trl: trl.SFTTrainer with TRL's packing; varpack: VarpackSFTTrainer")  # fmt: skip
    p.add_argument("--data", default=None, help="JSON Lines chats (default: varpack's built-in chats)")
    p.add_argument("--model", default="tiny-qwen3", help="built-in model name or HF model directory")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="weight dtype")
    p.add_argument("--packing-length", type=int, default=8192, help="tokens per packed row (max_length)")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3, help="3e-3 suits a random-init model (varpack sft's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn", default="auto", help=f"auto: the first of {', '.join(ATTN_ORDER)} that builds")
    p.add_argument("--liger", choices=("auto", "on", "off"), default="auto",
                   help="use_liger_kernel: auto = on when liger-kernel is installed and CUDA is used")  # fmt: skip
    p.add_argument("--torch-compile", action="store_true", help="SFTConfig(torch_compile=True)")
    p.add_argument("--output-dir", default="trl-user-sft")
    return p.parse_args(argv)


def set_best_attention(model: Any, choice: str) -> tuple[str, list[str]]:
    """Put ``model`` on ``choice`` or, for ``"auto"``, on the first of :data:`ATTN_ORDER` transformers takes
    (``sdpa`` on the CPU). Returns ``(implementation, ["name: why not", ...])``.

    Raises:
        RuntimeError: none of them builds.
    """
    order = (choice,) if choice != "auto" else ATTN_ORDER if torch.cuda.is_available() else ("sdpa",)
    errors = []
    for name in order:
        try:
            model.set_attn_implementation(name)
            return name, errors
        except (ImportError, ValueError) as exc:
            errors.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
    raise RuntimeError("no attention implementation builds: " + "; ".join(errors))


def main(argv: list[str] | None = None) -> Any:
    args = parse_args(argv)
    if args.data:
        train_dataset = datasets.load_dataset("json", data_files=args.data, split="train")
        train_dataset = train_dataset.select_columns(["messages"])
    else:
        train_dataset = datasets.Dataset.from_list([{"messages": c["messages"]} for c in builtin_chats()])
    tokenizer = load_tokenizer_for(args.model)
    cuda = torch.cuda.is_available()
    model = load_model(args.model, dtype=getattr(torch, args.dtype), seed=args.seed, attn_backend=None,
                       device="cuda" if cuda else None)  # fmt: skip
    attention, not_taken = set_best_attention(model, args.attn)
    liger = args.liger == "on" or (
        args.liger == "auto" and cuda and importlib.util.find_spec("liger_kernel") is not None
    )
    packing = args.trainer == "trl"  # VarpackSFTTrainer refuses TRL's packing and padding-free collator

    # --- from here on, an ordinary TRL script ---
    config = SFTConfig(
        output_dir=args.output_dir,
        max_length=args.packing_length,
        packing=packing,
        packing_strategy="bfd",
        padding_free=packing,
        per_device_train_batch_size=1,  # one packed row per step
        max_steps=args.max_steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=args.logging_steps,
        assistant_only_loss=True,
        gradient_checkpointing=False,
        use_liger_kernel=liger,
        torch_compile=args.torch_compile,
        bf16=False,  # the weights are in --dtype already (as varpack sft --dtype bfloat16)
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        use_cpu=not cuda,
    )
    if args.trainer == "varpack":
        from varpack.train.trl import VarpackSFTTrainer as Trainer  # the one name a user changes
    else:
        Trainer = SFTTrainer
    trainer = Trainer(model=model, args=config, train_dataset=train_dataset, processing_class=tokenizer)

    rows = trainer.plan.num_packs if args.trainer == "varpack" else len(trainer.train_dataset)
    settings = {
        "trainer": f"{Trainer.__module__}.{Trainer.__name__}",
        "model": args.model, "dtype": args.dtype, "packing_length": args.packing_length,
        "packing": config.packing, "packing_strategy": config.packing_strategy if packing else None,
        "padding_free": config.padding_free, "attention_chosen": attention, "attention_not_taken": not_taken,
        "attention_running": str(getattr(trainer.model.config, "_attn_implementation", None)),
        "use_liger_kernel": liger, "torch_compile": args.torch_compile, "bf16_autocast": False,
        "rows_per_epoch": rows, "max_steps": args.max_steps, "logging_steps": args.logging_steps,
        "device": "cuda" if cuda else "cpu",
    }  # fmt: skip
    print("trl_user_script " + json.dumps(settings), flush=True)
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
