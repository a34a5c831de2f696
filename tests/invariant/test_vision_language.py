"""Packed vision-language training step == per-sample steps (tiny Qwen3-VL and Qwen3.5, real images).

Real package images at mixed resolutions and text-only chats share one packed row. The reference runs every
sample alone through the unmodified model (sdpa attention, the model's own linear-attention path and its
own mRoPE positions: no ``position_ids`` given). The packed run uses varpack's encoding, per-sample mRoPE
(text plane first), the padding-free collator and ``enable_varpack``. Logits, the token-mean loss and every
parameter's gradient must agree. Negative controls: without the text plane (3 mRoPE planes only) or with
boundaries derived from an mRoPE plane, or with media out of pack order, the same comparison fails.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("PIL")
pytest.importorskip("skimage")

from tests._exact import LOGITS_RTOL, LOSS_RTOL, MARGIN, assert_exact, measure  # noqa: E402
from varpack.collate import PaddingFreeCollator  # noqa: E402
from varpack.data.media import image_processor_for  # noqa: E402
from varpack.data.multimodal import encode_mm_chat  # noqa: E402
from varpack.data.tokenizer import load_tokenizer  # noqa: E402
from varpack.data.vl_builtin import package_image_path  # noqa: E402
from varpack.integrations.vision import (  # noqa: E402
    check_media,
    install_media_guard,
    isolate_vision_tower,
    prepare_vl_model,
)
from varpack.loss import causal_lm_loss  # noqa: E402
from varpack.models.qwen_vl import tiny_config, tiny_model  # noqa: E402
from varpack.schema import BOUNDARY_KEYS


def img(name: str) -> str:
    return package_image_path("matplotlib" if name == "grace_hopper.jpg" else "skimage", name)


def user_image(names: list[str], question: str, answer: str) -> list[dict]:
    content = [{"type": "image", "image": img(n)} for n in names] + [{"type": "text", "text": question}]
    return [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]


def text_chat(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


CHATS = [
    user_image(["astronaut.png"], "Who is this?", "An astronaut in an orange suit."),
    text_chat("What is 12 times 7?", "84."),
    user_image(["text.png", "grace_hopper.jpg"], "Describe both.", "Handwritten maths, then a portrait."),
    text_chat("Say hi.", "Hi!"),
    user_image(["page.png"], "Read the heading.", "Region-based segmentation."),
    user_image(["chelsea.png"], "What animal?", "A cat."),
]
# Qwen3.5's reference linear-attention path is slow on CPU: a smaller mix (still 3 grids + text)
CHATS_35 = [CHATS[0], CHATS[1], CHATS[2]]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3")


@pytest.fixture(scope="module")
def proc():
    return image_processor_for(tiny_config("tiny-qwen3-vl"), min_pixels=32 * 32, max_pixels=128 * 128)


def encode(chats, tok, proc, model):
    return [encode_mm_chat(c, tok, proc, sample_id=i, rope_model=model) for i, c in enumerate(chats)]


def per_sample_run(model, samples):
    """Each sample alone, the model's own positions and attention; loss = token mean over all samples."""
    model.zero_grad(set_to_none=True)
    n_sup = sum(sum(x != -100 for x in s["labels"][1:]) for s in samples)
    logits_all, total = [], 0.0
    for s in samples:
        kw = {
            "input_ids": torch.tensor([s["input_ids"]]),
            "mm_token_type_ids": torch.tensor([s["mm_token_type_ids"]]),
            "use_cache": False,
        }
        if "pixel_values" in s:
            kw.update(pixel_values=s["pixel_values"], image_grid_thw=s["image_grid_thw"])
        model.model.rope_deltas = None
        logits = model(**kw).logits
        total = total + causal_lm_loss(logits, torch.tensor([s["labels"]]), num_items_in_batch=1)
        logits_all.append(logits[0].detach())
    loss = total / n_sup
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(logits_all), loss.detach(), grads


def packed_run(model, batch, *, boundaries=True):
    model.zero_grad(set_to_none=True)
    logits = model(use_cache=False, **packed_inputs(batch, boundaries)).logits
    loss = causal_lm_loss(logits, batch["labels"], seq_idx=batch.get("seq_idx"))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits[0].detach(), loss.detach(), grads


def packed_inputs(batch, boundaries=True):
    kw = {k: v for k, v in batch.items() if k not in ("labels", "sample_ids", "loss_scale")}
    if not boundaries:
        for k in BOUNDARY_KEYS:  # varpack.schema: every boundary key, varlen_meta included
            kw.pop(k, None)
    return kw


