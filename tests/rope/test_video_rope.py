"""Video mRoPE positions: Qwen2.5-VL's ``second_per_grid_ts`` end to end, video layouts the rope function rejects,
and rope-function arguments varpack cannot supply.

The right value is always the model's own ``get_rope_index`` (built from a tiny config offline, weights on
``meta``). torchvision (the backend of transformers' Qwen-VL video processors) cannot be installed beside the
CPU torch here, so videos come from :class:`HandVideoProcessor`: already-sampled frames are cut into the
Qwen-VL patch layout by hand, and the real ``Qwen2_5_VLProcessor`` / ``Qwen3VLProcessor`` around it write the
placeholders, the frame timestamps and ``second_per_grid_ts`` with their own code.
"""

from __future__ import annotations

import copy
import types

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
pytest.importorskip("skimage")

from varpack.collate import PaddingFreeCollator  # noqa: E402
from varpack.data.media import image_processor_for  # noqa: E402
from varpack.data.multimodal import encode_mm_chat, image_spans, slice_mm_sample  # noqa: E402
from varpack.data.tokenizer import load_tokenizer  # noqa: E402
from varpack.data.vl_builtin import package_image_path  # noqa: E402
from varpack.integrations.vision import check_media, prepare_vl_model  # noqa: E402
from varpack.loss import causal_lm_loss  # noqa: E402
from varpack.models.qwen_vl import QWEN3_VISION_TOKENS, tiny_config, tiny_model  # noqa: E402
from varpack.rope.mrope import mrope_position_ids, rope_args, rope_index_fn  # noqa: E402

VS = QWEN3_VISION_TOKENS["vision_start_token_id"]
VE = QWEN3_VISION_TOKENS["vision_end_token_id"]
IMG = QWEN3_VISION_TOKENS["image_token_id"]
VID = QWEN3_VISION_TOKENS["video_token_id"]
ATOL = 2e-5


# ----------------------------------------------------------------------------------------------- helpers
def qwen2_vl_config():
    """Tiny Qwen2-VL (one run per video, no second_per_grid_ts): the rope family before Qwen2.5-VL."""
    from transformers import Qwen2VLConfig

    text = {
        "vocab_size": 151936,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    }
    vision = {"depth": 1, "embed_dim": 32, "num_heads": 2, "hidden_size": 64, "spatial_merge_size": 2}
    return Qwen2VLConfig(text_config=text, vision_config=vision, **QWEN3_VISION_TOKENS)


def config(name: str):
    return qwen2_vl_config() if name == "tiny-qwen2-vl" else tiny_config(name)


def own(cfg, ids, mm, **kw) -> torch.Tensor:
    """The model's own mRoPE planes ``[3, L]`` for one sample (``get_rope_index`` of the base model)."""
    fn = rope_index_fn(cfg)
    with torch.no_grad():
        return fn(torch.as_tensor(ids)[None], mm_token_type_ids=torch.as_tensor(mm)[None], **kw)[0][:, 0]


def video_run(grid: list[int], *, per_frame: bool, timestamps: list[list[int]] | None = None):
    """Token ids / mm types of one video: ONE run (Qwen2/2.5-VL) or one run per frame (Qwen3-VL, Qwen3.5),
    frames preceded by timestamp-text tokens when given."""
    t, h, w = grid
    per = h * w // 4
    ids, mm = [VS], [0]
    if per_frame:
        for k in range(t):
            stamp = [] if timestamps is None else timestamps[k]
            ids += stamp + [VS] + [VID] * per + [VE]
            mm += [0] * len(stamp) + [0] + [2] * per + [0]
    else:
        ids += [VID] * (t * per)
        mm += [2] * (t * per)
    return ids + [VE], mm + [0]


def image_run(grid: list[int]):
    n = grid[0] * grid[1] * grid[2] // 4
    return [VS] + [IMG] * n + [VE], [0] + [1] * n + [0]


def sample_tokens(parts) -> tuple[list[int], list[int]]:
    ids, mm = [11, 12], [0, 0]
    for pid, pmm in parts:
        ids += pid + [13]
        mm += pmm + [0]
    return ids, mm


class Clip(np.ndarray):
    """Sampled frames ``[F, H, W, 3]`` uint8 with the ``VideoMetadata`` a video decoder would report."""


