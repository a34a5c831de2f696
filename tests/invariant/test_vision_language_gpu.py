"""GPU: packed vision-language step (bf16, varpack ``auto`` backends) vs per-sample fp32 truth.

Tolerance rule (flash-attn's ``attention_ref`` convention): the packed bf16 error against the fp32 per-sample
truth must stay within 3x the error of the model's own bf16 per-sample run, plus a small atol. Negative
control: the same packed run without the text plane / boundaries breaks that bound.
"""

from __future__ import annotations

import copy

import pytest
import torch

from varpack.schema import BOUNDARY_KEYS

pytestmark = pytest.mark.gpu


def _inputs(tok, proc, model):
    pytest.importorskip("PIL")
    from varpack.data.multimodal import encode_mm_chat
    from varpack.data.vl_builtin import builtin_vl_chats

    try:
        chats = builtin_vl_chats(limit=6)
    except ValueError as exc:  # scikit-image / matplotlib images missing on this machine
        pytest.skip(f"package sample images unavailable: {exc}")
    return [
        encode_mm_chat(c["messages"], tok, proc, sample_id=i, rope_model=model) for i, c in enumerate(chats)
    ]


def _per_sample_logits(model, samples, device):
    out = []
    with torch.no_grad():
        for s in samples:
            kw = {
                "input_ids": torch.tensor([s["input_ids"]], device=device),
                "mm_token_type_ids": torch.tensor([s["mm_token_type_ids"]], device=device),
                "use_cache": False,
            }
            if "pixel_values" in s:
                kw.update(
                    pixel_values=s["pixel_values"].to(device), image_grid_thw=s["image_grid_thw"].to(device)
                )
            model.model.rope_deltas = None
            out.append(model(**kw).logits[0].float())
    return torch.cat(out)


def _packed_logits(model, batch, device, *, boundaries=True):
    kw = {k: v for k, v in batch.items() if k not in ("labels", "sample_ids", "loss_scale")}
    if not boundaries:
        for k in BOUNDARY_KEYS:  # varpack.schema: every boundary key, varlen_meta included
            kw.pop(k, None)
        kw["position_ids"] = kw["position_ids"][1:]
    kw = {
        k: (v.to(device) if isinstance(v, torch.Tensor) and not k.startswith("cu_seq_lens") else v)
        for k, v in kw.items()
    }
    with torch.no_grad():
        return model(use_cache=False, **kw).logits[0].float()


@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-qwen3.5-vl"])
def test_packed_bf16_within_bf16_error_of_truth(name):
    from varpack.collate import PaddingFreeCollator
    from varpack.data.media import image_processor_for
    from varpack.data.tokenizer import load_tokenizer
    from varpack.integrations.transformers import enable_varpack
    from varpack.integrations.vision import prepare_vl_model
    from varpack.models.qwen_vl import tiny_model

    device = torch.device("cuda")
    truth_model = tiny_model(name).to(device)
    proc = image_processor_for(truth_model, min_pixels=64 * 64, max_pixels=256 * 256)
    samples = _inputs(load_tokenizer("qwen3"), proc, truth_model)
    truth = _per_sample_logits(truth_model, samples, device)
    ref_bf16 = _per_sample_logits(copy.deepcopy(truth_model).to(torch.bfloat16), samples, device)
    packed_model = prepare_vl_model(enable_varpack(copy.deepcopy(truth_model).to(torch.bfloat16)))
    batch = PaddingFreeCollator()(samples)
    packed = _packed_logits(packed_model, batch, device)
    bound = 3 * (ref_bf16 - truth).abs().max().item() + 1e-2
    err = (packed - truth).abs().max().item()
    assert err <= bound, f"{name}: packed bf16 error {err} > bound {bound}"
    unguarded = prepare_vl_model(packed_model, media_guard=False)
    try:
        bad = (_packed_logits(unguarded, batch, device, boundaries=False) - truth).abs().max().item()
    except ValueError:
        bad = float("inf")  # refused by a guard: fails the bound as well
    assert bad > bound, f"{name}: negative control (3 planes, no boundaries) within bound: {bad} <= {bound}"
