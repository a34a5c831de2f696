"""Encoding of vision-language chats: expanded placeholders, labels, mm_token_type_ids, errors, cuts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("PIL")
pytest.importorskip("skimage")

from PIL import Image  # noqa: E402

from varpack.data.chat import encode_chat  # noqa: E402
from varpack.data.media import image_processor_for  # noqa: E402
from varpack.data.multimodal import (  # noqa: E402
    check_plan_cuts,
    encode_any,
    encode_mm_chat,
    encode_mm_dataset,
    has_mm_chats,
    image_spans,
    is_mm_chat,
    legal_cut,
    nearest_legal_cut,
    slice_mm_sample,
    validate_cut,
)
from varpack.data.tokenizer import load_tokenizer  # noqa: E402
from varpack.data.vl_builtin import builtin_vl_chats, package_image_path, write_vl_jsonl  # noqa: E402
from varpack.models.qwen_vl import QWEN3_VISION_TOKENS, tiny_config  # noqa: E402

IMG = QWEN3_VISION_TOKENS["image_token_id"]
VS = QWEN3_VISION_TOKENS["vision_start_token_id"]
VE = QWEN3_VISION_TOKENS["vision_end_token_id"]
MERGE = 2


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3")


@pytest.fixture(scope="module")
def proc():
    # small pixel budget: short sequences, still different grids per aspect ratio
    return image_processor_for(tiny_config("tiny-qwen3-vl"), min_pixels=32 * 32, max_pixels=128 * 128)


def img(name: str) -> str:
    return package_image_path("matplotlib" if name == "grace_hopper.jpg" else "skimage", name)


def chat_two_images() -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": img("astronaut.png")},
                {"type": "text", "text": "Compare the two pictures."},
                {"type": "image", "image": img("text.png")},
            ],
        },
        {"role": "assistant", "content": "An astronaut portrait and a page of handwritten maths."},
    ]


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, t in enumerate([*ids, None]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_span_counts_follow_grids_mixed_resolutions(tok, proc):
    s = encode_mm_chat(chat_two_images(), tok, proc, sample_id=3)
    grid = s["image_grid_thw"]
    # the two images have different sizes -> different grids (mixed resolutions in one sample)
    assert grid.shape == (2, 3) and grid[0].tolist() != grid[1].tolist()
    # the processor alone gives the same grids and pixels (one call per image, independent of our batching)
    for i, name in enumerate(["astronaut.png", "text.png"]):
        alone = proc(images=[Image.open(img(name)).convert("RGB")], return_tensors="pt")
        assert alone["image_grid_thw"][0].tolist() == grid[i].tolist()
    assert s["pixel_values"].shape[0] == int(grid.prod(-1).sum())
    runs = _runs(s["input_ids"], IMG)
    assert [b - a for a, b in runs] == (grid.prod(-1) // MERGE**2).tolist()
    for a, b in runs:
        assert s["input_ids"][a - 1] == VS and s["input_ids"][b] == VE
    assert s["length"] == len(s["input_ids"]) == len(s["labels"]) == len(s["mm_token_type_ids"])


def test_collapsed_stream_equals_text_encoding(tok, proc):
    """With each run of pads collapsed to one, the sample is exactly the text encoding of the rendered chat."""
    s = encode_mm_chat(chat_two_images(), tok, proc, sample_id=0)
    rendered = [
        {
            "role": "user",
            "content": "<|vision_start|><|image_pad|><|vision_end|>Compare the two pictures."
            "<|vision_start|><|image_pad|><|vision_end|>",
        },
        {"role": "assistant", "content": "An astronaut portrait and a page of handwritten maths."},
    ]
    ref = encode_chat(rendered, tok, sample_id=0)
    keep = [
        i for i, t in enumerate(s["input_ids"]) if not (t == IMG and i > 0 and s["input_ids"][i - 1] == IMG)
    ]
    assert [s["input_ids"][i] for i in keep] == ref["input_ids"]
    assert [s["labels"][i] for i in keep] == ref["labels"]
    # supervision is the assistant reply + <|im_end|>, nothing else
    supervised = [t for t in s["labels"] if t != -100]
    assert tok.decode(supervised) == "An astronaut portrait and a page of handwritten maths.<|im_end|>"


def test_labels_and_types_over_spans(tok, proc):
    msgs = [
        {"role": "user", "content": "Draw me something."},
        # an image inside an assistant turn: its span is still never supervised
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Here:"}, {"type": "image", "image": img("horse.png")}],
        },
    ]
    s = encode_mm_chat(msgs, tok, proc, sample_id=5)
    ids, labels, types = s["input_ids"], s["labels"], s["mm_token_type_ids"]
    assert types == [1 if t == IMG else 0 for t in ids]
    spans = image_spans(s)
    assert len(spans) == 1
    a, b = spans[0]["start"], spans[0]["stop"]
    assert ids[a] == VS and ids[b - 1] == VE
    assert all(label == -100 for label in labels[a:b])
    assert any(label != -100 for label in labels[:a])  # "Here:" is supervised
    assert labels[b] != -100  # <|im_end|> after the image is supervised
    assert labels[0] == -100


def test_text_only_chat_equals_encode_chat(tok, proc):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]
    s = encode_mm_chat(msgs, tok, proc, sample_id=1)
    ref = encode_chat(msgs, tok, sample_id=1)
    assert (
        s["input_ids"] == ref["input_ids"] and s["labels"] == ref["labels"] and s["length"] == ref["length"]
    )
    assert s["mm_token_type_ids"] == [0] * s["length"]
    assert "pixel_values" not in s and "image_grid_thw" not in s
    assert (
        not is_mm_chat(msgs) and is_mm_chat(chat_two_images()) and is_mm_chat({"messages": chat_two_images()})
    )


def test_lengths_only_path_matches_full_encoding(tok, proc):
    full = encode_mm_chat(chat_two_images(), tok, proc, sample_id=0)
    fast = encode_mm_chat(chat_two_images(), tok, proc, sample_id=0, with_pixels=False)
    assert fast["input_ids"] == full["input_ids"] and fast["labels"] == full["labels"]
    assert fast["length"] == full["length"]
    assert "pixel_values" not in fast


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        (
            [
                {"role": "user", "content": [{"type": "image", "image": "/nonexistent/cat.png"}]},
                {"role": "assistant", "content": "x"},
            ],
            r"sample 7: messages\[0\]\.content\[0\]: image file not found: '/nonexistent/cat.png'",
        ),
        (
            [
                {"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]},
                {"role": "assistant", "content": "x"},
            ],
            r"sample 7: messages\[0\]\.content\[0\]: unknown content part type 'audio'",
        ),
        (
            [{"role": "user", "content": "look <|image_pad|>"}, {"role": "assistant", "content": "x"}],
            r"sample 7: messages\[0\]\.content: text contains the reserved vision token\(s\) \['<\|image_pad\|>'\]",
        ),
        (
            [
                {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]},
                {"role": "assistant", "content": "x"},
            ],
            r"messages\[0\]\.content\[0\]: video part but no video processor was given \(sample 7\)",
        ),
        (
            [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "x"}],
            r"sample 7: messages\[0\]\.content\[0\]: image part has none of the keys",
        ),
        (
            [
                {"role": "user", "content": [{"type": "image", "image": "https://example.com/a.png"}]},
                {"role": "assistant", "content": "x"},
            ],
            r"is a URL",
        ),
    ],
)
def test_errors_name_sample_and_field(tok, proc, messages, match):
    with pytest.raises(ValueError, match=match):
        encode_mm_chat(messages, tok, proc, sample_id=7)


def test_type_errors(tok, proc):
    with pytest.raises(TypeError, match=r"sample 2: messages\[0\]\.content\[0\]: text part needs a str"):
        encode_mm_chat([{"role": "user", "content": [{"type": "text", "text": 3}]}], tok, proc, sample_id=2)
    with pytest.raises(ValueError, match=r"image part but no image processor"):
        encode_mm_chat(chat_two_images(), tok, None, sample_id=2)


def test_video_processor_contract(tok, proc):
    msgs = [
        {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]},
        {"role": "assistant", "content": "x"},
    ]
    with pytest.raises(
        TypeError, match=r"sample 6: messages\[0\]\.content\[0\]: video_processor must be a full Qwen-VL"
    ):
        encode_mm_chat(msgs, tok, proc, sample_id=6, video_processor=object())


def test_has_mm_chats(tmp_path):
    rows = [{"messages": chat_two_images()}, {"messages": [{"role": "user", "content": "x"}]}]
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = tmp_path / "b.jsonl"
    text.write_text(json.dumps(rows[1]) + "\n")
    assert has_mm_chats(path) and has_mm_chats([str(text), str(path)]) and has_mm_chats(rows)
    assert not has_mm_chats(text) and not has_mm_chats(rows[1:]) and not has_mm_chats(tmp_path / "c.parquet")


def test_unreadable_image(tok, proc, tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not a png")
    msgs = [
        {"role": "user", "content": [{"type": "image", "image": str(bad)}]},
        {"role": "assistant", "content": "x"},
    ]
    with pytest.raises(ValueError, match=r"sample 4: messages\[0\]\.content\[0\]: cannot read image"):
        encode_mm_chat(msgs, tok, proc, sample_id=4)


def test_dataset_from_jsonl_relative_paths(tok, proc, tmp_path):
    shutil.copy(img("chelsea.png"), tmp_path / "cat.png")
    rows = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "?"}],
                },
                {"role": "assistant", "content": "A cat."},
            ]
        },
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = encode_mm_dataset(path, tok, proc)
    assert len(samples) == 2
    assert samples[0]["image_grid_thw"].shape == (1, 3) and "pixel_values" not in samples[1]
    assert samples[1]["mm_token_type_ids"] == [0] * samples[1]["length"]
    # the error names the row index
    rows.append(
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": "missing.png"}]},
                {"role": "assistant", "content": "x"},
            ]
        }
    )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"sample 2: messages\[0\]\.content\[0\]: image file not found"):
        encode_mm_dataset(path, tok, proc)
    # encode_any routes: image chats -> list of samples; text-only chats -> encode_dataset's Dataset
    mixed = encode_any(rows[:2], tok, image_processor=proc, image_root=tmp_path)
    assert isinstance(mixed, list) and mixed[0]["input_ids"] == samples[0]["input_ids"]
    text = encode_any([rows[1]], tok)
    assert list(text[0]["input_ids"]) == samples[1]["input_ids"]


def test_builtin_vl_set_encodes(tok, proc, tmp_path):
    chats = builtin_vl_chats()
    path = write_vl_jsonl(tmp_path / "vl.jsonl")
    samples = encode_mm_dataset(path, tok, proc, with_pixels=False)
    assert len(samples) == len(chats)
    n_img = sum(is_mm_chat(c) for c in chats)
    assert 0 < n_img < len(chats)  # images and text-only chats mixed
    with_images = [s for s in samples if any(s["mm_token_type_ids"])]
    assert len(with_images) == n_img


# ------------------------------------------------------------------------------------------------ cuts
@pytest.fixture(scope="module")
def two_image_sample(tok, proc):
    return encode_mm_chat(chat_two_images(), tok, proc, sample_id=9)


def test_spans_and_legal_cuts(two_image_sample):
    s = two_image_sample
    spans = image_spans(s)
    assert [sp["kind"] for sp in spans] == ["image", "image"]
    for sp in spans:
        assert legal_cut(s, sp["start"]) and legal_cut(s, sp["stop"])
        for cut in range(sp["start"] + 1, sp["stop"]):
            assert not legal_cut(s, cut)
        assert nearest_legal_cut(s, sp["start"] + 3) == sp["start"]
    assert nearest_legal_cut(s, spans[0]["stop"]) == spans[0]["stop"]


def test_validate_cut_rejects_inside_span(two_image_sample):
    s = two_image_sample
    sp = image_spans(s)[1]
    with pytest.raises(ValueError, match=rf"sample 9: cut at token {sp['start'] + 2} .* inside image 1"):
        validate_cut(s, 0, sp["start"] + 2, sample_id=9)
    with pytest.raises(ValueError, match=r"not within"):
        validate_cut(s, 5, 5, sample_id=9)
    report = validate_cut(s, 0, sp["start"], sample_id=9)
    assert report["images"] == [0]


def test_slice_keeps_media_of_piece(two_image_sample, tok, proc):
    s = two_image_sample
    first, second = image_spans(s)
    cut = first["stop"]
    head = slice_mm_sample(s, 0, cut, sample_id=9)
    tail = slice_mm_sample(s, cut, s["length"], sample_id=9)
    patches0 = int(s["image_grid_thw"][0].prod())
    assert head["image_grid_thw"].tolist() == s["image_grid_thw"][:1].tolist()
    assert torch.equal(head["pixel_values"], s["pixel_values"][:patches0])
    assert tail["image_grid_thw"].tolist() == s["image_grid_thw"][1:].tolist()
    assert torch.equal(tail["pixel_values"], s["pixel_values"][patches0:])
    assert head["input_ids"] + tail["input_ids"] == s["input_ids"]
    assert tail["labels"][0] == -100 and tail["length"] == s["length"] - cut
    # pieces with positions: text plane restarts, mRoPE planes kept
    from varpack.models.qwen_vl import tiny_config as cfg

    sp = encode_mm_chat(chat_two_images(), tok, proc, sample_id=9, rope_model=cfg("tiny-qwen3-vl"))
    piece = slice_mm_sample(sp, cut, sp["length"], sample_id=9)
    pos = torch.tensor(piece["position_ids"])
    assert pos[0].tolist() == list(range(sp["length"] - cut))
    assert pos[1:].tolist() == torch.tensor(sp["position_ids"])[1:, cut:].tolist()


def test_check_plan_cuts_reports_illegal_pieces(two_image_sample):
    s = two_image_sample
    sp = image_spans(s)[0]
    pieces = {1: (0, 0, sp["start"] + 1), 2: (0, sp["start"] + 1, s["length"]), 3: (0, 0, sp["stop"])}
    bad = check_plan_cuts([s], pieces)
    assert [b["piece_id"] for b in bad] == [1, 2]
    assert "inside image 0" in bad[0]["error"]