def clip(num_frames: int, height: int, width: int, *, fps: float, total: int, seed: int) -> Clip:
    from transformers.video_utils import VideoMetadata

    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8).view(Clip)
    idx = np.linspace(0, total - 1, num_frames).round().astype(int).tolist()
    frames.meta = VideoMetadata(total_num_frames=total, fps=fps, frames_indices=idx)
    return frames


def hand_video_processor_cls():
    from transformers import BatchFeature
    from transformers.video_processing_utils import BaseVideoProcessor
    from transformers.video_utils import make_batched_videos

    class HandVideoProcessor(BaseVideoProcessor):
        """Qwen-VL patch layout of already-sampled frames (the real processors need torchvision)."""

        merge_size = 2
        temporal_patch_size = 2
        patch_size = 14

        def __call__(self, videos, return_metadata=False, return_tensors=None, **kwargs):
            pix, grids, metas = [], [], []
            for v in make_batched_videos(videos):
                f, h, w, c = v.shape
                t, gh, gw = f // 2, h // 14, w // 14
                x = torch.as_tensor(np.asarray(v), dtype=torch.float32) / 255.0
                x = x.reshape(t, 2, gh, 14, gw, 14, c).permute(0, 2, 4, 6, 1, 3, 5).reshape(t * gh * gw, -1)
                pix.append(x)
                grids.append([t, gh, gw])
                metas.append(v.meta)
            out = BatchFeature({"pixel_values_videos": torch.cat(pix), "video_grid_thw": torch.tensor(grids)})
            if return_metadata:
                out["video_metadata"] = metas
            return out

    return HandVideoProcessor


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3")


@pytest.fixture()
def processors(tok, monkeypatch):
    """Real Qwen2_5_VLProcessor / Qwen3VLProcessor around the hand video processor. Their constructor checks
    the video processor's class against transformers' registry, which is empty without torchvision; the check
    is skipped for the hand processor only."""
    from transformers import Qwen2_5_VLProcessor, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    hand = hand_video_processor_cls()
    check = ProcessorMixin.check_argument_for_proper_class

    def _check(self, name, arg):
        return type(arg) if name == "video_processor" and isinstance(arg, hand) else check(self, name, arg)

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", _check)
    image = image_processor_for(tiny_config("tiny-qwen2.5-vl"), min_pixels=28 * 28, max_pixels=56 * 84)
    return {
        "tiny-qwen2.5-vl": Qwen2_5_VLProcessor(image_processor=image, tokenizer=tok, video_processor=hand()),
        "tiny-qwen3-vl": Qwen3VLProcessor(image_processor=image, tokenizer=tok, video_processor=hand()),
        "image": image,
    }


def video_chat(video, question: str, answer: str) -> list[dict]:
    content = [{"type": "video", "video": video}, {"type": "text", "text": question}]
    return [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]


# ------------------------------------------------------------------------------- item 4: second_per_grid_ts
def test_issue_example_half_second_per_grid():
    """The issue's case: 4 temporal grids at 0.5 s (tokens_per_second 2) are 1 position apart, as the model's
    own function gives them (the issue's [2, 3, 4, 5]; here the video starts at 3), not 2 apart."""
    cfg = tiny_config("tiny-qwen2.5-vl")
    assert cfg.vision_config.tokens_per_second == 2
    ids, mm = sample_tokens([video_run([4, 2, 2], per_frame=False)])
    grid = torch.tensor([[4, 2, 2]])
    seconds = torch.tensor([0.5])
    pos = mrope_position_ids(ids, mm, model=cfg, video_grid_thw=grid, second_per_grid_ts=seconds, sample_id=0)
    ref = own(cfg, ids, mm, video_grid_thw=grid, second_per_grid_ts=seconds)
    assert torch.equal(pos[1:], ref)
    video = [i for i, t in enumerate(mm) if t == 2]
    assert pos[1, video].tolist() == ref[0, video].tolist() == [3, 4, 5, 6]  # start 3 (after 11, 12, VS)
    # the model's default (1.0 s per grid) would space them by 2: what varpack returned before
    default = own(cfg, ids, mm, video_grid_thw=grid)
    assert default[0, video].tolist() == [3, 5, 7, 9]
    assert not torch.equal(pos[1:], default)


