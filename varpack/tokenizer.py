"""Moved: the code lives in :mod:`varpack.data.tokenizer`; this old import path is kept for users' code
(README: ``from varpack.tokenizer import load_tokenizer``).

``import varpack.tokenizer`` gives the very module ``varpack.data.tokenizer`` (same object), so attributes and
monkeypatches reach the code itself.
"""

import sys

from varpack.data import tokenizer as _moved

sys.modules[__name__] = _moved
