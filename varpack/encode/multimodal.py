"""Moved: the code lives in :mod:`varpack.data.multimodal`; this old import path is kept for users' code.

``import varpack.encode.multimodal`` gives the very module ``varpack.data.multimodal`` (same object), so attributes and
monkeypatches reach the code itself.
"""

import sys

from varpack.data import multimodal as _moved

sys.modules[__name__] = _moved
