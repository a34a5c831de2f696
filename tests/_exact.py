"""The test suite's packed == unpacked comparison rule (float32 on the CPU).

A packed row and the samples run one by one compute the same sums in a different order (other GEMM shapes,
another reduction tree), so their float32 results differ by rounding that grows with each tensor's magnitude:
a LoRA A gradient of scale 0.61 differs by 1.6e-6 (relative 2.7e-6) between the two runs of tiny-qwen3.5 with
torch 2.13 / transformers 5.24, failing the element-wise ``atol=1e-6`` the tests used. The rule is therefore
relative to each tensor's own scale, and tensor by tensor (a leak confined to a small-gradient parameter is
not hidden by a large one elsewhere):

    max|got - want| <= rtol * max|want| + atol        (per tensor; ``want`` is the reference)

with the worst tensor (largest ``max|got - want| / bound``) named in a failure. The same form as
:func:`varpack.check.check_exactness`'s float32 rule, which serves any model and so is looser (gradients
``rtol=1e-3``); the tests hold tiny models to ``GRAD_RTOL`` / ``LOGITS_RTOL``.

A negative control (boundaries dropped, a boundary source sabotaged) must not merely fail this rule: it must
exceed the bound by :data:`MARGIN` times (:func:`assert_differs`), so that the control stays far from the
tolerance and a later loosening of the tolerance cannot make it pass unnoticed.

Measured (torch 2.13.0+cpu, transformers 5.24.0; ``VARPACK_TEST_GAPS=1 pytest -s`` prints every comparison's
worst ratio): over the tests using this module (tests/invariant, tests/train/test_lora.py, test_trl.py,
tests/ops/test_custom_ops.py) honest runs reach at most 0.21 of the bound (the ``A_log`` gradient of packed
DPO on tiny-qwen3.5), most below 0.05 (the LoRA A gradient above: 1.6e-6 against a bound of 6.1e-5); the
negative controls reach at least 159 times the bound (tiny-qwen3-next with the recurrence run without
boundaries), most 1e3-1e5.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from varpack.check import FP32_GRAD_ATOL

#: gradients: 1e-4 of the tensor's own max|g| (honest fp32 gaps are a few 1e-6 of it)
GRAD_RTOL = 1e-4
#: logits (forward only: honest fp32 gaps are ~1e-6 of max|logit|)
LOGITS_RTOL = 5e-5
#: a scalar loss (token mean of per-token cross entropies: honest gaps up to 5e-7 of it)
LOSS_RTOL = 5e-6
#: absolute term, varpack.check's float32 gradient term: the gradient of a Gated DeltaNet gate (``A_log``) is
#: a cancelling sum over tokens, its honest gap up to 3e-8 where its own max|g| is 3e-4 (packed DPO on
#: tiny-qwen3.5); a leak confined to such a parameter (~1e-6) still exceeds it tenfold
ATOL = FP32_GRAD_ATOL
#: a negative control must exceed the bound by this factor (the sabotaged runs measure >= 159, most >= 1e3)
MARGIN = 100.0


@dataclass(frozen=True)
class Gap:
    """One tensor's comparison: ``diff = max|got - want|``, ``scale = max|want|``, ``bound = rtol * scale +
    atol``; ``ratio = diff / bound`` (NaN / inf for a non-finite difference)."""

    name: str
    diff: float
    scale: float
    bound: float

    @property
    def ratio(self) -> float:
        return self.diff / self.bound if self.bound > 0 else math.inf

    def __str__(self) -> str:
        return (
            f"{self.name}: max|diff| {self.diff:.3g} vs bound {self.bound:.3g} "
            f"(max|ref| {self.scale:.3g}; {self.ratio:.3g} x the bound)"
        )


def _as_dict(x: Any, what: str) -> dict[str, torch.Tensor]:
    if isinstance(x, Mapping):
        return {str(k): torch.as_tensor(v) for k, v in x.items()}
    return {what: torch.as_tensor(x)}


def gaps(
    got: Any, want: Any, *, rtol: float = GRAD_RTOL, atol: float = ATOL, what: str = "tensor"
) -> list[Gap]:
    """Per-tensor gaps of ``got`` against the reference ``want`` (tensors, numbers, or dicts name -> tensor
    with the same names); raises AssertionError for different names or shapes."""
    a, b = _as_dict(got, what), _as_dict(want, what)
    if a.keys() != b.keys():
        missing, extra = sorted(b.keys() - a.keys()), sorted(a.keys() - b.keys())
        raise AssertionError(f"{what}: different tensors (missing {missing[:5]}, extra {extra[:5]})")
    out = []
    for name in a:
        x, y = a[name].detach().double().cpu(), b[name].detach().double().cpu()
        if x.shape != y.shape:
            raise AssertionError(f"{what} {name}: shape {tuple(x.shape)} != reference {tuple(y.shape)}")
        diff = float((x - y).abs().max()) if x.numel() else 0.0
        if not math.isfinite(diff):
            diff = math.inf
        scale = float(y.abs().max()) if y.numel() else 0.0
        out.append(Gap(name if isinstance(got, Mapping) else what, diff, scale, rtol * scale + atol))
    return out


def worst(found: list[Gap]) -> Gap:
    """The gap with the largest ratio to its bound."""
    return max(found, key=lambda g: g.ratio)


def measure(
    got: Any, want: Any, *, rtol: float = GRAD_RTOL, atol: float = ATOL, what: str = "tensor"
) -> Gap:
    """The worst gap of ``got`` against ``want`` (printed with ``VARPACK_TEST_GAPS=1`` set: ``pytest -s``
    then lists every comparison's ratio, the measurement behind the constants above)."""
    w = worst(gaps(got, want, rtol=rtol, atol=atol, what=what))
    if os.environ.get("VARPACK_TEST_GAPS"):
        print(f"[gap] {what}: {w}")
    return w


def assert_exact(
    got: Any, want: Any, *, rtol: float = GRAD_RTOL, atol: float = ATOL, what: str = "gradient"
) -> Gap:
    """Assert ``max|got - want| <= rtol * max|want| + atol`` for every tensor; the failure names the worst
    tensor and how far it is. Returns the worst gap."""
    found = gaps(got, want, rtol=rtol, atol=atol, what=what)
    w = measure(got, want, rtol=rtol, atol=atol, what=what)
    failing = [g for g in found if not g.diff <= g.bound]
    if failing:
        raise AssertionError(
            f"{what}: packed != unpacked in {len(failing)} of {len(found)} tensor(s); worst {worst(failing)}"
        )
    return w


def assert_differs(
    got: Any,
    want: Any,
    *,
    rtol: float = GRAD_RTOL,
    atol: float = ATOL,
    margin: float = MARGIN,
    what: str = "gradient",
) -> Gap:
    """Negative control: some tensor must exceed the bound of :func:`assert_exact` by ``margin`` times (a
    leak is far outside the tolerance, not near it). Returns the worst gap."""
    w = measure(got, want, rtol=rtol, atol=atol, what=f"{what} (control)")
    if not w.ratio > margin:
        raise AssertionError(f"{what}: the negative control is within {margin:g} x the tolerance: {w}")
    return w
