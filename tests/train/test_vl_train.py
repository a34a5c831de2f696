"""End to end on the built-in image-caption set: encode -> plan -> PackedDataset -> collator -> train steps
of tiny Qwen3-VL (loaded through ``varpack.models.load_model``, i.e. with varpack attention), and the
overflow path that must never cut inside an image."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("PIL")
pytest.importorskip("skimage")

from varpack.collate import PaddingFreeCollator  # noqa: E402
from varpack.data.dataset import PackedDataset  # noqa: E402
from varpack.data.media import image_processor_for  # noqa: E402
from varpack.data.multimodal import (  # noqa: E402
    check_plan_cuts,
    encode_any,
    has_mm_chats,
    image_spans,
    slice_mm_sample,
)
from varpack.data.tokenizer import load_tokenizer  # noqa: E402
from varpack.data.vl_builtin import builtin_vl_chats, write_vl_jsonl  # noqa: E402
from varpack.integrations.vision import check_media  # noqa: E402
from varpack.plan import plan_packs  # noqa: E402


@pytest.fixture(scope="module")
def model():
    from varpack.models import load_model

    return load_model("tiny-qwen3-vl", seed=0)


@pytest.fixture(scope="module")
def samples(model, tmp_path_factory):
    path = write_vl_jsonl(tmp_path_factory.mktemp("vl") / "vl.jsonl", limit=8)
    assert has_mm_chats(path)
    proc = image_processor_for(model, min_pixels=32 * 32, max_pixels=128 * 128)
    out = encode_any(path, load_tokenizer("qwen3"), image_processor=proc, rope_model=model)
    assert isinstance(out, list) and len(out) == len(builtin_vl_chats(limit=8))
    return out


def test_plan_dataset_collate_train(model, samples):
    lengths = np.array([s["length"] for s in samples])
    plan = plan_packs(lengths, 160)
    ds = PackedDataset(samples, plan, shuffle=False)
    seen = sorted(s["sample_id"] for pack in ds for s in pack)
    assert seen == list(range(len(samples)))  # every sample exactly once
    collate = PaddingFreeCollator()
    batch = collate([ds[0]])
    assert batch["position_ids"].shape[0] == 4 and batch["input_ids"].shape[1] <= 160
    check_media(batch, model)


def test_sft_trainer_on_image_captions(model, samples, tmp_path):
    """``varpack.train.build_sft`` (what ``varpack sft`` runs) trains the tiny VL model on the encoded set."""
    from varpack.integrations.vision import prepare_vl_model
    from varpack.train import SFTConfig, build_sft

    prepare_vl_model(model)
    seen = {"patches": 0, "calls": 0}

    def count(module, args, kwargs):
        seen["calls"] += 1
        if kwargs.get("pixel_values") is not None:
            seen["patches"] += int(kwargs["pixel_values"].shape[0])

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    config = SFTConfig(
        model="tiny-qwen3-vl", packing_length=160, max_steps=2, lr=1e-3, output_dir=str(tmp_path), save=False
    )
    run = build_sft(config, model=model, tokenizer=load_tokenizer("qwen3"), encoded=samples)
    out = run.trainer.train()
    handle.remove()
    model.eval()
    assert np.isfinite(out.training_loss) and out.global_step == 2
    assert seen["calls"] == 2 and seen["patches"] > 0  # image patches reached the model in packed steps


def test_split_overflow_never_cuts_images(samples):
    lengths = np.array([s["length"] for s in samples])
    image_ids = [i for i, s in enumerate(samples) if "image_grid_thw" in s]
    budget = (
        int(min(image_spans(samples[i])[0]["stop"] for i in image_ids)) - 2
    )  # every image sample overflows
    plan = plan_packs(lengths, budget, overflow="split")
    bad = check_plan_cuts(samples, plan.pieces)
    cut_ids = {b["sample_id"] for b in bad}
    # a blind token-range split cuts through images: the report names them, so the caller can reject the plan
    assert cut_ids and cut_ids <= set(image_ids)
    for b in bad:
        with pytest.raises(ValueError, match=rf"sample {b['sample_id']}: cut at token"):
            slice_mm_sample(samples[b["sample_id"]], b["start"], b["stop"], sample_id=b["sample_id"])
    # legal pieces slice with their own media: the pieces of one sample give back all its patches
    legal = [p for pid, p in plan.pieces.items() if pid not in {b["piece_id"] for b in bad}]
    for sid, start, stop in legal:
        piece = slice_mm_sample(samples[sid], start, stop, sample_id=sid)
        n_pad = sum(1 for t in piece["mm_token_type_ids"] if t == 1)
        grid = piece.get("image_grid_thw")
        assert n_pad == (0 if grid is None else int((grid.prod(-1) // 4).sum()))
