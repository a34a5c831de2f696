"""Supervised fine-tuning with padding-free packing through Hugging Face ``Trainer`` (``varpack sft``).

Modules:

* :mod:`varpack.train.config`: :class:`SFTConfig` (``Literal`` choices, checked in ``__post_init__``),
  :func:`default_lr`; imports no torch.
* :mod:`varpack.train.cli_flags`: the ``varpack sft`` flags generated from ``SFTConfig``'s fields and back.
* :mod:`varpack.train.trainer`: :class:`PackedSFTTrainer`, :class:`TrainCollator`,
  :class:`PackEpochCallback`.
* :mod:`varpack.train.sft`: :func:`build_sft`, :func:`run_sft` (encode -> plan -> model -> Trainer).
* :mod:`varpack.train.objectives`: the training objectives the Trainer asks for the loss (``"sft"`` today).

Names that need torch / transformers are imported on first use, so ``from varpack.train import SFTConfig``
(and the CLI's parsers, which import :mod:`varpack.train.config`) stay cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from varpack.train.config import DEFAULT_LR, SFTConfig, default_lr

_LAZY = {
    "PackEpochCallback": "varpack.train.trainer",
    "PackedSFTTrainer": "varpack.train.trainer",
    "TrainCollator": "varpack.train.trainer",
    "SFTRun": "varpack.train.sft",
    "build_sft": "varpack.train.sft",
    "config_dict": "varpack.train.sft",
    "encode_chat_data": "varpack.train.sft",
    "run_sft": "varpack.train.sft",
    "training_arguments": "varpack.train.sft",
}

__all__ = [
    "DEFAULT_LR",
    "PackEpochCallback",
    "PackedSFTTrainer",
    "SFTConfig",
    "SFTRun",
    "TrainCollator",
    "build_sft",
    "config_dict",
    "default_lr",
    "encode_chat_data",
    "run_sft",
    "training_arguments",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'varpack.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
