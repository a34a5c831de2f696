"""GPU tests' check that a call makes no host sync."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def without_host_sync(fn: Callable[[], Any]) -> Any:
    """``fn()`` with ``torch.cuda.set_sync_debug_mode("error")``: any synchronising CUDA call in it (a device
    value read on the host, a blocking copy) raises. The device is synchronised before and after; returns
    ``fn()``'s result."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return out