@pytest.mark.parametrize("seconds", [[0.5], [1.0], [2.0], [1 / 3], [0.7], [2 / 29.97]])
def test_qwen25_positions_equal_models_own_function(seconds):
    """Several videos and an image in one sample, each video with its own timing: mRoPE planes == the model's."""
    cfg = tiny_config("tiny-qwen2.5-vl")
    grids = [[3, 4, 2], [5, 2, 4]]
    secs = torch.tensor([seconds[0], seconds[0] * 3])
    ids, mm = sample_tokens(
        [
            video_run(grids[0], per_frame=False),
            image_run([1, 4, 4]),
            video_run(grids[1], per_frame=False),
        ]
    )
    kw = {
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "video_grid_thw": torch.tensor(grids),
        "second_per_grid_ts": secs,
    }
    pos = mrope_position_ids(ids, mm, model=cfg, sample_id=1, **kw)
    assert pos[0].tolist() == list(range(len(ids)))
    assert torch.equal(pos[1:], own(cfg, ids, mm, **kw))
    # negative control: each video's own timing matters (swapped values give other positions)
    swapped = dict(kw, second_per_grid_ts=secs.flip(0))
    assert not torch.equal(pos[1:], own(cfg, ids, mm, **swapped))


def test_second_per_grid_ts_refused_where_it_would_be_wrong_or_ignored():
    cfg25, cfg3 = tiny_config("tiny-qwen2.5-vl"), tiny_config("tiny-qwen3-vl")
    ids, mm = sample_tokens([video_run([4, 2, 2], per_frame=False)])
    grid = torch.tensor([[4, 2, 2]])
    with pytest.raises(
        ValueError, match=r"sample 7: Qwen2_5_VLModel.get_rope_index spaces .* no second_per_grid"
    ):
        mrope_position_ids(ids, mm, model=cfg25, video_grid_thw=grid, sample_id=7)
    with pytest.raises(ValueError, match=r"sample 7: second_per_grid_ts must be 1-D .* one per video \(1\)"):
        mrope_position_ids(
            ids, mm, model=cfg25, video_grid_thw=grid, second_per_grid_ts=[0.5, 1.0], sample_id=7
        )
    for bad in ([0.0], [-1.0], [float("nan")], [float("inf")]):
        with pytest.raises(ValueError, match=r"sample 7: second_per_grid_ts must be finite and > 0"):
            mrope_position_ids(ids, mm, model=cfg25, video_grid_thw=grid, second_per_grid_ts=bad, sample_id=7)
    text_ids, text_mm = sample_tokens([])
    with pytest.raises(
        ValueError, match=r"sample 7: second_per_grid_ts \[0.5\] given but the sample has no video"
    ):
        mrope_position_ids(text_ids, text_mm, model=cfg25, second_per_grid_ts=[0.5], sample_id=7)
    # Qwen3-VL times frames by timestamp text: a second_per_grid_ts would be ignored, so it is refused
    f_ids, f_mm = sample_tokens([video_run([4, 2, 2], per_frame=True)])
    with pytest.raises(ValueError, match=r"sample 7: second_per_grid_ts \[0.5\] given but Qwen3VLModel"):
        mrope_position_ids(
            f_ids, f_mm, model=cfg3, video_grid_thw=grid, second_per_grid_ts=[0.5], sample_id=7
        )


