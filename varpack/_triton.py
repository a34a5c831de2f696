"""Triton's run mode in this process, and importing a module of ``triton.jit`` kernels in that mode.

Triton decides once, when it is imported, whether kernels are compiled for a GPU or run by its interpreter
(``TRITON_INTERPRET=1``: NumPy on CPU tensors). Its own library functions (``tl.sum`` and the like) are
``triton.jit`` functions too, so varpack's kernels must be built in the same mode: :func:`import_kernels`
imports a kernel module with ``TRITON_INTERPRET`` set to match Triton's mode, once, thread-safely. The CPU tests
run every varpack Triton kernel this way (tests/conftest.py sets ``TRITON_INTERPRET=1`` before Triton's import on
a machine without CUDA).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from types import ModuleType

__all__ = ["import_kernels", "triton_interpreted"]

_MODULES: dict[str, ModuleType] = {}
_LOCK = threading.Lock()


def triton_interpreted() -> bool:
    """Whether Triton runs interpreted in this process: decided when Triton was imported (its library kernels
    are interpreter functions); before that import, ``TRITON_INTERPRET`` decides."""
    standard = sys.modules.get("triton.language.standard")
    if standard is None:
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(getattr(standard, "sum", None), InterpretedFunction)


def import_kernels(name: str) -> ModuleType:
    """Import the kernel module ``name`` once, in Triton's mode (:func:`triton_interpreted`), even when
    ``TRITON_INTERPRET`` changed after Triton's own import.

    Raises:
        ImportError: Triton (or the module) cannot be imported.
    """
    with _LOCK:
        module = _MODULES.get(name)
        if module is None:
            interpreted, before = triton_interpreted(), os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1" if interpreted else "0"
            try:
                module = importlib.import_module(name)
            finally:
                if before is None:
                    os.environ.pop("TRITON_INTERPRET", None)
                else:
                    os.environ["TRITON_INTERPRET"] = before
            _MODULES[name] = module
        return module