def logits_gap(model, batch, ref, *, boundaries=True):
    """Forward only (negative controls): the packed logits' gap to the per-sample ones (tests/_exact.py)."""
    with torch.no_grad():
        logits = model(use_cache=False, **packed_inputs(batch, boundaries)).logits[0]
    return measure(logits, ref[0], rtol=LOGITS_RTOL, what="logits")


def assert_packed_exact(ref, got, what: str) -> None:
    """Logits, loss and every gradient of the packed run ``got`` equal the per-sample run ``ref``
    (tests/_exact.py's rule)."""
    (lr, sr, gr), (lg, sg, gg) = ref, got
    assert_exact(lg, lr, rtol=LOGITS_RTOL, what=f"{what} logits")
    assert_exact(sg, sr, rtol=LOSS_RTOL, what=f"{what} loss")
    assert_exact(gg, gr, what=f"{what} gradient")


def varpack_model(ref_model):
    """A copy of ``ref_model`` switched to varpack; xfail (with the reason) if a layer kind is not supported."""
    from varpack.integrations.transformers import PackingGuardError, enable_varpack

    model = copy.deepcopy(ref_model)
    try:
        # no media guard here: the negative controls must show a mismatch, not a refusal by the guard
        return prepare_vl_model(enable_varpack(model), media_guard=False)
    except PackingGuardError as exc:
        if "linear-attention" in str(exc):
            pytest.xfail(f"Qwen3.5 linear-attention layers need varpack.integrations.gated_delta (H6): {exc}")
        raise


@pytest.fixture(scope="module", params=["tiny-qwen3-vl", "tiny-qwen3.5-vl"])
def setup(request, tok, proc):
    name = request.param
    ref_model = tiny_model(name)
    samples = encode(CHATS if name == "tiny-qwen3-vl" else CHATS_35, tok, proc, ref_model)
    ref = per_sample_run(ref_model, samples)
    return name, ref_model, samples, ref


@pytest.fixture(scope="module")
def vp(setup):
    """(name, varpack model, samples, ref): the reference model's copy under enable_varpack."""
    name, ref_model, samples, ref = setup
    return name, varpack_model(ref_model), samples, ref


def test_mixed_pack_has_real_mixed_media(setup):
    _, _, samples, _ = setup
    grids = torch.cat([s["image_grid_thw"] for s in samples if "image_grid_thw" in s])
    assert len({tuple(g) for g in grids.tolist()}) >= 3  # mixed resolutions
    assert any("image_grid_thw" not in s for s in samples)  # text-only samples in the same pack


def test_packed_equals_per_sample(vp):
    name, model, samples, ref = vp
    batch = PaddingFreeCollator()(samples)
    assert batch["position_ids"].shape == (4, 1, sum(s["length"] for s in samples))
    check_media(batch, model)
    assert_packed_exact(ref, packed_run(model, batch), name)


def test_transformers_mask_path_reads_text_plane(setup):
    """Without varpack attention, transformers' own sdpa mask derives the samples from the text plane alone."""
    name, ref_model, samples, ref = setup
    if name != "tiny-qwen3-vl":
        pytest.skip("Qwen3.5's own linear-attention layers mix packed samples (needs enable_varpack)")
    batch = PaddingFreeCollator()(samples)
    assert_packed_exact(ref, packed_run(ref_model, batch, boundaries=False), name)


def _fails(run) -> tuple[bool, str]:
    """True if ``run()`` (the logits' gap) exceeds the exactness bound by tests/_exact.py's MARGIN, or is
    refused with an error."""
    from varpack.integrations.transformers import PackingGuardError

    try:
        gap = run()
    except (ValueError, PackingGuardError) as exc:  # refused: the test cannot pass either
        return True, f"raised {type(exc).__name__}: {exc}"
    return gap.ratio > MARGIN, str(gap)


def test_negative_control_three_planes_without_text_plane(vp, setup):
    name, model, samples, ref = vp
    ref_model = setup[1]
    three = [dict(s, position_ids=s["position_ids"][1:]) for s in samples]
    # the collator cannot take boundaries from an mRoPE plane ...
    with pytest.raises(ValueError):
        PaddingFreeCollator(text_plane=0)(three)
    # ... and a batch that carries only the 3 planes (no text plane, no boundaries) does not match
    batch = PaddingFreeCollator()(samples)
    batch["position_ids"] = batch["position_ids"][1:]
    failed, why = _fails(lambda: logits_gap(model, batch, ref, boundaries=False))
    assert failed, f"{name}: 3-plane positions without boundaries unexpectedly exact ({why})"
    if name == "tiny-qwen3-vl":  # the model's own mask path mixes too
        failed, why = _fails(lambda: logits_gap(ref_model, batch, ref, boundaries=False))
        assert failed, why


