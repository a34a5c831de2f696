"""benchmarks/vl_check_tower.py: the vision tower called per image, and the modules whose output differs between a
packed row and rows of one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("skimage")

from benchmarks.vl_check_tower import first_difference, per_image_tower  # noqa: E402
from varpack.models.qwen_vl import tiny_model  # noqa: E402

MODEL = "tiny-qwen3.5-vl"


def _pixels(visual, grids):
    patch = visual.config.in_channels * visual.config.temporal_patch_size * visual.config.patch_size**2
    return torch.randn(sum(int(g.prod()) for g in grids), patch, generator=torch.Generator().manual_seed(0))


def test_per_image_tower_equals_one_call_in_float32_and_refuses_whole_call_keywords():
    model = tiny_model(MODEL)
    visual = model.model.visual
    grid = torch.tensor([[1, 4, 6], [1, 8, 4]])
    pixels = _pixels(visual, grid)
    one = visual(pixels, grid_thw=grid)
    per_image_tower(model)
    assert visual.forward.__func__.__name__ == "_per_image_forward"
    each = visual(pixels, grid_thw=grid)
    assert type(each) is type(one)
    for key in ("last_hidden_state", "pooler_output"):
        assert each[key].shape == one[key].shape
        torch.testing.assert_close(each[key], one[key], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="cu_seqlens"):
        visual(pixels, grid_thw=grid, cu_seqlens=torch.tensor([0, 24, 56], dtype=torch.int32))


def _vl_rows(model, n=3):
    from varpack.cli.check import select_mm_samples
    from varpack.data import load_and_encode
    from varpack.models import load_tokenizer_for

    data = load_and_encode(None, load_tokenizer_for(MODEL), vl=True, rope_model=model, num_proc=1)
    return select_mm_samples(data.samples, n)


def test_first_difference_finds_none_on_cpu_and_names_a_perturbed_module():
    """On the CPU, in float32, the packed row and the rows of one agree in every module to GEMM rounding (the
    BLAS may sum a longer row in another order); a module made to depend on its row (its output shifted by
    1e-3 when the row is one sample) is the first reported beyond rounding, in call order."""
    from varpack.integrations.transformers import enable_varpack
    from varpack.models import load_model

    model = load_model(MODEL)  # as varpack check loads it
    rows = _vl_rows(model)
    enable_varpack(model)
    compared, diffs = first_difference(model, rows, "cpu")
    assert compared > 20 and all(d < 1e-5 for _, d, _ in diffs), diffs

    total = sum(len(r["input_ids"]) for r in rows)
    target = "model.language_model.layers.1.mlp"
    module = model.get_submodule(target)

    def shift(mod, inputs, output):
        return output + 1e-3 if output.shape[1] != total else output

    handle = module.register_forward_hook(shift)
    try:
        compared2, diffs = first_difference(model, rows, "cpu")
    finally:
        handle.remove()
    assert compared2 == compared
    beyond = [(name, d) for name, d, _ in diffs if d >= 1e-5]
    assert beyond and beyond[0][0] == target and beyond[0][1] > 5e-4