def test_encode_collate_positions_end_to_end(tok, processors):
    """Qwen2_5_VLProcessor's own second_per_grid_ts -> encoded sample -> collated batch -> positions."""
    cfg = tiny_config("tiny-qwen2.5-vl")
    proc = processors["tiny-qwen2.5-vl"]
    clips = [
        clip(8, 28, 56, fps=10.0, total=20, seed=0),  # sampled at 4 fps: 2 frames per grid = 0.5 s
        clip(4, 56, 28, fps=30.0, total=90, seed=1),  # 4 of 90 frames at 30 fps: 2 / (4/3) = 1.5 s
    ]
    chats = [
        video_chat(clips[0], "What moves?", "A dot."),
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        video_chat(clips[1], "What colour?", "Grey."),
    ]
    samples = [
        encode_mm_chat(c, tok, processors["image"], sample_id=i, video_processor=proc, rope_model=cfg)
        for i, c in enumerate(chats)
    ]
    for s, c in ((samples[0], clips[0]), (samples[2], clips[1])):
        # the processor's value: temporal_patch_size / sampled_fps, as BatchFeature hands it to the model
        assert s["second_per_grid_ts"].dtype == torch.float32
        assert torch.equal(s["second_per_grid_ts"], torch.tensor([2 / c.meta.sampled_fps]))
        ref = own(
            cfg,
            s["input_ids"],
            s["mm_token_type_ids"],
            video_grid_thw=s["video_grid_thw"],
            second_per_grid_ts=s["second_per_grid_ts"],
        )
        assert torch.equal(torch.tensor(s["position_ids"])[1:], ref)
    assert samples[0]["second_per_grid_ts"].tolist() == [0.5]
    assert "second_per_grid_ts" not in samples[1]

    batch = PaddingFreeCollator()(samples)
    assert torch.equal(
        batch["second_per_grid_ts"],
        torch.cat([samples[0]["second_per_grid_ts"], samples[2]["second_per_grid_ts"]]),
    )
    check_media(batch, cfg)
    cu = batch["cu_seq_lens_q"].tolist()
    for i, s in enumerate(samples):
        assert batch["position_ids"][:, 0, cu[i] : cu[i + 1]].tolist() == s["position_ids"]
    # a cut keeps the timing of the videos it keeps
    span = image_spans(samples[0])[0]
    piece = slice_mm_sample(samples[0], 0, span["stop"], sample_id=0)
    assert torch.equal(piece["second_per_grid_ts"], samples[0]["second_per_grid_ts"])
    assert "second_per_grid_ts" not in slice_mm_sample(samples[0], 0, span["start"], sample_id=0)


def test_collator_and_media_check_keep_timing_aligned():
    """second_per_grid_ts must have one entry per video, and all video samples of a batch carry it or none."""
    cfg = tiny_config("tiny-qwen2.5-vl")

    def sample(sid, grid, secs):
        ids, mm = sample_tokens([video_run(grid, per_frame=False)])
        labels = [-100] * len(ids)
        patches = grid[0] * grid[1] * grid[2]
        s = {
            "input_ids": ids,
            "labels": labels,
            "mm_token_type_ids": mm,
            "pixel_values_videos": torch.zeros(patches, 1176),
            "video_grid_thw": torch.tensor([grid]),
            "sample_id": sid,
        }
        if secs is not None:
            s["second_per_grid_ts"] = torch.tensor(secs)
        return s

    a, b = sample(3, [2, 2, 2], [0.5]), sample(4, [3, 2, 2], [1.0])
    batch = PaddingFreeCollator()([a, b])
    assert batch["second_per_grid_ts"].tolist() == [0.5, 1.0]
    with pytest.raises(
        ValueError, match=r"sample 4 \(#1 of the batch\): 'second_per_grid_ts' has 2 entries but 'video_grid_thw' has 1"
    ):
        PaddingFreeCollator()([a, dict(b, second_per_grid_ts=torch.tensor([1.0, 2.0]))])
    with pytest.raises(ValueError, match=r"sample 5 \(#1 of the batch\) has 'video_grid_thw' but no 'second_per_grid_ts'"):
        PaddingFreeCollator()([a, sample(5, [2, 2, 2], None)])
    with pytest.raises(ValueError, match=r"second_per_grid_ts has 1 entries but video_grid_thw has 2 videos"):
        check_media(dict(batch, second_per_grid_ts=batch["second_per_grid_ts"][:1]), cfg)


