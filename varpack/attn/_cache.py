"""A tiny cache keyed on tensor identity, used to build per-batch metadata once and reuse it in every layer."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import torch

__all__ = ["TensorCache"]


class TensorCache:
    """Small LRU keyed on tensor identity + in-place version (``_version``) + extra key.

    Entries hold a weak reference to the key tensors, so a dead tensor whose ``id`` is reused never hits.
    """

    def __init__(self, maxsize: int = 8) -> None:
        self.maxsize = maxsize
        self._data: OrderedDict[tuple, tuple[list[weakref.ref], Any]] = OrderedDict()

    @staticmethod
    def _key(tensors: tuple[torch.Tensor, ...], extra: tuple) -> tuple:
        return tuple((id(t), t._version) for t in tensors) + extra

    def get(self, tensors: tuple[torch.Tensor, ...], extra: tuple) -> Any:
        key = self._key(tensors, extra)
        hit = self._data.get(key)
        if hit is None:
            return None
        refs, value = hit
        if any(r() is not t for r, t in zip(refs, tensors)):
            del self._data[key]
            return None
        self._data.move_to_end(key)
        return value

    def put(self, tensors: tuple[torch.Tensor, ...], extra: tuple, value: Any) -> None:
        key = self._key(tensors, extra)
        self._data[key] = ([weakref.ref(t) for t in tensors], value)
        self._data.move_to_end(key)
        while len(self._data) > self.maxsize:
            self._data.popitem(last=False)

    def clear(self) -> None:
        self._data.clear()
