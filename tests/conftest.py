import functools
import os
import sys

import numpy as np
import pytest
import torch

# Triton runs interpreted (NumPy, CPU tensors) only when TRITON_INTERPRET=1 is set before triton is imported,
# and then for the whole process; torch._dynamo imports triton as soon as it loads (while test modules are
# collected). On a machine without CUDA no compiled Triton kernel can run anyway, so the variable is set here,
# first: the Triton kernels of varpack (the triton_short attention backend) are then tested on the CPU
# (tests/attn/test_triton_short.py). On a GPU machine nothing changes.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


# ---------------------------------------------------------------------------------------------------------
# uninitialised memory must not pass a test
# ---------------------------------------------------------------------------------------------------------
def _poison(t):
    """Fill a freshly allocated tensor in place: NaN for float / complex, the dtype's max for integers, True
    for bool (other dtypes, e.g. quantized, are left as allocated). Returns ``t``."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return t
    dtype = t.dtype
    if dtype.is_floating_point or dtype.is_complex:
        value = float("nan")
    elif dtype == torch.bool:
        value = True
    else:
        try:
            value = torch.iinfo(dtype).max
        except TypeError:
            return t
    with torch.no_grad():
        t.fill_(value)
    return t


def _poison_np(a):
    """The NumPy twin of :func:`_poison` (object and other dtypes are left as allocated)."""
    if not isinstance(a, np.ndarray) or a.size == 0:
        return a
    kind = a.dtype.kind
    if kind in "fc":
        a.fill(np.nan)
    elif kind == "b":
        a.fill(True)
    elif kind in "iu":
        a.fill(np.iinfo(a.dtype).max)
    return a


def _poisoned(fn, poison=_poison):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return poison(fn(*args, **kwargs))

    wrapper.__varpack_poisoned__ = True
    return wrapper


@pytest.fixture(autouse=True)
def _nan_fill_uninitialised(request, monkeypatch):
    """``torch.empty`` / ``torch.empty_like`` / ``torch.empty_strided`` / ``Tensor.new_empty`` (and NumPy's
    ``np.empty`` / ``np.empty_like``) return arrays filled with NaN (floats) or the dtype's max (integers) in
    every test, so code that reads memory it never wrote fails instead of passing on whatever the allocator
    left there. Python-level calls through the module attribute only (torch's C++ internals, and a name bound
    by ``from torch import empty`` before the test, allocate without this). Opt out with
    ``@pytest.mark.uninitialised_ok`` (say why)."""
    if request.node.get_closest_marker("uninitialised_ok") is not None:
        yield
        return
    for owner, name, wrapper in _POISONED:
        monkeypatch.setattr(owner, name, wrapper)
    yield


# Built once and kept alive for the whole session: torch._dynamo caches the id() of every function it finds in
# torch / numpy's namespaces, so a per-test wrapper, freed after the test, could lend its id to a later
# function (e.g. a flex_attention mask_mod) that dynamo would then mistake for a numpy function.
_POISONED = [
    (torch, "empty", _poisoned(torch.empty)),
    (torch, "empty_like", _poisoned(torch.empty_like)),
    (torch, "empty_strided", _poisoned(torch.empty_strided)),
    (torch.Tensor, "new_empty", _poisoned(torch.Tensor.new_empty)),
    (np, "empty", _poisoned(np.empty, _poison_np)),
    (np, "empty_like", _poisoned(np.empty_like, _poison_np)),
]
