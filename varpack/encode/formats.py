"""Moved: the code lives in :mod:`varpack.data.formats`; this old import path is kept for users' code.

``import varpack.encode.formats`` gives the very module ``varpack.data.formats`` (same object), so attributes and
monkeypatches reach the code itself.
"""

import sys

from varpack.data import formats as _moved

sys.modules[__name__] = _moved