FAMILIES = {  # name -> (layout its rope function takes, reads second_per_grid_ts)
    "tiny-qwen2-vl": ("video", False),
    "tiny-qwen2.5-vl": ("video", True),
    "tiny-qwen3-vl": ("frame", False),
    "tiny-qwen3.5-vl": ("frame", False),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_video_positions_and_wrong_layout(name):
    """Images and multi-frame videos in one sample: positions == the model's own function in the layout the
    family takes; the other layout is refused naming the sample (the model's own function fails on it)."""
    cfg = config(name)
    layout, timed = FAMILIES[name]
    grids = [[3, 2, 4], [2, 4, 2]]
    stamps = [[[27, 15 + k] for k in range(g[0])] for g in grids]

    def tokens(per_frame):
        return sample_tokens(
            [
                image_run([1, 4, 2]),
                video_run(grids[0], per_frame=per_frame, timestamps=stamps[0]),
                video_run(grids[1], per_frame=per_frame, timestamps=stamps[1]),
            ]
        )

    kw = {"image_grid_thw": torch.tensor([[1, 4, 2]]), "video_grid_thw": torch.tensor(grids)}
    if timed:
        kw["second_per_grid_ts"] = torch.tensor([0.25, 1.5])
    ids, mm = tokens(layout == "frame")
    pos = mrope_position_ids(ids, mm, model=cfg, sample_id=8, **kw)
    assert torch.equal(pos[1:], own(cfg, ids, mm, **kw))
    bad_ids, bad_mm = tokens(layout != "frame")
    with pytest.raises((RuntimeError, StopIteration)):
        own(cfg, bad_ids, bad_mm, **kw)
    with pytest.raises(ValueError, match=r"sample 8: .*(timestamp text|ONE run)"):
        mrope_position_ids(bad_ids, bad_mm, model=cfg, sample_id=8, **kw)


def test_image_processor_follows_the_family():
    """Qwen2-VL / Qwen2.5-VL images are normalised with that processor's own defaults (CLIP mean/std)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    q25 = image_processor_for(tiny_config("tiny-qwen2.5-vl"))
    assert q25.patch_size == 14 and list(q25.image_mean) == list(Qwen2VLImageProcessorPil().image_mean)
    q3 = image_processor_for(tiny_config("tiny-qwen3-vl"))
    assert q3.patch_size == 16 and list(q3.image_mean) == [0.5, 0.5, 0.5]


# ------------------------------------------------------------------------- packed == per-sample (model path)
def _per_sample(model, samples):
    model.zero_grad(set_to_none=True)
    n_sup = sum(sum(x != -100 for x in s["labels"][1:]) for s in samples)
    logits_all, total = [], 0.0
    for s in samples:
        kw = {
            "input_ids": torch.tensor([s["input_ids"]]),
            "mm_token_type_ids": torch.tensor([s["mm_token_type_ids"]]),
            "use_cache": False,
        }
        for key in (
            "pixel_values",
            "image_grid_thw",
            "pixel_values_videos",
            "video_grid_thw",
            "second_per_grid_ts",
        ):
            if key in s:
                kw[key] = s[key]
        model.model.rope_deltas = None
        logits = model(**kw).logits  # the model's own positions (get_rope_index with second_per_grid_ts)
        total = total + causal_lm_loss(logits, torch.tensor([s["labels"]]), num_items_in_batch=1)
        logits_all.append(logits[0].detach())
    loss = total / n_sup
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(logits_all), loss.detach(), grads


def _packed(model, batch, *, grad=True):
    model.zero_grad(set_to_none=True)
    kw = {k: v for k, v in batch.items() if k not in ("labels", "sample_ids", "loss_scale")}
    with torch.set_grad_enabled(grad):
        logits = model(use_cache=False, **kw).logits
    if not grad:
        return logits[0].detach(), None, None
    loss = causal_lm_loss(logits, batch["labels"], seq_idx=batch["seq_idx"])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits[0].detach(), loss.detach(), grads


def test_packed_equals_per_sample_qwen25_video(tok, processors):
    """Tiny Qwen2.5-VL, videos at different frame rates + an image + text in one packed row == each sample alone
    with the model's own positions. Negative control: the 1.0 s default timing (varpack before) is not exact."""
    from varpack.integrations.transformers import enable_varpack

    ref_model = tiny_model("tiny-qwen2.5-vl")
    chats = [
        video_chat(clip(8, 28, 56, fps=10.0, total=20, seed=0), "What moves?", "A dot, left to right."),
        [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": package_image_path("skimage", "astronaut.png")},
                    {"type": "text", "text": "Who?"},
                ],
            },
            {"role": "assistant", "content": "An astronaut."},
        ],
        video_chat(clip(6, 56, 28, fps=24.0, total=120, seed=1), "How long?", "Five seconds."),
    ]
    proc = processors["tiny-qwen2.5-vl"]
    samples = [
        encode_mm_chat(c, tok, processors["image"], sample_id=i, video_processor=proc, rope_model=ref_model)
        for i, c in enumerate(chats)
    ]
    timings = [s["second_per_grid_ts"].item() for s in samples if "second_per_grid_ts" in s]
    assert len(timings) == 2 and all(t != 1.0 for t in timings) and timings[0] != timings[1]
    ref = _per_sample(ref_model, samples)

    model = prepare_vl_model(enable_varpack(copy.deepcopy(ref_model)))
    batch = PaddingFreeCollator()(samples)
    logits, loss, grads = _packed(model, batch)
    assert (logits - ref[0]).abs().max().item() <= ATOL
    assert abs(loss.item() - ref[1].item()) <= 1e-5
    assert ref[2].keys() == grads.keys()
    worst = max(((ref[2][n] - grads[n]).abs().max() / (1 + ref[2][n].abs().max())).item() for n in grads)
    assert worst <= ATOL

    # negative control: positions computed at the model's 1.0 s default for every video
    wrong = [dict(s) for s in samples]
    for s in wrong:
        if "second_per_grid_ts" in s:
            pos = mrope_position_ids(
                s["input_ids"],
                s["mm_token_type_ids"],
                model=ref_model,
                video_grid_thw=s["video_grid_thw"],
                second_per_grid_ts=torch.ones(1),
            )
            s["position_ids"] = pos.tolist()
    bad, _, _ = _packed(model, PaddingFreeCollator()(wrong), grad=False)
    assert (bad - ref[0]).abs().max().item() > 1e-4


