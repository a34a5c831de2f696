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

__all__ = ["fix_interpreter_index", "import_kernels", "triton_interpreted"]

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


def fix_interpreter_index() -> None:
    """Let Triton's interpreter use a scalar argument as a loop bound under NumPy >= 2.4.

    Triton <= 3.6's interpreter turns a scalar tensor (a NumPy array of shape ``[1]``) into a Python int with
    ``int(array)``, which NumPy >= 2.4 refuses with ``TypeError: only 0-dimensional arrays can be converted to
    Python scalars`` (triton-lang/triton#9171, fixed upstream by #9172 with ``.squeeze()``). This applies the
    same fix by wrapping the interpreter's per-launch tensor patch; idempotent, and nothing changes for
    kernels compiled for a GPU. Applied by :func:`import_kernels` in interpreted mode; a test that runs another
    library's kernel interpreted (Liger's cross entropy) calls it directly."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "__varpack_index_fix__", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.__varpack_index_fix__ = True
    interpreter._patch_lang_tensor = patched


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
            if interpreted:
                fix_interpreter_index()
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
