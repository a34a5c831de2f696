"""Per-sample mRoPE position ids: equal to the model's own positions for that sample alone, text plane first."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("PIL")
pytest.importorskip("skimage")

from varpack.data.media import image_processor_for  # noqa: E402
from varpack.data.multimodal import encode_mm_chat  # noqa: E402
from varpack.data.tokenizer import load_tokenizer  # noqa: E402
from varpack.data.vl_builtin import package_image_path  # noqa: E402
from varpack.models.qwen_vl import tiny_config, tiny_model  # noqa: E402
from varpack.rope.mrope import mrope_position_ids, rope_index_fn, split_planes  # noqa: E402

MODELS = ["tiny-qwen3-vl", "tiny-qwen3.5-vl"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3")


@pytest.fixture(scope="module")
def proc():
    return image_processor_for(tiny_config("tiny-qwen3-vl"), min_pixels=32 * 32, max_pixels=128 * 128)


def img(name: str) -> str:
    return package_image_path("matplotlib" if name == "grace_hopper.jpg" else "skimage", name)


def chats() -> list[list[dict]]:
    return [
        # one square image
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": img("astronaut.png")},
                    {"type": "text", "text": "Who?"},
                ],
            },
            {"role": "assistant", "content": "An astronaut."},
        ],
        # three images of different aspect ratios, text between them, odd total length
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Three pictures:"},
                    {"type": "image", "image": img("text.png")},
                    {"type": "image", "image": img("grace_hopper.jpg")},
                    {"type": "text", "text": "and"},
                    {"type": "image", "image": img("page.png")},
                ],
            },
            {"role": "assistant", "content": "Maths, a portrait and a page."},
        ],
        # image in a later turn
        [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi, send a picture."},
            {"role": "user", "content": [{"type": "image", "image": img("chelsea.png")}]},
            {"role": "assistant", "content": "A cat."},
        ],
        # text only
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    ]


def _model_own_positions(base, sample) -> torch.Tensor:
    """What the model computes itself when given no position_ids (``compute_3d_position_ids``), [3, L]."""
    base.rope_deltas = None
    ids = torch.tensor([sample["input_ids"]])
    pos = base.compute_3d_position_ids(
        input_ids=ids,
        inputs_embeds=None,
        image_grid_thw=sample.get("image_grid_thw"),
        mm_token_type_ids=torch.tensor([sample["mm_token_type_ids"]]),
    )
    if pos is None:  # text-only: the language model falls back to arange on every plane
        pos = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
    base.rope_deltas = None
    return pos[:, 0]


@pytest.mark.parametrize("name", MODELS)
def test_positions_equal_models_own_function(name, tok, proc):
    config = tiny_config(name)
    with torch.device("meta"):
        model = tiny_model(name)  # weights on meta: only the index arithmetic is used
    for i, msgs in enumerate(chats()):
        s = encode_mm_chat(msgs, tok, proc, sample_id=i, rope_model=model)
        pos = torch.tensor(s["position_ids"])
        assert pos.shape == (4, s["length"])
        assert pos[0].tolist() == list(range(s["length"]))
        assert torch.equal(pos[1:], _model_own_positions(model.model, s)), f"sample {i}"
        # config-only route (meta-built base model) gives the same positions
        assert torch.equal(
            mrope_position_ids(
                s["input_ids"],
                s["mm_token_type_ids"],
                model=config,
                image_grid_thw=s.get("image_grid_thw"),
                sample_id=i,
            ),
            pos,
        )
    # the mRoPE planes really differ from plain text positions when images are present
    s = encode_mm_chat(chats()[1], tok, proc, sample_id=1, rope_model=config)
    pos = torch.tensor(s["position_ids"])
    assert not torch.equal(pos[1], pos[0]) and pos[1:].max() < pos[0].max()


def test_text_plane_first_is_what_the_model_consumes(tok, proc):
    """Unpacked forward: model-computed positions == our [4, 1, L] positions (the model splits plane 0 off)."""
    model = tiny_model("tiny-qwen3-vl")
    s = encode_mm_chat(chats()[1], tok, proc, sample_id=1, rope_model=model)
    kw = {
        "input_ids": torch.tensor([s["input_ids"]]),
        "mm_token_type_ids": torch.tensor([s["mm_token_type_ids"]]),
        "pixel_values": s["pixel_values"],
        "image_grid_thw": s["image_grid_thw"],
        "use_cache": False,
    }
    with torch.no_grad():
        model.model.rope_deltas = None
        own = model(**kw).logits
        ours = model(position_ids=torch.tensor(s["position_ids"])[:, None, :], **kw).logits
        # negative control: the text plane in place of the mRoPE planes changes the result
        wrong = torch.tensor(s["position_ids"])[[0, 0, 0, 0]][:, None, :]
        bad = model(position_ids=wrong, **kw).logits
    torch.testing.assert_close(ours, own, rtol=0, atol=1e-6)
    assert (bad - own).abs().max() > 1e-4


def test_rope_index_fn_sources():
    model = tiny_model("tiny-qwen3-vl")
    assert rope_index_fn(model) == model.model.get_rope_index
    assert rope_index_fn(model.model) == model.model.get_rope_index
    with pytest.raises(TypeError, match="get_rope_index"):
        rope_index_fn(torch.nn.Linear(2, 2))
    from transformers import Qwen3Config

    with pytest.raises(TypeError, match="no get_rope_index"):
        rope_index_fn(
            Qwen3Config(
                num_hidden_layers=1,
                hidden_size=8,
                intermediate_size=8,
                num_attention_heads=1,
                num_key_value_heads=1,
                vocab_size=16,
            )
        )


def test_count_mismatch_names_both_counts():
    config = tiny_config("tiny-qwen3-vl")
    ids = [1, 151652] + [151655] * 3 + [151653]
    types = [0, 0, 1, 1, 1, 0]
    with pytest.raises(ValueError, match=r"sample 4: 3 image placeholder tokens .* gives 4 features"):
        mrope_position_ids(ids, types, model=config, image_grid_thw=[[1, 4, 4]], sample_id=4)
    with pytest.raises(ValueError, match=r"sample 4: input_ids \(6,\) and mm_token_type_ids \(5,\)"):
        mrope_position_ids(ids, types[:5], model=config, sample_id=4)
    with pytest.raises(TypeError, match="integers"):
        mrope_position_ids([0.5], [0], model=config)


def test_split_planes():
    pos = torch.arange(12).view(4, 1, 3)
    text, mrope = split_planes(pos)
    assert text.tolist() == [[0, 1, 2]] and mrope.shape == (3, 1, 3)
    with pytest.raises(ValueError, match=r"4 planes .* shape \(3, 1, 3\)"):
        split_planes(pos[1:])