# --------------------------------------------------------------------------- item 5: video layouts rejected
@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-qwen3.5-vl"])
def test_frames_without_timestamp_text_named(name):
    """Two frames in one run (no timestamp text between them): the model's function raises a shape error;
    varpack names the sample, the video and why."""
    cfg = tiny_config(name)
    grid = torch.tensor([[2, 2, 2]])
    ids, mm = sample_tokens([video_run([2, 2, 2], per_frame=False)])
    with pytest.raises(RuntimeError):  # what the model's own function does with it
        own(cfg, ids, mm, video_grid_thw=grid)
    with pytest.raises(
        ValueError,
        match=r"sample 12: video 0 \(2 frames.* is one run of 2 video tokens at token 3, "
        r"with no text between its frames.*timestamp text",
    ) as err:
        mrope_position_ids(ids, mm, model=cfg, video_grid_thw=grid, sample_id=12)
    assert isinstance(err.value.__cause__, RuntimeError)
    # with the timestamp text between the frames the positions are the model's own
    ok_ids, ok_mm = sample_tokens([video_run([2, 2, 2], per_frame=True, timestamps=[[27, 15], [27, 16]])])
    pos = mrope_position_ids(ok_ids, ok_mm, model=cfg, video_grid_thw=grid, sample_id=12)
    assert torch.equal(pos[1:], own(cfg, ok_ids, ok_mm, video_grid_thw=grid))


def test_qwen3_video_from_processor_equals_models_own(tok, processors):
    """Qwen3VLProcessor's own frame timestamps (replace_video_token): positions == the model's function."""
    cfg = tiny_config("tiny-qwen3-vl")
    chat = video_chat(clip(6, 28, 56, fps=10.0, total=30, seed=2), "What moves?", "A dot.")
    s = encode_mm_chat(
        chat,
        tok,
        processors["image"],
        sample_id=0,
        video_processor=processors["tiny-qwen3-vl"],
        rope_model=cfg,
    )
    assert "second_per_grid_ts" not in s
    assert "seconds>" in tok.decode(s["input_ids"])
    ref = own(cfg, s["input_ids"], s["mm_token_type_ids"], video_grid_thw=s["video_grid_thw"])
    assert torch.equal(torch.tensor(s["position_ids"])[1:], ref)


