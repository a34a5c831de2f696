"""conftest's NaN fill of uninitialised tensors is active in every test (so a test cannot pass by reading
memory the code never wrote)."""

import numpy as np
import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_empty_float_is_nan(dtype):
    ref = torch.zeros(3, 5, dtype=dtype)
    for t in (
        torch.empty(3, 5, dtype=dtype),
        torch.empty((3, 5), dtype=dtype),
        torch.empty_like(ref),
        ref.new_empty((3, 5)),
        torch.empty_strided((3, 5), (5, 1), dtype=dtype),
    ):
        assert t.shape == (3, 5) and t.dtype == dtype
        assert torch.isnan(t).all()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_empty_integer_is_sentinel(dtype):
    big = torch.iinfo(dtype).max
    assert (torch.empty(7, dtype=dtype) == big).all()
    assert (torch.empty_like(torch.zeros(7, dtype=dtype)) == big).all()
    assert (torch.zeros(1, dtype=dtype).new_empty(7) == big).all()


def test_numpy_empty_is_nan_or_sentinel():
    assert np.isnan(np.empty((2, 3))).all() and np.isnan(np.empty_like(np.zeros(4, np.float32))).all()
    assert (np.empty(5, np.int32) == np.iinfo(np.int32).max).all()
    assert (np.empty_like(np.zeros(5, np.int64)) == np.iinfo(np.int64).max).all()


def test_requires_grad_and_out_keep_working():
    t = torch.empty(4, requires_grad=True)
    assert t.requires_grad and t.is_leaf and torch.isnan(t).all()
    buf = torch.zeros(4)
    assert torch.empty(4, out=buf) is buf and torch.isnan(buf).all()


@pytest.mark.uninitialised_ok  # the opt-out itself: torch.empty is torch's own function again
def test_opt_out_marker_restores_torch_empty():
    assert not getattr(torch.empty, "__varpack_poisoned__", False)
    assert not getattr(np.empty, "__varpack_poisoned__", False)
