"""benchmarks/vl_tower_bf16.py: the vision tower's gradients, one call for all images against a call per image."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("skimage")

from benchmarks.vl_tower_bf16 import tower_grads  # noqa: E402
from varpack.models.qwen_vl import tiny_model  # noqa: E402


def test_one_call_and_a_call_per_image_agree_in_float32_and_differ_in_bf16():
    """The tower is per image, so in float32 batching changes nothing beyond rounding; the bf16 runs differ (the
    reduction lengths the benchmark measures), and the float32 truth is not the bf16 run."""
    visual = tiny_model("tiny-qwen3.5-vl").model.visual
    torch.manual_seed(0)
    grids = [torch.tensor([[1, 4, 6]]), torch.tensor([[1, 8, 4]])]
    patch = visual.config.in_channels * visual.config.temporal_patch_size * visual.config.patch_size**2
    pixels = [torch.randn(int(g.prod()), patch) for g in grids]
    one = tower_grads(visual, pixels, grids, torch.float32, batched=True)
    each = tower_grads(visual, pixels, grids, torch.float32, batched=False)
    assert one.keys() == each.keys() and len(one) > 4
    for name in one:
        torch.testing.assert_close(one[name], each[name], rtol=1e-4, atol=1e-5 * float(each[name].abs().max()) + 1e-7)
    bf16 = tower_grads(visual, pixels, grids, torch.bfloat16, batched=True)
    assert any(not torch.equal(bf16[n], one[n]) for n in one)
