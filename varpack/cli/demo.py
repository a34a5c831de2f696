"""``varpack demo``: the main job on the embedded default, in a few minutes on a laptop CPU.

Fine-tunes ``tiny-qwen3`` (random init, the real Qwen3 vocabulary of 151,936 rows) on the built-in chats
(Python's own documentation turned into conversations, encoded with the embedded Qwen3 tokenizer) with
padding-free packing: it prints the packing report, trains with a progress bar (loss, tokens/s, pack fill)
and ends with the first-vs-last loss. Same flags as ``varpack sft``, with demo defaults (short packs, a high
learning rate, a fixed number of steps, nothing saved unless ``--save``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["DEMO_DEFAULTS", "register", "run"]

#: ``varpack sft`` defaults changed for the demo.
DEMO_DEFAULTS: dict[str, Any] = {
    "model": "tiny-qwen3",
    "output_dir": "varpack-demo",
    "packing_length": 1024,
    "overflow": "split",
    "max_steps": 100,
    "lr": 3e-3,
    "lr_scheduler": "cosine",
    "warmup_steps": 5,
    "logging_steps": 5,
    "save": False,
}


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` sub-command to ``subparsers`` and return its parser."""
    from varpack.cli.sft import add_sft_arguments

    p = subparsers.add_parser(
        "demo",
        help="a short packed fine-tuning run on the embedded default (tiny-qwen3, built-in chats)",
        description=(
            "Packed SFT of tiny-qwen3 on the built-in chats with the embedded Qwen3 tokenizer: packing "
            "report, falling loss, first-vs-last loss. Takes a few minutes on a CPU."
        ),
    )
    add_sft_arguments(p, defaults=DEMO_DEFAULTS)  # --save/--no-save included, off by default here
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``varpack demo``: 0 when the loss fell (or only one loss was logged: nothing to compare), 1 when it
    did not or none was logged; errors propagate to ``varpack.cli.main``."""
    from varpack.cli.sft import checked_config

    config = checked_config(args)
    from varpack.train.sft import run_sft

    print(
        "varpack demo: padding-free packed fine-tuning of a tiny random-init Qwen3 (real Qwen3 vocabulary) "
        "on chats made from Python's documentation\n"
    )
    run = run_sft(config)
    if not run.history:
        print("varpack demo: error: no loss was logged", file=sys.stderr)
        return 1
    first, last = run.history[0], run.history[-1]
    if len(run.history) < 2:
        print(
            f"\none logged loss, {first['loss']:.4f} (step {first.get('step', '?')}): whether it falls needs two "
            "logged steps (raise --max-steps or lower --logging-steps)"
        )
        return 0
    print(
        f"\nfirst logged loss {first['loss']:.4f} (step {first.get('step', '?')}) -> last logged loss "
        f"{last['loss']:.4f} (step {last.get('step', '?')}): "
        + ("the loss fell." if last["loss"] < first["loss"] else "the loss did NOT fall.")
    )
    return 0 if last["loss"] < first["loss"] else 1
