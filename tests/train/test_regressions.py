"""Regressions found by trying varpack as a new user would (fresh clone, real data, bad input)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from varpack.loss import causal_lm_loss
from varpack.ops.linear_ce import linear_cross_entropy


def _all_masked(T=6, V=11, D=4):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, D, generator=g, requires_grad=True)
    weight = torch.randn(V, D, generator=g, requires_grad=True)
    labels = torch.full((T,), -100)
    return hidden, weight, labels


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_step_without_supervised_tokens_gives_zero_loss_and_grads_not_nan(reduction):
    """An optimizer step whose packs hold only prompt tokens (e.g. prompt pieces of split samples) makes HF
    Trainer pass num_items_in_batch = tensor(0). That must give loss 0 and zero gradients, not 0/0 = NaN that
    poisons every weight (seen: `varpack sft` saved an all-NaN model and exited 0)."""
    hidden, weight, labels = _all_masked()
    seq_idx = torch.tensor([0, 0, 0, 1, 1, 1])
    zero = torch.tensor(0)
    loss = linear_cross_entropy(hidden, weight, labels, reduction=reduction, seq_idx=seq_idx, num_items_in_batch=zero)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(hidden.grad) == 0 and torch.count_nonzero(weight.grad) == 0

    logits = (hidden.detach() @ weight.detach().T).unsqueeze(0).requires_grad_(True)
    loss2 = causal_lm_loss(logits, labels.unsqueeze(0), reduction=reduction, seq_idx=seq_idx.unsqueeze(0),
                           num_items_in_batch=zero)  # fmt: skip
    loss2.backward()
    assert loss2.item() == 0.0 and torch.isfinite(logits.grad).all() and torch.count_nonzero(logits.grad) == 0


def test_nonzero_denominator_unchanged_by_the_clamp():
    """Negative control for the clamp: with a real denominator the loss is the plain token mean."""
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(5, 4, generator=g), torch.randn(7, 4, generator=g)
    labels = torch.tensor([-100, 3, 1, -100, 6])
    plain = torch.nn.functional.cross_entropy(hidden @ weight.T, labels, reduction="sum") / 3
    got = linear_cross_entropy(hidden, weight, labels, num_items_in_batch=torch.tensor(3))
    torch.testing.assert_close(got, plain)


def test_jsonl_with_unicode_line_separator_inside_strings(tmp_path):
    """JSON Lines split on '\\n' only: U+2028 inside a JSON string (../shared/data/gsm8k.jsonl line 2382) is
    part of the row, not a line break. `varpack plan` rejected that file as invalid JSON."""
    from varpack.data.multimodal import has_mm_chats, load_mm_rows

    rows = [
        {"messages": [{"role": "user", "content": "a\u2028b"}, {"role": "assistant", "content": "c\u2029d"}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
    ]
    path = tmp_path / "ls.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    assert "\u2028" in path.read_text(encoding="utf-8")
    assert has_mm_chats([str(path)]) is False
    loaded = load_mm_rows([str(path)])
    assert len(loaded) == 2
    # a real syntax error is still reported with file:line
    path.write_text(path.read_text(encoding="utf-8") + "{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"ls.jsonl:3: sample 2: invalid JSON"):
        has_mm_chats([str(path)])


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_data_file_is_a_clear_error(tmp_path, content):
    from varpack.data.chat import load_chat_data

    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match="contains no rows"):
        load_chat_data([str(path)])


def test_sft_default_overflow_is_error():
    """The README says overlong samples are refused unless a policy is chosen: sft must agree with plan."""
    from varpack.train import SFTConfig

    assert SFTConfig().overflow == "error"


def test_sft_refuses_image_cuts_before_training(tmp_path):
    """An overflow piece that would cut through an image is refused when the run is built, not when training
    reaches that pack (seen: 3 steps ran, then the run died)."""
    from varpack.data.media import image_processor_for
    from varpack.data.multimodal import encode_any, image_spans
    from varpack.data.tokenizer import load_tokenizer
    from varpack.data.vl_builtin import write_vl_jsonl
    from varpack.models import load_model
    from varpack.train import SFTConfig, build_sft

    model = load_model("tiny-qwen3-vl", seed=0)
    path = write_vl_jsonl(tmp_path / "vl.jsonl", limit=3)
    proc = image_processor_for(model, min_pixels=32 * 32, max_pixels=128 * 128)
    samples = encode_any(path, load_tokenizer("qwen3"), image_processor=proc, rope_model=model)
    for s in samples:  # every token supervised: no piece is left out for want of labels (image pieces would be)
        s["labels"] = [-100] + list(s["input_ids"][1:])
    with_img = [s for s in samples if "image_grid_thw" in s]
    span = image_spans(with_img[0])[0]
    budget = int(span["start"]) + 2  # the first cut lands inside the first image
    assert budget < int(span["stop"])
    config = SFTConfig(model="tiny-qwen3-vl", packing_length=budget, overflow="split", max_steps=1,
                       output_dir=str(tmp_path), save=False)  # fmt: skip
    with pytest.raises(ValueError, match="would cut through an image"):
        build_sft(config, model=model, tokenizer=load_tokenizer("qwen3"), encoded=samples)
    # negative control: dropping overlong samples instead builds fine
    lengths = np.array([s["length"] for s in samples])
    if (lengths <= budget).any():
        ok = SFTConfig(model="tiny-qwen3-vl", packing_length=budget, overflow="drop", max_steps=1,
                       output_dir=str(tmp_path), save=False)  # fmt: skip
        build_sft(ok, model=model, tokenizer=load_tokenizer("qwen3"), encoded=samples)


def test_report_names_pieces_that_keep_no_supervised_token():
    """Truncating a sample whose long prompt fills the budget leaves a piece that trains nothing: it is left
    out of the packs and the packing report says so by sample id and token range."""
    from varpack.data.dataset import supervised_ranges
    from varpack.plan import plan_packs
    from varpack.plan.report import format_packing_report

    long_prompt = {"input_ids": list(range(10)), "labels": [-100] * 8 + [5, 6], "length": 10}
    short = {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "length": 3}
    samples = [short, long_prompt]
    plan = plan_packs([3, 10], 6, overflow="truncate", supervised=supervised_ranges(samples))
    assert plan.overflow["unsupervised_pieces"] == [[1, 0, 6]] and [p.tolist() for p in plan.packs] == [[0]]
    report = format_packing_report(plan, data="toy", input_tokens=13)
    assert "1 piece(s) left out, no supervised token" in report and "sample 1 [0, 6)" in report
    # negative control: with the answer inside the budget nothing is reported
    plan_ok = plan_packs([3, 10], 10, overflow="truncate", supervised=supervised_ranges(samples))
    assert plan_ok.overflow["unsupervised_pieces"] == [] and "no loss" not in format_packing_report(
        plan_ok, data="toy", input_tokens=13
    )


def test_sft_on_a_vl_model_without_data_uses_the_builtin_image_captions(tmp_path, monkeypatch):
    """`varpack sft --model tiny-qwen3-vl` with no --data trains on the built-in image-caption chats (real
    package images), not on text-only chats that would never exercise the vision path."""
    from varpack.train import SFTConfig, build_sft

    monkeypatch.setenv("VARPACK_CACHE", str(tmp_path / "cache"))
    config = SFTConfig(model="tiny-qwen3-vl", packing_length=2048, max_steps=1, output_dir=str(tmp_path), save=False)
    run = build_sft(config)
    assert "built-in image-caption chats" in run.report
    with_images = [s for s in run.encoded if "image_grid_thw" in s]
    assert with_images and len(with_images) < len(run.encoded)  # images and text-only chats mixed
    assert run.config.data and run.config.data[0].endswith("vl_builtin.jsonl")


def test_bad_row_error_names_file_and_line_across_several_files(tmp_path):
    """With several data files the global sample id alone does not tell the user where to look."""
    from varpack.data.chat import encode_dataset, load_chat_data
    from varpack.data.tokenizer import load_tokenizer

    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(json.dumps(good) for _ in range(3)) + "\n")
    b.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")  # the bad row is on line 3 of b
    with pytest.raises((ValueError, TypeError), match=r"b\.jsonl:3: sample 4: messages\[1\]\.content is missing or null"):
        encode_dataset(load_chat_data([str(a), str(b)]), load_tokenizer("qwen3"))