def test_layouts_the_rope_function_cannot_take_are_named():
    cfg25 = tiny_config("tiny-qwen2.5-vl")
    grid = torch.tensor([[2, 2, 2]])
    # Qwen2.5-VL takes one run per video: frames split by text make the model's function stop early
    ids, mm = sample_tokens([video_run([2, 2, 2], per_frame=True, timestamps=[[27], [28]])])
    with pytest.raises(StopIteration):
        own(cfg25, ids, mm, video_grid_thw=grid, second_per_grid_ts=torch.tensor([1.0]))
    with pytest.raises(
        ValueError, match=r"sample 2: the video frames are separate runs .* takes each video as ONE"
    ):
        mrope_position_ids(ids, mm, model=cfg25, video_grid_thw=grid, second_per_grid_ts=[1.0], sample_id=2)
    # runs that fit neither layout: 3 frames of 1 token as runs of 2 and 1
    ids, mm = sample_tokens([([VS, VID, VID, 13, VID, VE], [0, 2, 2, 0, 2, 0])])
    with pytest.raises(
        ValueError,
        match=r"sample 2: video tokens .* runs of \[2, 1\] .* neither one run per video "
        r"\[3\] nor one run per frame \[1, 1, 1\]",
    ):
        mrope_position_ids(
            ids, mm, model=cfg25, video_grid_thw=[[3, 2, 2]], second_per_grid_ts=[1.0], sample_id=2
        )
    # two images with no text between them form one run; the model's function would fail on the shapes
    ids, mm = sample_tokens([([VS, IMG, IMG, VE], [0, 1, 1, 0])])
    cfg3 = tiny_config("tiny-qwen3-vl")
    with pytest.raises(RuntimeError):
        own(cfg3, ids, mm, image_grid_thw=torch.tensor([[1, 2, 2], [1, 2, 2]]))
    with pytest.raises(ValueError, match=r"sample 2: image tokens .* form 1 runs \[2\] .* has 2 images"):
        mrope_position_ids(ids, mm, model=cfg3, image_grid_thw=[[1, 2, 2], [1, 2, 2]], sample_id=2)


# ---------------------------------------------------------------- rope-function arguments varpack cannot give
def _bound(cls):
    return types.MethodType(cls.get_rope_index, object())


@pytest.mark.parametrize(
    "module, cls, takes_seconds",
    [
        ("qwen2_vl", "Qwen2VLModel", False),
        ("qwen2_5_vl", "Qwen2_5_VLModel", True),
        ("qwen3_vl", "Qwen3VLModel", False),
        ("qwen3_vl_moe", "Qwen3VLMoeModel", False),
        ("qwen3_5", "Qwen3_5Model", False),
        ("qwen3_5_moe", "Qwen3_5MoeModel", False),
    ],
)
def test_rope_args_of_supported_families(module, cls, takes_seconds):
    import importlib

    model_cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)
    args = rope_args(_bound(model_cls))
    assert {"input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw"} <= args
    assert ("second_per_grid_ts" in args) == takes_seconds


@pytest.mark.parametrize(
    "module, cls, names",
    [
        ("qwen2_5_omni", "Qwen2_5OmniPreTrainedModelForConditionalGeneration", r"use_audio_in_video"),
        ("glm_image", "GlmImageModel", r"images_per_sample"),
        ("minicpmv4_7", "MiniCPMV4_7Model", r"target_sizes"),
    ],
)
def test_rope_args_refuses_arguments_varpack_cannot_supply(module, cls, names):
    import importlib

    try:
        mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    except ImportError:
        pytest.skip(f"transformers has no {module}")
    model_cls = getattr(mod, cls, None)
    if model_cls is None or "get_rope_index" not in vars(model_cls):
        pytest.skip(f"{cls} has no get_rope_index in this transformers")
    with pytest.raises(
        TypeError, match=rf"{cls}.get_rope_index.* takes \[.*'{names}'.*which varpack does not"
    ):
        rope_args(_bound(model_cls))


def test_rope_index_fn_refuses_model_with_unsupplied_arguments():
    """A model whose get_rope_index needs more than varpack gives is refused before any position is computed."""
    cfg = tiny_config("tiny-qwen3-vl")

    class Owner:
        config = cfg

        def get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw=None, use_audio_in_video=False):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match=r"takes \['use_audio_in_video'\], which varpack does not supply"):
        rope_index_fn(Owner())
    ids, mm = sample_tokens([image_run([1, 2, 2])])
    with pytest.raises(TypeError, match="use_audio_in_video"):
        mrope_position_ids(ids, mm, model=Owner(), image_grid_thw=[[1, 2, 2]], sample_id=0)

    class NoVideo:
        config = cfg

        def get_rope_index(
            self, input_ids, mm_token_type_ids, image_grid_thw=None, attention_mask=None, **kwargs
        ):
            return own(cfg, input_ids[0], mm_token_type_ids[0], image_grid_thw=image_grid_thw)[:, None], None

    v_ids, v_mm = sample_tokens([video_run([1, 2, 2], per_frame=True)])
    with pytest.raises(ValueError, match=r"sample 3: the sample has videos but .*takes no video_grid_thw"):
        mrope_position_ids(v_ids, v_mm, model=NoVideo(), video_grid_thw=[[1, 2, 2]], sample_id=3)
