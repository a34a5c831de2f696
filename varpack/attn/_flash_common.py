"""Helpers shared by the flash-attn family of backends (FA2, FA3, FA4) and torch's varlen_attn."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["dist_version", "first_output", "import_function", "parameters"]


def import_function(module_name: str, attr: str) -> tuple[Callable[..., Any] | None, str]:
    """``(fn, "")`` when ``module_name.attr`` imports, else ``(None, reason)``."""
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or a broken CUDA extension (OSError, RuntimeError)
        return None, f"cannot import {module_name} ({type(exc).__name__}: {exc})"
    fn = getattr(module, attr, None)
    if fn is None:
        return None, f"{module_name} has no {attr} (another package owns the {module_name} name?)"
    return fn, ""


def parameters(fn: Callable[..., Any]) -> frozenset[str]:
    """Names of ``fn``'s parameters (empty when the signature cannot be read)."""
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def dist_version(*names: str) -> str:
    """Installed version of the first distribution found among ``names`` ("unknown version" if none)."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown version"


def first_output(result: Any) -> torch.Tensor:
    """The attention output of a kernel that returns ``out`` or ``(out, lse, ...)``."""
    return result[0] if isinstance(result, (tuple, list)) else result
