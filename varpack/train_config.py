"""Moved: the settings of a packed SFT run now live in :mod:`varpack.train.config` (imports no torch).

Thin re-export so ``from varpack.train_config import SFTConfig, DEFAULT_LR, default_lr`` keeps working.
"""

from varpack.train.config import DEFAULT_LR, SFTConfig, default_lr

__all__ = ["DEFAULT_LR", "SFTConfig", "default_lr"]
