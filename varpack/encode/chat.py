"""Moved: the code lives in :mod:`varpack.data.chat`; this old import path is kept for users' code.

``import varpack.encode.chat`` gives the very module ``varpack.data.chat`` (same object), so attributes and
monkeypatches reach the code itself.
"""

import sys

from varpack.data import chat as _moved

sys.modules[__name__] = _moved