def test_negative_control_boundaries_from_mrope_plane(vp):
    """Boundaries read from the width plane (transformers' +1-step rule) split images: not exact."""
    from transformers.masking_utils import find_packed_sequence_indices

    from varpack.varlen import cu_seqlens_from_segment_ids

    name, model, samples, ref = vp
    batch = PaddingFreeCollator()(samples)
    width = batch["position_ids"][3]
    segments = find_packed_sequence_indices(width)
    cu, _ = cu_seqlens_from_segment_ids(segments[0] + 1)
    assert cu.numel() - 1 > len(samples)  # the width plane "restarts" inside every image row
    bad = dict(batch)
    bad["cu_seq_lens_q"] = bad["cu_seq_lens_k"] = cu
    bad["max_length_q"] = bad["max_length_k"] = int((cu[1:] - cu[:-1]).max())
    bad["seq_idx"] = segments.to(torch.int32)
    bad.pop("varlen_meta")
    failed, why = _fails(lambda: logits_gap(model, bad, ref))
    assert failed, f"{name}: mRoPE-plane boundaries unexpectedly exact ({why})"


def test_negative_control_media_out_of_pack_order(vp):
    name, model, samples, ref = vp
    order = [i for i, s in enumerate(samples) if "image_grid_thw" in s]
    swapped = [dict(s) for s in samples]
    a, b = order[0], order[-1]
    for key in ("pixel_values", "image_grid_thw"):
        swapped[a][key], swapped[b][key] = samples[b][key], samples[a][key]
    batch = PaddingFreeCollator()(samples)
    wrong = PaddingFreeCollator()(swapped)
    batch["pixel_values"], batch["image_grid_thw"] = wrong["pixel_values"], wrong["image_grid_thw"]
    failed, why = _fails(lambda: logits_gap(model, batch, ref))
    assert failed, f"{name}: media in the wrong order unexpectedly exact ({why})"


def test_slots_features_mismatch_raises_before_forward(setup):
    name, ref_model, samples, _ = setup
    batch = PaddingFreeCollator()(samples)
    grid = batch["image_grid_thw"]
    patches_last = int(grid[-1].prod())
    short = dict(batch, image_grid_thw=grid[:-1], pixel_values=batch["pixel_values"][:-patches_last])
    slots = int((batch["input_ids"] == 151655).sum())
    features = int((grid[:-1].prod(-1) // 4).sum())
    with pytest.raises(
        ValueError, match=rf"image slots != features: input_ids hold {slots} .* gives {features}"
    ):
        check_media(short, ref_model)
    model = copy.deepcopy(ref_model)
    handle = install_media_guard(model)
    kw = {
        k: v for k, v in short.items() if k in ("input_ids", "position_ids", "pixel_values", "image_grid_thw")
    }
    with pytest.raises(ValueError, match=rf"{slots} image placeholder tokens"), torch.no_grad():
        model(use_cache=False, **kw)
    with pytest.raises(ValueError, match=r"text plane first"), torch.no_grad():
        model(
            use_cache=False,
            **dict(
                kw,
                position_ids=batch["position_ids"][1:],
                **{"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]},
            ),
        )
    handle.remove()
    pixels_off = dict(batch, pixel_values=batch["pixel_values"][:-1])
    with pytest.raises(ValueError, match=r"pixel_values has .* rows but image_grid_thw describes"):
        check_media(pixels_off, ref_model)


def test_vision_tower_isolated_from_text_boundaries(vp):
    """transformers 5.17 forwards the text stream's varlen kwargs into the vision tower; the hook drops them."""
    name, model, samples, _ = vp
    batch = PaddingFreeCollator()(samples)
    text_kw = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    visual = model.model.visual
    args = (batch["pixel_values"],)
    with torch.no_grad():
        alone = visual(*args, grid_thw=batch["image_grid_thw"]).pooler_output
        for h in model._varpack_vl_handles:
            h.remove()
        try:  # unprotected: the image tokens would be split by the text stream's boundaries
            leaked = visual(*args, grid_thw=batch["image_grid_thw"], **text_kw).pooler_output
            assert (leaked - alone).abs().max() > 1e-4
        except (ValueError, RuntimeError, TypeError):
            pass
        handle = isolate_vision_tower(model)
        guarded = visual(*args, grid_thw=batch["image_grid_thw"], **text_kw).pooler_output
        handle.remove()
        prepare_vl_model(model, media_guard=False)
    torch.testing.assert_close(guarded, alone, rtol=0, atol=0)
